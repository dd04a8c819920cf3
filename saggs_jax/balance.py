"""The balancing math: group norms, factors, and applying factors to any tree.

For a pair instance with group norms ``||A_g||`` and ``||B_g||`` the factor is

  c_g = (||B_g|| / ||A_g||) ** (strength / 2)

strength=1 (hard SAGGS) equalises both norms at ``sqrt(||A_g|| ||B_g||)``, the
unique minimiser of ``||c A||^2 + ||B / c||^2``; 0 < strength < 1 shrinks the
log-imbalance ``log(||A_g|| / ||B_g||)`` by the factor ``1 - strength``.

Guards, so that no NaN or Inf is ever produced:

* norms are scale-safe: they are kept as logarithms, and when a float32 sum of
  squares overflows, underflows or meets a non-finite entry, every norm is
  recomputed from entries divided by the tensor's largest finite magnitude;
* a zero or non-finite norm gives ``c_g = 1``, and a non-finite entry only
  affects its own group;
* a factor never overflows a leaf's dtype: ``c`` is clipped so that
  ``c ||A_g||`` and ``||B_g|| / c`` (followers included) stay below the largest
  finite value of each leaf's dtype, which bounds every scaled entry. This
  only binds for tensors whose norm nears that value (float16 mostly); there
  the factor is the closest admissible one, or 1 if none is.

On a mesh the squared norms are summed per group where the data lives and
combined with one all-reduce of at most one value per group; inside
``shard_map`` ``axis_name`` names the mesh axes to sum over.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from saggs_jax import paths
from saggs_jax.pairs import Plan, Slot

Factors = dict[str, jax.Array]
AxisName = str | Sequence[str] | None

# A float32 sum of squares this small may have lost digits to underflow: such
# norms (and overflowing or non-finite ones) are recomputed on the safe path.
_SMALLEST_SAFE_SUM = 1e-20


def compute_dtype(dtype) -> jnp.dtype:
  """At least float32, float64 when the leaf already is."""
  return jnp.promote_types(dtype, jnp.float32)


def _explicit(x) -> bool:
  """Whether ``x`` is typed with an Explicit-mode sharding (its shardings must then agree)."""
  return jax.typeof(x).sharding.mesh._any_axis_explicit


def replicated(x):
  """``x`` (small: one value per group) pinned replicated on the current mesh, so that XLA
  neither shards nor gathers it; nothing to do without a mesh or inside ``shard_map``."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.manual_axes:
    return x
  if _explicit(x):
    return jax.sharding.reshard(x, PartitionSpec())
  return jax.lax.with_sharding_constraint(x, PartitionSpec())


def _group_sum(v: jax.Array, slot: Slot, axis_name: AxisName) -> jax.Array:
  """Sums ``v`` over each group of ``slot``: shape ``stacked_shape (+ (groups,))``, replicated.

  It is one reduction over every axis but the stacked ones, whatever the
  layout: on a mesh each device sums its own entries per group and a single
  all-reduce of one value per group combines them. Several indices per group
  are masked by a one-hot broadcast inside that reduction (``groups``
  multiply-adds per entry, fused, never materialised): summing the other
  axes first would all-reduce one value per index when they are sharded, and
  reshaping the group axis into (groups, size) would gather it when its
  shards straddle groups.
  """
  axes = slot.reduce_axes(v.ndim)
  if slot.axis is None or slot.groups == v.shape[slot.axis]:
    s = jnp.sum(v, axis=axes)
  else:
    one_hot = jnp.asarray(slot.membership(v.shape[slot.axis]), v.dtype)  # (size, groups)
    mask = one_hot.reshape((1,) * slot.axis + one_hot.shape[:1] + (1,) * (v.ndim - slot.axis - 1)
                           + one_hot.shape[1:])
    s = jnp.sum(v[..., None] * mask, axis=tuple(range(slot.stacked, v.ndim)))
  s = replicated(s)
  return s if axis_name is None else jax.lax.psum(s, axis_name)


def _fast_sq(x: jax.Array, slot: Slot, axis_name: AxisName) -> jax.Array:
  dtype = compute_dtype(x.dtype)
  return _group_sum(jnp.square(x.astype(dtype)), slot, axis_name)


def _safe_log_norm(x: jax.Array, slot: Slot, axis_name: AxisName) -> jax.Array:
  """``log ||x_g||`` from entries scaled by the largest finite magnitude of each copy.

  Non-finite groups give +inf, zero groups -inf; both mean "do not balance".
  """
  dtype = compute_dtype(x.dtype)
  x = x.astype(dtype)
  finite = jnp.isfinite(x)
  x = jnp.where(finite, x, 0)
  scale = replicated(jnp.max(jnp.abs(x), axis=tuple(range(slot.stacked, x.ndim))))
  if axis_name is not None:
    scale = jax.lax.pmax(scale, axis_name)
  scale = jnp.where(scale > 0, scale, 1)
  expand = scale.reshape(scale.shape + (1,) * (x.ndim - slot.stacked))
  sq = _group_sum(jnp.square(x / expand), slot, axis_name)
  log_scale = jnp.log(scale)[..., None] if slot.axis is not None else jnp.log(scale)
  bad = _group_sum((~finite).astype(dtype), slot, axis_name) > 0
  return jnp.where(bad, jnp.inf, log_scale + 0.5 * jnp.log(sq))


