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


def _group_reduce(v: jax.Array, slot: Slot, axis_name: AxisName, op: str = "sum") -> jax.Array:
  """Sums (or, for ``v >= 0``, maxes) ``v`` over each group of ``slot``: shape
  ``stacked_shape (+ (groups,))``, replicated.

  On a mesh (``jax.set_mesh``) it is one reduction over every axis but the
  stacked ones, whatever the layout: each device reduces its own entries per
  group and a single all-reduce of one value per group combines them. Several
  indices per group are then masked by a one-hot broadcast inside that
  reduction (``groups`` multiply-adds per entry, fused, never materialised):
  summing the other axes first would all-reduce one value per index when they
  are sharded, and reshaping the group axis into (groups, size) would gather
  it when its shards straddle groups. Without a mesh, per-index reductions
  followed by a reshape of that small vector are cheapest.
  """
  reduce, collective = {"sum": (jnp.sum, jax.lax.psum), "max": (jnp.max, jax.lax.pmax)}[op]
  several = slot.axis is not None and slot.groups != v.shape[slot.axis]
  if several and not jax.sharding.get_abstract_mesh().empty:
    one_hot = jnp.asarray(slot.membership(v.shape[slot.axis]), v.dtype)  # (size, groups)
    mask = one_hot.reshape((1,) * slot.axis + one_hot.shape[:1] + (1,) * (v.ndim - slot.axis - 1)
                           + one_hot.shape[1:])
    s = reduce(v[..., None] * mask, axis=tuple(range(slot.stacked, v.ndim)))
  else:
    s = reduce(v, axis=slot.reduce_axes(v.ndim))
    if several:  # per index, then per block of that small vector
      s = reduce(s.reshape(s.shape[:-1] + (slot.groups, -1)), axis=-1)
  s = replicated(s)
  return s if axis_name is None else collective(s, axis_name)


def _log_norm(x: jax.Array, slot: Slot, axis_name: AxisName) -> jax.Array:
  """``log ||x_g||`` from one float32 pass (inf, -inf or inexact when the squares over- or underflow)."""
  return 0.5 * jnp.log(_group_reduce(jnp.square(x.astype(compute_dtype(x.dtype))), slot, axis_name))


