"""The balancing math: group norms, factors, and applying factors to any tree.

For a pair instance with group norms ``||A_g||`` and ``||B_g||`` the factor is

  c_g = (||B_g|| / ||A_g||) ** (strength / 2)

strength=1 (hard SAGGS) equalises both norms at ``sqrt(||A_g|| ||B_g||)``, the
unique minimiser of ``||c A||^2 + ||B / c||^2``; 0 < strength < 1 shrinks the
log-imbalance ``log(||A_g|| / ||B_g||)`` by the factor ``1 - strength``. A zero
or non-finite norm gives c_g = 1, so no NaN or Inf is ever produced.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from saggs_jax import paths
from saggs_jax.pairs import Plan, Slot

Factors = dict[str, jax.Array]


def compute_dtype(dtype) -> jnp.dtype:
  """At least float32, float64 when the leaf already is."""
  return jnp.promote_types(dtype, jnp.float32)


def _group_sq_norms(x: jax.Array, slot: Slot) -> jax.Array:
  split = x.reshape(slot.split_shape(x.shape)).astype(compute_dtype(x.dtype))
  return jnp.sum(jnp.square(split), axis=slot.reduce_axes(x.shape))


def sq_norms(plan: Plan, params: Any) -> dict[str, tuple[jax.Array, jax.Array]]:
  """Per instance: squared group norms of the A and B primaries, shape ``factor_shape``."""
  leaves = dict(paths.leaves_with_paths(params))
  out = {}
  for inst in plan.instances:
    norms = []
    for path in (inst.a, inst.b):
      slot = next(s for s in plan.slots[path] if s.key == inst.key)
      norms.append(_group_sq_norms(leaves[path], slot))
    out[inst.key] = tuple(norms)
  return out


def log_imbalance(sq_a: jax.Array, sq_b: jax.Array) -> jax.Array:
  """``log(||A|| / ||B||)`` per group."""
  return 0.5 * (jnp.log(sq_a) - jnp.log(sq_b))


def factors_from_norms(sq_a: jax.Array, sq_b: jax.Array, strength: float) -> jax.Array:
  """``(||B|| / ||A||) ** (strength / 2)`` with the zero / non-finite guard."""
  ok = (sq_a > 0) & (sq_b > 0) & jnp.isfinite(sq_a) & jnp.isfinite(sq_b)
  safe_a, safe_b = jnp.where(ok, sq_a, 1), jnp.where(ok, sq_b, 1)
  c = jnp.exp((0.25 * strength) * (jnp.log(safe_b) - jnp.log(safe_a)))
  return jnp.where(ok & jnp.isfinite(c), c, jnp.ones_like(c))


def compute_factors(plan: Plan, params: Any, strength: float) -> Factors:
  """The balancing factors of every instance in ``plan`` for ``params``."""
  return {k: factors_from_norms(a, b, strength) for k, (a, b) in sq_norms(plan, params).items()}


def unit_factors(plan: Plan) -> Factors:
  return {i.key: jnp.ones(i.factor_shape, jnp.float32) for i in plan.instances}


def leaf_multiplier(slots: tuple[Slot, ...], shape, factors: Factors, power: float, dtype):
  """The array (broadcastable against the split leaf) that one leaf is multiplied by."""
  mult = None
  for slot in slots:
    f = factors[slot.key].astype(dtype)
    e = slot.sign * power
    e = int(e) if float(e).is_integer() else e  # integer powers multiply exactly
    f = (1 / f if e == -1 else f**e).reshape(slot.factor_shape(shape))
    mult = f if mult is None else mult * f
  return mult


def _scale_leaf(x, slots, factors, power):
  if len({s.split_shape(x.shape) for s in slots}) != 1:
    # Slots splitting the leaf differently are applied one after another.
    for s in slots:
      x = _scale_leaf(x, (s,), factors, power)
    return x
  dtype = compute_dtype(x.dtype)
  mult = leaf_multiplier(slots, x.shape, factors, power, dtype)
  split = x.reshape(slots[0].split_shape(x.shape)).astype(dtype)
  return (split * mult).reshape(x.shape).astype(x.dtype)


def scale_tree(plan: Plan, tree: Any, factors: Factors, power: float, is_leaf=None) -> Any:
  """Multiplies each declared leaf of a parameter-shaped ``tree`` by ``c ** (sign * power)``.

  ``power`` is the transport degree: +1 for parameters (A*c, B/c), -1 for
  gradient-like state (momentum), -2 for squared gradients (Adam's ``nu``).
  Leaves that no pair declares are returned as they are (the same object).
  Paths are relative to ``tree``'s root, so this works on ``mu`` or ``nu``
  exactly as on the parameters; leaves absent from ``tree`` (``MaskedNode``)
  are simply not visited.
  """

  def visit(key_path, x):
    slots = plan.slots.get(paths.path_str(key_path))
    if slots is None or not hasattr(x, "shape") or tuple(x.shape) != plan.shapes[
        paths.path_str(key_path)]:
      return x
    return _scale_leaf(x, slots, factors, power)

  return jax.tree_util.tree_map_with_path(visit, tree, is_leaf=is_leaf)
