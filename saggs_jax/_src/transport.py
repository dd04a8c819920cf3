"""Moving optimizer state along a symmetry transform.

If ``A' = c A`` then ``dL/dA' = (dL/dA) / c``, so state of gradient degree k
(momentum k=1, second moment k=2) transports as ``s_A -> s_A c**-k`` and
``s_B -> s_B c**k``; parameter-like state (slow weights) has k=-1.

Each optimizer state type has a rule: which of its fields are moments and of
what degree, and which hold nested optimizer states. The optax state types are
registered below; users register their own with :func:`register_transport`.

Every array that is an image of a declared parameter is transported exactly or
refused with a TypeError naming the state type, the path and the fix; none is
skipped, since transporting the parameters without their moments would quietly
change the optimizer's trajectory. The images transported are

* the parameter's own shape at the parameter's path (Adam's ``mu``);
* a raveled image: every parameter raveled and concatenated in tree order, the
  vector ``optax.flatten`` hands its inner optimizer;
* Adafactor's factored second moment (``v_row``, ``v_col``), where the
  factorisation allows it (see :func:`_transport_factored`);
* Lookahead's fast optimizer state, laid out like ``params.fast``, when the
  slow weights follow the fast ones (see :func:`_transport_lookahead`).

A moment field holding anything else, and an unregistered state holding an
array at a declared path, of a declared shape or raveled, is refused.

A state type does not always fix its degrees: optax reuses them for moments of
other degrees (``optax.adamax`` keeps an infinity norm, degree 1, in Adam's
``nu``; a ``trace`` after a normaliser holds updates of degree 0). So
:func:`transport` takes ``degrees``, the degree of each leaf as measured at its
place in the chain (:func:`saggs_jax._src.degrees.measure`), in place of the
registered one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib

from saggs_jax._src import paths
from saggs_jax._src.numerics import Factors
from saggs_jax._src.plan import Plan
from saggs_jax._src.scaling import scale_leaf

NESTED = "nested"
"""Marks a field that holds an inner optimizer state to transport recursively."""

Degree = int | float | str
Rule = Callable[[Plan, Any, Factors, str, Any], Any]

AS_REGISTERED = "as registered"
"""A leaf of a ``degrees`` tree that keeps the degree its state type registers."""
_RULES: dict[type, Rule] = {}

_LAYOUT_FIX = "Lay each moment out like the parameters (docs/moments.md)."

# A state holding an array laid out like a declared parameter (its path, its shape, or all
# parameters raveled), and no rule that says its degree: docs/moments.md lists the degrees.
UNREGISTERED_MSG = (
  "Cannot transport {name} at {where}: it holds an image of a parameter (at {hit!r}) and no"
  " rule. {fix}"
)


def register_transport(state_type: type, fields: Mapping[str, Degree]) -> None:
  """Declares how the fields of ``state_type`` move under a symmetry transform.

  A field named with degree k must hold a tree laid out like the parameters
  (or the raveled vector of ``optax.flatten``); its declared leaves are
  multiplied by ``c**-k`` on side A and ``c**k`` on side B. Anything else in it
  is refused with a TypeError when the state is transported.

  Args:
    state_type: a NamedTuple or dataclass optimizer state type.
    fields: field name -> gradient degree k (1 for first moments, 2 for second
      moments, -1 for parameter-like state such as slow weights) or
      :data:`NESTED` for a field holding inner optimizer state(s). Fields not
      named (counters, hyperparameters) are left untouched.

  Example:
    >>> import typing, saggs_jax as saggs
    >>> class MyState(typing.NamedTuple):
    ...   count: object
    ...   momentum: object
    >>> saggs.register_transport(MyState, {"momentum": 1})
  """
  known = getattr(state_type, "_fields", None) or [f.name for f in dataclasses.fields(state_type)]
  unknown = set(fields) - set(known)
  if unknown:
    raise ValueError(
      f"{state_type.__name__} has no fields {sorted(unknown)}; it has {list(known)}."
    )
  for field, degree in fields.items():
    if degree != NESTED and (isinstance(degree, bool) or not isinstance(degree, (int, float))):
      raise ValueError(
        f"{state_type.__name__}.{field}: degree must be a number or"
        f" saggs_jax.NESTED, got {degree!r}."
      )
  _RULES[state_type] = functools.partial(_transport_fields, dict(fields))


def registered_types() -> tuple[type, ...]:
  """The state types :func:`transport` has a rule for, registered or built in."""
  return tuple(_RULES)


def _replace(state, **changes):
  if hasattr(state, "_replace"):
    return state._replace(**changes)
  return dataclasses.replace(state, **changes)


def _shape(x) -> tuple[int, ...]:
  return tuple(np.shape(x))


def _refusal(state, where: str, why: str, fix: str = _LAYOUT_FIX) -> TypeError:
  return TypeError(f"Cannot transport {type(state).__name__} at {where}: {why} {fix}")


def _scale(plan: Plan, path: str, x, factors: Factors, power: float, drop: int | None = None):
  """``x`` scaled as the declared parameter at ``path``; with ``drop``, ``x`` lacks that axis.

  A dropped axis must be one along which the multiplier is constant (the
  caller checks): it is restored with length 1 for the multiplication.
  """
  if drop is None:
    return scale_leaf(x, plan.slots[path], factors, power)
  return jnp.squeeze(scale_leaf(jnp.expand_dims(x, drop), plan.slots[path], factors, power), drop)


def _is_raveled(plan: Plan, x) -> bool:
  """Whether ``x`` is a vector of every parameter raveled and concatenated (``optax.flatten``)."""
  return (
    len(plan.shapes) > 1
    and np.ndim(x) == 1
    and np.size(x) == sum(math.prod(s) for s in plan.shapes.values())
  )


def _scale_raveled(plan: Plan, x, factors: Factors, power: float):
  """Unravels in tree order (the order ``plan.shapes`` keeps), scales, ravels again."""
  pieces, start = [], 0
  for path, shape in plan.shapes.items():
    piece = x[start : start + math.prod(shape)]
    if path in plan.slots:
      piece = _scale(plan, path, piece.reshape(shape), factors, power).reshape(-1)
    pieces.append(piece)
    start += piece.size
  return jnp.concatenate(pieces)


def _moment_leaf(plan: Plan, path: str, x, factors: Factors, degree: float):
  """One leaf of a moment of gradient ``degree`` transported, or None if it is no known image."""
  if degree == 0:
    return x
  if path in plan.slots:
    return _scale(plan, path, x, factors, -degree) if _shape(x) == plan.shapes[path] else None
  if path in plan.shapes:
    return x  # the moment of a parameter that no pair declares
  if _is_raveled(plan, x):
    return _scale_raveled(plan, x, factors, -degree)
  return None


def _degree(registered: Degree, measured: Degree) -> float:
  """The measured degree, else the registered one: a number (``NESTED`` fields reach no leaf)."""
  return cast(float, registered if isinstance(measured, str) else measured)


def _map_leaves(plan: Plan, state, where: str, tree, degrees, leaf_fn: Callable[..., Any]):
  """``leaf_fn(path, leaf, measured)`` on every leaf of ``tree``, ``measured`` being its
  leaf in ``degrees`` (or :data:`AS_REGISTERED`); a None result refuses the state."""

  def visit(key_path, x, measured=AS_REGISTERED):
    path = paths.path_str(key_path)
    out = leaf_fn(path, x, measured)
    if out is None:
      if path in plan.shapes:
        why = f"its parameter has shape {plan.shapes[path]}, this leaf {_shape(x)}."
      else:
        why = "no parameter has this path, and it is not all of them raveled."
      raise _refusal(state, f"{where}[{path!r}]", why)
    return out

  if degrees is None:
    return jax.tree_util.tree_map_with_path(visit, tree)
  return jax.tree_util.tree_map_with_path(visit, tree, degrees)


def _field(degrees, name: str):
  return None if degrees is None else getattr(degrees, name)


def _transport_fields(
  fields: dict[str, Degree], plan: Plan, state, factors: Factors, where: str, degrees=None
):
  changes = {}
  for field, degree in fields.items():
    value, sub = getattr(state, field), f"{where}.{field}"
    if degree == NESTED:
      changes[field] = transport(plan, value, factors, sub, _field(degrees, field))
    else:
      changes[field] = _map_leaves(
        plan,
        state,
        sub,
        value,
        _field(degrees, field),
        lambda p, x, m, d=degree: _moment_leaf(plan, p, x, factors, _degree(d, m)),
      )
  return _replace(state, **changes)


def _factored_axes(shape: tuple[int, ...]) -> tuple[int, int]:
  """``(d0, d1)``: the largest and second largest axes, as optax's Adafactor picks them."""
  d1, d0 = np.argsort(shape)[-2:]
  return int(d0), int(d1)