def _safe_log_norm_and_max(x: jax.Array, slot: Slot, axis_name: AxisName):
  """``log ||x_g||`` and ``log max |x_g|`` from entries scaled by each copy's largest
  finite magnitude (to the nearest power of two). A non-finite group's norm is +inf
  and a zero group's -inf: both mean "do not balance"; its maximum counts finite
  entries only (inf stays inf when scaled)."""
  dtype = compute_dtype(x.dtype)
  x = x.astype(dtype)
  finite = jnp.isfinite(x)
  mag = jnp.where(finite, jnp.abs(x), 0)
  scale = replicated(jnp.max(mag, axis=tuple(range(slot.stacked, x.ndim))))
  if axis_name is not None:
    scale = jax.lax.pmax(scale, axis_name)
  # Divide by 2**e, the scale's binary exponent, as two exact multiplies by normal
  # powers of two: 1 / scale itself is subnormal near the dtype's maximum, and flushed.
  _, e = jnp.frexp(scale)
  e = e.reshape(e.shape + (1,) * (x.ndim - slot.stacked))
  mag = mag * jnp.ldexp(jnp.ones((), dtype), -(e // 2)) * jnp.ldexp(jnp.ones((), dtype), e // 2 - e)
  log_scale = (e.reshape(e.shape[:slot.stacked] + (1,) * (slot.axis is not None)) * np.log(2.0)
               ).astype(dtype)
  sq = _group_reduce(jnp.square(mag), slot, axis_name)
  bad = _group_reduce((~finite).astype(dtype), slot, axis_name) > 0
  log_max = log_scale + jnp.log(_group_reduce(mag, slot, axis_name, "max"))
  return jnp.where(bad, jnp.inf, log_scale + 0.5 * jnp.log(sq)), log_max


def _log_max(dtype) -> float:
  """log of the largest value a leaf of ``dtype`` may be scaled to, with a rounding margin."""
  return float(np.log(float(jnp.finfo(dtype).max)) + np.log1p(-2.0**-8))


def _room(log_max_dtype: float, log_size: jax.Array) -> jax.Array:
  """How far a leaf whose group entries are at most ``exp(log_size)`` may be scaled up."""
  return jnp.where(jnp.isfinite(log_size), log_max_dtype - log_size, jnp.inf)


def norms_and_room(plan: Plan, params: Any, axis_name: AxisName = None) -> dict[str, tuple]:
  """Per instance ``(log||A_g||, log||B_g||, room_a, room_b)``, each of shape ``factor_shape``.

  ``room_a`` bounds ``log c`` and ``room_b`` bounds ``-log c`` so that no scaled
  entry of the side (primary and followers) exceeds its dtype. The common case
  takes one float32 pass per primary: when both norms are at most the smaller
  dtype maximum, ``c ||A_g|| <= max(||A_g||, ||B_g||)`` cannot overflow, and
  followers (biases, small) are bounded by their norms. A ``lax.cond`` takes the
  scale-safe pass, bounded by the entries' largest magnitudes, when some sum of
  squares overflowed, underflowed, met a non-finite entry or exceeds a dtype.
  """
  leaves = dict(paths.leaves_with_paths(params))

  def slot(path, inst):
    return plan.slot(path, inst.key)

  def follower_room(inst, followers):
    room = jnp.full(inst.factor_shape, jnp.inf, jnp.float32)
    for path in followers:
      room = jnp.minimum(room, _room(_log_max(leaves[path].dtype),
                                     _log_norm(leaves[path], slot(path, inst), axis_name)))
    return room

  log_fast = {inst.key: [_log_norm(leaves[p], slot(p, inst), axis_name) for p in (inst.a, inst.b)]
              for inst in plan.instances}

  def fast(_):
    return {inst.key: (*log_fast[inst.key], follower_room(inst, inst.followers_a),
                       follower_room(inst, inst.followers_b)) for inst in plan.instances}

  def safe(_):
    out = {}
    for inst in plan.instances:
      logs, rooms = [], []
      for primary, followers in ((inst.a, inst.followers_a), (inst.b, inst.followers_b)):
        log_norm, room = None, jnp.inf
        for path in (primary, *followers):
          norm, size = _safe_log_norm_and_max(leaves[path], slot(path, inst), axis_name)
          log_norm = norm if log_norm is None else log_norm
          room = jnp.minimum(room, _room(_log_max(leaves[path].dtype), size))
        logs.append(log_norm)
        rooms.append(room)
      out[inst.key] = (*logs, *rooms)
    return out

  checks = []
  for inst in plan.instances:
    la, lb = log_fast[inst.key]
    limit = min(_log_max(leaves[inst.a].dtype), _log_max(leaves[inst.b].dtype))
    for log_norm in (la, lb):
      checks.append(jnp.all(jnp.isfinite(log_norm) & (log_norm <= limit)
                            & (log_norm >= 0.5 * np.log(_SMALLEST_SAFE_SUM))))
  trusted = functools.reduce(jnp.logical_and, checks, jnp.bool_(True))
  return jax.lax.cond(trusted, _in_float32(fast), _in_float32(safe), None)


def _in_float32(branch):
  """Both cond branches in float32, the factors' dtype (float64 leaves give float64 norms)."""
  return lambda operand: jax.tree.map(lambda v: v.astype(jnp.float32), branch(operand))


def log_norms(plan: Plan, params: Any) -> dict[str, tuple[jax.Array, jax.Array]]:
  """Per instance: ``log`` of the group norms of the A and B primaries (scale-safe)."""
  return {k: v[:2] for k, v in norms_and_room(plan, params).items()}


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
  return {k: factors_from_log_norms(la, lb, strength, ra, rb)
          for k, (la, lb, ra, rb) in norms_and_room(plan, params, axis_name).items()}


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


def scale_leaf(x, slots, factors, power):
  """``x`` times the multiplier of ``slots`` (see :func:`scale_tree`), in at least float32."""
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
    return scale_leaf(x, slots, factors, power)

  return jax.tree_util.tree_map_with_path(visit, tree, is_leaf=is_leaf)
