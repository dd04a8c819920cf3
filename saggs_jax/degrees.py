"""The transport degree of every optimizer state leaf, measured at its place in the chain.

A state type registers the degrees its fields have where optax usually puts
it, but optax reuses types: ``optax.adamax`` keeps an infinity norm (degree 1)
in Adam's ``nu`` (registered 2); the ``trace`` of ``optax.rmsprop(centered=True,
momentum=0.9)`` follows a normaliser and holds updates of degree 0; the
``trace`` of ``optax.lars`` follows a trust ratio and holds parameter-like
updates (degree -1). The oracle is the equivalent history: an optimizer fed
the parameters ``T_c p`` and the gradients ``g / c`` on side A, ``g c`` on
side B must hold the transported state ``s * m**-k``, ``m`` being the
multiplier of the leaf's parameter (``c`` on A, ``1 / c`` on B).

:func:`measure` runs the optimizer on a short probe history and on its
equivalent, and reads for each state leaf the degree ``k`` for which the two
agree: the registered one if it fits, else the first of :data:`CANDIDATES`.
A leaf that no degree fits comes from a stage that does not commute with the
rescaling on the probe (clipping by a global or block norm when it clips, a
trust ratio or a norm taken over a leaf whose groups move apart, weight decay
added before a normaliser or a moment) and is refused with a TypeError naming
its state type and path. The probe runs once per parameter layout, outside
the training step, on the parameters' shapes.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import core

from saggs_jax.balance import Factors, scale_tree
from saggs_jax.pairs import Plan
from saggs_jax.transport import AS_REGISTERED, transport

CANDIDATES = (1, 2, 0, -1, -2, 3, 4)
"""Degrees tried, in order, for a leaf whose registered degree does not fit."""

STEPS = 2
"""Length of the probe history: enough for ``MultiSteps(every_k_schedule=2)`` to step."""


def _like(spec, rng: np.random.Generator):
  """Values of magnitude in [0.5, 1) and either sign (zeros for a non-float leaf): away from
  zero, so that an epsilon added to a moment stays negligible. Made on the host: no compile."""

  def leaf(x):
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      return np.zeros(x.shape, x.dtype)
    return (rng.choice([-1.0, 1.0], x.shape) * rng.uniform(0.5, 1.0, x.shape)).astype(x.dtype)

  return jax.tree.map(leaf, spec)


def probe_factors(plan: Plan) -> Factors:
  """Factors ``2**(±0.6 .. ±1)``, alternating in sign from group to group: far from 1
  and from each other's powers, so that two degrees never give the same multiplier."""
  out = {}
  for inst in plan.instances:
    n = np.arange(math.prod(inst.factor_shape))
    e = np.where(n % 2 == 0, 1.0, -1.0) * (0.6 + 0.4 * ((n * 0.618) % 1))
    out[inst.key] = jnp.asarray(2.0 ** e.reshape(inst.factor_shape), jnp.float32)
  return out


def _probe_dtype(x):
  """16-bit floats probe in float32: their rounding, amplified where two probe gradients
  cancel in a moment, would hide the degree; a degree does not depend on the precision."""
  dtype = jnp.result_type(x)
  return jnp.float32 if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4 else dtype


def _close(wanted, got, dtype) -> jax.Array:
  """Per row of ``wanted``: whether it is ``got`` up to ``dtype``'s rounding."""
  rtol = max(1e-4, 8 * float(jnp.finfo(dtype).eps))
  got = got.astype(jnp.float32)
  ok = jnp.abs(wanted - got) <= rtol * (jnp.abs(got) + 1e-2 * jnp.max(jnp.abs(got), initial=0))
  return jnp.all(ok.reshape(len(wanted), -1), axis=1)


def _owner(state, key_path):
  """The innermost NamedTuple or dataclass state on the way to a leaf."""
  node = owner = state
  for key in key_path:
    if hasattr(node, "_fields") or dataclasses.is_dataclass(type(node)):
      owner = node
    if isinstance(key, jax.tree_util.GetAttrKey):
      node = getattr(node, key.name)
    elif isinstance(key, jax.tree_util.SequenceKey):
      node = node[key.idx]
    elif isinstance(key, jax.tree_util.DictKey):
      node = node[key.key]
    else:
      break
  return owner


def measure(tx: optax.GradientTransformation, params: Any, plan: Plan) -> Any:
  """The degree of every leaf of ``tx.init(params)``, as :func:`transport` takes them.

  Args:
    tx: the optimizer whose state is transported (the stages before a symmetry
      stage).
    params: the parameters, or anything with their shapes and dtypes.
    plan: the resolved pairs.

  Returns:
    A tree laid out like the state whose leaves are :data:`AS_REGISTERED` or
    a measured degree; None when no parameter is declared.

  Raises:
    TypeError: a leaf that no degree fits, or a state the registered rules
      refuse; the message names the state type and the path.

  Example::

    >>> import jax.numpy as jnp, optax, saggs_jax as saggs
    >>> from saggs_jax.degrees import measure
    >>> from saggs_jax.pairs import resolve
    >>> params = {"q": jnp.ones((2, 3)), "k": jnp.ones((4, 3))}
    >>> state_degrees = measure(optax.adamax(1e-3), params, resolve(saggs.Pair("q", "k"), params))
    >>> state_degrees[0].nu["q"], state_degrees[0].mu["q"]  # nu: an infinity norm
    (1, 'as registered')
  """
  if not plan.slots:
    return None
  # Under a jit trace (an init or a first update being traced) the probe still runs now.
  with jax.ensure_compile_time_eval():
    return _measure(tx, params, plan)