def _varying(plan: Plan, path: str, axes: tuple[int, ...]):
  """``(axis, slot, why)`` for an axis among ``axes`` along which ``path``'s multiplier
  changes: its stacked copies, its groups or a block's edge."""
  shape = plan.shapes[path]
  for slot in plan.slots[path]:
    for a in axes:
      why = (
        "stacked copies"
        if a in slot.stacked
        else "groups"
        if a == slot.axis and slot.groups > 1
        else "a block"
        if slot.block is not None and a == slot.block[0]
        else None
      )
      if shape[a] > 1 and why:
        return a, slot, why
  return None


def _transport_factored(plan: Plan, state, factors: Factors, where: str, degrees=None):
  """Adafactor's second moment, ``optax.scale_by_factored_rms`` (gradient degree 2).

  An unfactored parameter keeps ``v``, an EMA of ``g**2`` in its own shape
  (``v_row`` and ``v_col`` are (1,) stand-ins). A factored one keeps ``v_row``
  and ``v_col``, EMAs of the means of ``g**2`` over its largest axis d0 and
  over its second largest d1 (``v`` is the stand-in). The transport sends
  ``g`` to ``M g``, ``M`` being ``c**-1`` per group on side A (``c`` on side B)
  broadcast over the tensor, and

    mean_d(M**2 g**2) = M**2 mean_d(g**2)   when M is constant along axis d,

  while otherwise it depends on how ``g**2`` is spread along d, which the means
  have discarded. So ``v_row`` and ``v_col`` transport exactly when no group
  boundary and no stacked copy runs along d0 or d1: a group spanning the whole
  tensor (``axes=None``), or a group axis other than the two largest (the heads
  axis of an (embed, heads, head_dim) kernel). Other factored parameters are
  refused. The epsilon added to ``g**2`` is not transported, as with Adam's.
  """
  v_shapes = {p: _shape(x) for p, x in paths.leaves_with_paths(state.v)}

  def factored(path, stat):
    """Whether the declared parameter at ``path`` is factored: its ``v`` is a stand-in, or
    where its ``v`` is left out (None, as the degree probe leaves a leaf of a class it runs
    another of), its statistic ``stat`` is none."""
    if path not in plan.slots:
      return False
    return v_shapes[path] != plan.shapes[path] if path in v_shapes else _shape(stat) != (1,)

  def v_leaf(path, x, measured):
    if factored(path, x) and _shape(x) == (1,):
      return x
    return _moment_leaf(plan, path, x, factors, _degree(2, measured))

  def stat_leaf(field, which):
    def leaf(path, x, measured):
      if not factored(path, x):  # a stand-in, or a parameter no pair declares
        return x if _shape(x) == (1,) or path in plan.shapes and path not in plan.slots else None
      shape, axes = plan.shapes[path], _factored_axes(plan.shapes[path])
      if _shape(x) != shape[: axes[which]] + shape[axes[which] + 1 :]:
        return None
      hit = _varying(plan, path, axes)
      if hit is not None:
        axis, slot, why = hit
        raise _refusal(
          state,
          f"{where}.{field}[{path!r}]",
          f"the factors change along axis {axis} ({why}), which Adafactor averages.",
          "Declare axes=None or factored=False."
          if why == "groups"
          else "Pass adafactor(..., factored=False).",
        )
      return _scale(plan, path, x, factors, -_degree(2, measured), drop=axes[which])

    return leaf

  def field(name, leaf_fn):
    return _map_leaves(
      plan, state, f"{where}.{name}", getattr(state, name), _field(degrees, name), leaf_fn
    )

  return state._replace(
    v=field("v", v_leaf),
    v_row=field("v_row", stat_leaf("v_row", 0)),
    v_col=field("v_col", stat_leaf("v_col", 1)),
  )