def log_norms(plan: Plan, params: Any, axis_name: AxisName = None
              ) -> dict[str, tuple[jax.Array, jax.Array]]:
  """Per instance: ``log`` of the group norms of the A and B primaries, shape ``factor_shape``.

  One float32 pass per leaf; a ``lax.cond`` takes the scale-safe pass only when
  some sum of squares overflowed, underflowed or met a non-finite entry.
  """
  leaves = dict(paths.leaves_with_paths(params))
  members = [(inst.key, path) for inst in plan.instances for path in (inst.a, inst.b)]

  def fast(_):
    return [0.5 * jnp.log(s) for s in sq]

  def safe(_):
    return [_safe_log_norm(leaves[p], plan.slot(p, k), axis_name) for k, p in members]

  sq = [_fast_sq(leaves[p], plan.slot(p, k), axis_name) for k, p in members]
  trusted = functools.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(s) & (s >= _SMALLEST_SAFE_SUM))
                                                for s in sq])
  logs = jax.lax.cond(trusted, fast, safe, None)
  return {key: (logs[2 * i], logs[2 * i + 1]) for i, key in enumerate(dict.fromkeys(
      k for k, _ in members))}


def _log_headroom(plan: Plan, leaves: dict, inst, side: str, log_norm: jax.Array,
                  axis_name: AxisName) -> jax.Array:
  """``min over the side's leaves of log(max_dtype / ||leaf_g||)``: how far ``c`` (A) or ``1/c`` (B) may grow."""
  primary = inst.a if side == "a" else inst.b
  followers = inst.followers_a if side == "a" else inst.followers_b
  room = _log_max(leaves[primary].dtype) - log_norm
  for path in followers:  # small (biases): their norms cost next to nothing
    x = leaves[path]
    log_f = 0.5 * jnp.log(_fast_sq(x, plan.slot(path, inst.key), axis_name))
    room = jnp.minimum(room, jnp.where(jnp.isfinite(log_f), _log_max(x.dtype) - log_f, jnp.inf))
  return room


def _log_max(dtype) -> float:
  """log of the largest value a leaf of ``dtype`` may be scaled to, with a rounding margin."""
  return float(np.log(float(jnp.finfo(dtype).max)) + np.log1p(-2.0**-8))


def factors_from_log_norms(log_a: jax.Array, log_b: jax.Array, strength: float,
                           room_a: jax.Array | float = np.inf,
                           room_b: jax.Array | float = np.inf) -> jax.Array:
  """``(||B|| / ||A||) ** (strength / 2)`` from log-norms, guarded and clipped to
  ``1/exp(room_b) <= c <= exp(room_a)``; 1 where the norms are zero or non-finite
  or no factor fits."""
  ok = jnp.isfinite(log_a) & jnp.isfinite(log_b) & (-room_b <= room_a)
  log_c = jnp.clip(0.5 * strength * (log_b - log_a), -room_b, room_a)
  return jnp.where(ok, jnp.exp(jnp.where(ok, log_c, 0)), 1).astype(jnp.float32)


def compute_factors(plan: Plan, params: Any, strength: float, axis_name: AxisName = None
                    ) -> Factors:
  """The balancing factors of every instance in ``plan`` for ``params``."""
  leaves = dict(paths.leaves_with_paths(params))
  out = {}
  norms = log_norms(plan, params, axis_name)
  for inst in plan.instances:
    log_a, log_b = norms[inst.key]
    out[inst.key] = factors_from_log_norms(
        log_a, log_b, strength,
        _log_headroom(plan, leaves, inst, "a", log_a, axis_name),
        _log_headroom(plan, leaves, inst, "b", log_b, axis_name))
  return out


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


def _like(m: jax.Array, x: jax.Array) -> jax.Array:
  """``m`` (broadcastable to ``x``) laid out so that ``m * x`` is local: sharded as ``x``
  along its kept axes under Explicit sharding, replicated otherwise."""
  if not _explicit(x):
    return replicated(m)
  spec = tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim
  return jax.sharding.reshard(m, PartitionSpec(*(s if n > 1 else None
                                                 for s, n in zip(spec, m.shape))))


def leaf_multiplier(slots: list[Slot], x: jax.Array, factors: Factors, power: float,
                    dtype) -> jax.Array:
  """What leaf ``x`` declared in ``slots`` is multiplied by, broadcastable to it."""
  m = functools.reduce(jnp.multiply,
                       [_multiplier(s, x.shape, factors, power, dtype) for s in slots])
  return _like(m, x)


def _scale_leaf(x, slots, factors, power):
  dtype = compute_dtype(x.dtype)
  return (x.astype(dtype) * leaf_multiplier(slots, x, factors, power, dtype)).astype(x.dtype)


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
