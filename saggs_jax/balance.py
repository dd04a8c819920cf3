"""The balancing math: group norms, factors, and applying factors to any tree.

For a pair instance with group norms ``||A_g||`` and ``||B_g||`` the factor is

  c_g = (||B_g|| / ||A_g||) ** (strength / 2)

strength=1 (hard SAGGS) equalises both norms at ``sqrt(||A_g|| ||B_g||)``, the
unique minimiser of ``||c A||^2 + ||B / c||^2``; 0 < strength < 1 shrinks the
log-imbalance ``log(||A_g|| / ||B_g||)`` by the factor ``1 - strength``. A zero
or non-finite norm gives c_g = 1, so no NaN or Inf is ever produced.
"""

from __future__ import annotations

import functools
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
  dtype = compute_dtype(x.dtype)
  sq = jnp.sum(jnp.square(x.astype(dtype)), axis=slot.reduce_axes(x.ndim))
  if slot.axis is None or slot.groups == x.shape[slot.axis]:  # already one sum per group
    return sq
  # Per-index sums to per-group sums by a tiny one-hot matmul: reshaping a
  # sharded axis into (groups, size) is not defined under Explicit sharding.
  # Non-finite entries are summed apart (inf * 0 would leak NaN into every
  # group) and make their own group's norm inf.
  one_hot = jnp.asarray(slot.membership(x.shape[slot.axis]), dtype)

  def group_sum(v):
    return jnp.matmul(v.astype(dtype), one_hot, precision=jax.lax.Precision.HIGHEST)

  finite = jnp.isfinite(sq)
  return jnp.where(group_sum(~finite) > 0, jnp.inf, group_sum(jnp.where(finite, sq, 0)))


def sq_norms(plan: Plan, params: Any) -> dict[str, tuple[jax.Array, jax.Array]]:
  """Per instance: squared group norms of the A and B primaries, shape ``factor_shape``."""
  leaves = dict(paths.leaves_with_paths(params))
  out = {}
  for inst in plan.instances:
    norms = []
    for path in (inst.a, inst.b):
      norms.append(_group_sq_norms(leaves[path], plan.slot(path, inst.key)))
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


def _multiplier(slot: Slot, shape: tuple[int, ...], factors: Factors, power: float, dtype):
  """``factors ** (sign * power)`` expanded to one entry per index of the group axis."""
  f = factors[slot.key].astype(dtype)
  e = slot.sign * power
  e = int(e) if float(e).is_integer() else e  # integer powers multiply exactly
  f = 1 / f if e == -1 else f**e
  if slot.axis is not None:  # (..., groups) -> (..., size): each factor over its block
    n = shape[slot.axis]
    f = jnp.broadcast_to(f[..., None], f.shape + (n // slot.groups,)).reshape(f.shape[:-1] + (n,))
  return f.reshape(slot.broadcast_shape(shape))


def leaf_multiplier(slots: list[Slot], shape: tuple[int, ...], factors: Factors, power: float,
                    dtype) -> jax.Array:
  """What a leaf of ``shape`` declared in ``slots`` is multiplied by, broadcastable to it."""
  return functools.reduce(jnp.multiply, [_multiplier(s, shape, factors, power, dtype) for s in slots])


def _scale_leaf(x, slots, factors, power):
  dtype = compute_dtype(x.dtype)
  return (x.astype(dtype) * leaf_multiplier(slots, x.shape, factors, power, dtype)).astype(x.dtype)


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