def _subplan(plan: Plan, prefix: str) -> Plan:
  """The plan of the subtree ``prefix`` of the parameters, with paths relative to it."""
  n = len(prefix) + 1

  def pick(d):
    return {p[n:]: v for p, v in d.items() if p.startswith(prefix + "/")}

  return dataclasses.replace(plan, slots=pick(plan.slots), shapes=pick(plan.shapes))


def _transport_lookahead(plan: Plan, state, factors: Factors, where: str, degrees=None):
  """``optax.lookahead``: the fast optimizer's state is laid out like ``params.fast``.

  The slow weights are parameters (in ``optax.LookaheadParams``), and each
  synchronisation mixes them with the fast ones: that commutes with the
  rescaling only if slow and fast weights move by the same factors.
  """
  fast, slow = _subplan(plan, "fast"), _subplan(plan, "slow")
  for path in sorted(set(fast.slots) | set(slow.slots)):
    if fast.slots.get(path) != slow.slots.get(path):
      raise _refusal(
        state,
        where,
        f"the slow weight 'slow/{path}' moves apart from its fast weight.",
        "Declare it a follower: Pair('fast/q', 'fast/k', follow_a='slow/q').",
      )
  return state._replace(
    fast_state=transport(
      fast, state.fast_state, factors, f"{where}.fast_state", _field(degrees, "fast_state")
    )
  )


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
  (optax.ScaleByAdaDeltaState, {"e_g": 2, "e_x": -2}),  # e_x: EMA of squared updates
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
]:
  register_transport(_type, _fields)
