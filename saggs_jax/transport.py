"""Moving optimizer state along a symmetry transform.

If ``A' = c A`` then ``dL/dA' = (dL/dA) / c``, so state of gradient degree k
(momentum k=1, second moment k=2) transports as ``s_A -> s_A c**-k`` and
``s_B -> s_B c**k``; parameter-like state (slow weights) has k=-1.

Each optimizer state type has a rule: which of its fields are moments and of
what degree, and which hold nested optimizer states. The optax state types are
registered below; users register their own with :func:`register_transport`.
An unregistered state that holds parameter-shaped trees is an error, never a
silent skip: transporting the parameters without the moments would quietly
change the optimizer's trajectory.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Union

import optax
import optax.contrib

from saggs_jax import paths
from saggs_jax.balance import Factors, scale_tree
from saggs_jax.pairs import Plan

NESTED = "nested"
"""Marks a field that holds an inner optimizer state to transport recursively."""

Degree = Union[int, float, str]
_RULES: dict[type, dict[str, Degree]] = {}


def register_transport(state_type: type, fields: Mapping[str, Degree]) -> None:
  """Declares how the fields of ``state_type`` move under a symmetry transform.

  Args:
    state_type: a NamedTuple or dataclass optimizer state type.
    fields: field name -> gradient degree k (1 for first moments, 2 for second
      moments, -1 for parameter-like state such as slow weights) or
      :data:`NESTED` for a field holding inner optimizer state(s). Fields not
      named (counters, hyperparameters) are left untouched.

  Example::

    >>> import typing, saggs_jax as saggs
    >>> class MyState(typing.NamedTuple):
    ...   count: object
    ...   momentum: object
    >>> saggs.register_transport(MyState, {"momentum": 1})
  """
  known = getattr(state_type, "_fields", None) or [f.name for f in dataclasses.fields(state_type)]
  unknown = set(fields) - set(known)
  if unknown:
    raise ValueError(f"{state_type.__name__} has no fields {sorted(unknown)}; it has {list(known)}.")
  _RULES[state_type] = dict(fields)


for _type, _fields in [
    (optax.ScaleByAdamState, {"mu": 1, "nu": 2}),
    (optax.ScaleByAmsgradState, {"mu": 1, "nu": 2, "nu_max": 2}),
    (optax.ScaleByBeliefState, {"mu": 1, "nu": 2}),
    (optax.ScaleByRStdDevState, {"mu": 1, "nu": 2}),
    (optax.ScaleByRmsState, {"nu": 2}),
    (optax.ScaleByRssState, {"sum_of_squares": 2}),
    (optax.ScaleByLionState, {"mu": 1}),
    (optax.TraceState, {"trace": 1}),
    (optax.ScaleByAdanState, {"m": 1, "v": 1, "n": 2, "g": 1}),
    (optax.ScaleByAdaDeltaState, {"e_g": 2, "e_x": -2}),
    (optax.contrib.MuonState, {"mu": 1}),
    (optax.contrib.ScaleByAdemamixState, {"m1": 1, "m2": 1, "nu": 2}),
    (optax.contrib.ScaleBySimplifiedAdEMAMixState, {"m": 1, "n": 2}),
    (optax.MultiStepsState, {"inner_opt_state": NESTED, "acc_grads": 1}),
    (optax.MaskedState, {"inner_state": NESTED}),
    (optax.PartitionState, {"inner_states": NESTED}),
    (optax.InjectHyperparamsState, {"inner_state": NESTED}),
    (optax.InjectStatefulHyperparamsState, {"inner_state": NESTED}),
    (optax.ApplyIfFiniteState, {"inner_state": NESTED}),
    (optax.ConditionallyMaskState, {"inner_state": NESTED}),
    (optax.ConditionallyTransformState, {"inner_state": NESTED}),
    (optax.LookaheadState, {"fast_state": NESTED}),
]:
  register_transport(_type, _fields)


def _replace(state, **changes):
  if hasattr(state, "_replace"):
    return state._replace(**changes)
  return dataclasses.replace(state, **changes)


def _declared_leaf(plan: Plan, tree: Any, is_leaf=None) -> str | None:
  """A path inside ``tree`` that ends in a declared parameter of the same shape."""
  for path, leaf in paths.leaves_with_paths(tree, is_leaf=is_leaf):
    segs = path.split("/")
    for i in range(len(segs)):
      suffix = "/".join(segs[i:])
      if suffix in plan.slots and tuple(getattr(leaf, "shape", ())) == plan.shapes[suffix]:
        return path
  return None


def _is_plain_container(s) -> bool:
  return isinstance(s, (list, dict)) or (isinstance(s, tuple) and not hasattr(s, "_fields"))


def transport(plan: Plan, state: Any, factors: Factors, where: str = "opt_state") -> Any:
  """Transports every registered moment inside ``state`` by ``factors``."""
  rule = _RULES.get(type(state))
  if rule is not None:
    changes = {}
    for field, degree in rule.items():
      value = getattr(state, field)
      sub = f"{where}.{field}"
      changes[field] = (transport(plan, value, factors, sub) if degree == NESTED
                        else scale_tree(plan, value, factors, -degree))
    return _replace(state, **changes)
  if _is_plain_container(state):
    # Moments kept directly in a plain container have no rule to say their degree.
    hit = _declared_leaf(plan, state, is_leaf=lambda x: not _is_plain_container(x))
    if hit is not None:
      raise TypeError(f"Cannot transport the plain container at {where}: it holds"
                      f" parameter-shaped arrays (e.g. at {hit!r}) with no state type to say"
                      " their degree. Wrap them in a NamedTuple state and register it with"
                      " saggs_jax.register_transport.")
    items = state.items() if isinstance(state, dict) else enumerate(state)
    new = {k: transport(plan, v, factors, f"{where}[{k!r}]") for k, v in items}
    return new if isinstance(state, dict) else type(state)(new[i] for i in range(len(state)))
  hit = _declared_leaf(plan, state)
  if hit is not None:
    name = type(state).__name__
    # nnx.state(optimizer) turns optax's NamedTuple states into plain mappings.
    hint = (" An nnx.state(optimizer) has lost the optax state types: pass"
            " optimizer.opt_state instead." if isinstance(state, Mapping) else "")
    raise TypeError(
        f"Cannot transport {name} at {where}: it holds parameter-shaped trees (e.g. at {hit!r})"
        f" and saggs_jax has no rule for it. Register one with"
        f" saggs_jax.register_transport({name}, {{'field': degree, ...}}), degree being 1 for"
        " gradient moments, 2 for squared gradients, -1 for parameter-like state and"
        f" saggs_jax.NESTED for inner optimizer states.{hint}")
  return state