def _measure(tx, params, plan):
  spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), _probe_dtype(x)), params)
  tx = optax.with_extra_args_support(tx)
  factors = probe_factors(plan)
  found = {}

  def history(p, grads):
    state = tx.init(p)
    for g in grads:  # value: the loss, invariant under the symmetry (polyak_sgd, plateaus)
      _, state = tx.update(g, state, p, value=jnp.ones([], jnp.float32))
    return state

  def probe(params, grads, factors):  # arguments, not constants: staged, compiled once
    # The registered rules first: an unregistered image refuses before any step runs.
    start = tx.init(params)
    transport(plan, start, factors)
    both = lambda a, b: jax.tree.map(lambda x, y: jnp.stack([x, y]), a, b)  # noqa: E731
    try:  # one vmapped history compiles the update once for both
      states = jax.vmap(history)(
        both(params, scale_tree(plan, params, factors, 1.0)),
        [both(g, scale_tree(plan, g, factors, -1.0)) for g in grads],
      )
    except Exception as e:  # e.g. an update that needs more than the gradients and a value
      raise TypeError(
        f"Cannot transport {type(start).__name__} at opt_state: its degrees are measured on a"
        " probe history (gradients laid out like the parameters, extra argument value=1),"
        f" on which the optimizer fails: {type(e).__name__}: {e}"
      ) from e
    state, moved = (jax.tree.map(lambda x, i=i: x[i], states) for i in (0, 1))
    registered = transport(plan, state, factors)
    ones = jax.tree.map(jnp.ones_like, state)
    mult = transport(plan, ones, factors, degrees=jax.tree.map(lambda _: 1, state))
    leaves, found["treedef"] = jax.tree_util.tree_flatten_with_path(state)
    found["paths"], found["state"] = [k for k, _ in leaves], state
    powers = jnp.asarray(CANDIDATES, jnp.float32)
    verdicts = []
    for (_, s), m, r, t in zip(leaves, *(jax.tree.leaves(x) for x in (mult, registered, moved))):
      if not jnp.issubdtype(s.dtype, jnp.inexact):
        verdicts.append(jnp.ones(1 + len(CANDIDATES), bool))
        continue
      k = powers.reshape((-1,) + (1,) * s.ndim)
      wanted = jnp.concatenate(
        [r[None].astype(jnp.float32), s.astype(jnp.float32) * m.astype(jnp.float32) ** k]
      )
      verdicts.append(_close(wanted, t, s.dtype))
    return jnp.stack(verdicts) if verdicts else jnp.zeros((0, 1 + len(CANDIDATES)), bool)

  rng = np.random.default_rng(0)
  verdicts = jax.jit(probe)(_like(spec, rng), [_like(spec, rng) for _ in range(STEPS)], factors)
  if isinstance(verdicts, core.Tracer):
    # The optimizer closes over values traced outside, as when optax.inject_hyperparams
    # wraps a whole saggs.chain (its hyperparameters are then tracers in init and update).
    warnings.warn(
      "saggs_jax could not measure the transport degrees of this optimizer: it depends on"
      " values traced outside it (a saggs.chain built inside optax.inject_hyperparams?), so"
      " its states move by their registered degrees, which are wrong for adamax's nu or a"
      " trace after a normaliser. Put inject_hyperparams inside the chain:"
      " saggs.chain(optax.inject_hyperparams(optax.adamw)(...), saggs.saggs(pairs)).",
      UserWarning,
      stacklevel=4,
    )
    return None
  verdicts = np.asarray(verdicts)
  degrees = []
  for key_path, v in zip(found["paths"], verdicts):
    if v[0]:
      degrees.append(AS_REGISTERED)
    elif v[1:].any():
      degrees.append(CANDIDATES[int(np.argmax(v[1:]))])
    else:
      owner = _owner(found["state"], key_path)
      raise TypeError(
        f"Cannot transport {type(owner).__name__} at opt_state{jax.tree_util.keystr(key_path)}:"
        " after an equivalent history (parameters T_c p, gradients g / c on side A and g * c"
        " on side B) this leaf is not the transported one for any degree in"
        f" {sorted(CANDIDATES)}, so a stage before it does not commute with the rescaling"
        " (clipping by a global or block norm when it clips, a trust ratio or norm over a"
        " leaf whose groups move apart, weight decay added before a moment or a normaliser)."
        " Drop or move that stage, or declare the pairs with one group per tensor"
        " (axes=None) when a per-tensor norm is the cause."
      )
  return found["treedef"].unflatten(degrees)