_RULES[optax.FactoredState] = _transport_factored
_RULES[optax.LookaheadState] = _transport_lookahead


def _image_path(plan: Plan, tree: Any, is_leaf=None) -> str | None:
  """A path in ``tree`` to a float array that may image a declared parameter, or None.

  Such an array sits at a path ending in a declared parameter's, has a declared
  shape, or is the raveled vector of all parameters.
  """
  shapes = {plan.shapes[p] for p in plan.slots} - {()}
  for path, x in paths.leaves_with_paths(tree, is_leaf=is_leaf):
    if not paths.is_parameter(x):
      continue
    segs = path.split("/")
    if (
      _shape(x) in shapes
      or _is_raveled(plan, x)
      or any("/".join(segs[i:]) in plan.slots for i in range(len(segs)))
    ):
      return path
  return None


def _is_plain_container(s) -> bool:
  return isinstance(s, (list, dict)) or (isinstance(s, tuple) and not hasattr(s, "_fields"))


def transport(
  plan: Plan, state: Any, factors: Factors, where: str = "opt_state", degrees: Any = None
) -> Any:
  """Transports every registered moment inside ``state`` by ``factors`` (see the module doc).

  ``degrees``, if given, is a tree laid out like ``state`` whose leaves give the
  degree of each moment leaf, or :data:`AS_REGISTERED` to keep its type's.
  """
  rule = _RULES.get(type(state))
  if rule is not None:
    return rule(plan, state, factors, where, degrees)
  if _is_plain_container(state):
    # Moments kept directly in a plain container have no rule to say their degree.
    hit = _image_path(plan, state, is_leaf=lambda x: not _is_plain_container(x))
    if hit is not None:
      fix = "Wrap such arrays in a NamedTuple state and register_transport it."
      raise TypeError(
        UNREGISTERED_MSG.format(name="the plain container", where=where, hit=hit, fix=fix)
      )
    items = state.items() if isinstance(state, dict) else enumerate(state)
    new = {
      k: transport(plan, v, factors, f"{where}[{k!r}]", None if degrees is None else degrees[k])
      for k, v in items
    }
    return new if isinstance(state, dict) else type(state)(new[i] for i in range(len(state)))
  hit = _image_path(plan, state)
  if hit is not None:
    name = type(state).__name__
    # nnx.state(optimizer) turns optax's NamedTuple states into plain mappings.
    fix = (
      "nnx.state(optimizer) lost the optax types: pass optimizer.opt_state."
      if isinstance(state, Mapping)
      else f"Register its degrees: saggs_jax.register_transport({name}, ...)."
    )
    raise TypeError(UNREGISTERED_MSG.format(name=name, where=where, hit=hit, fix=fix))
  return state
