"""The balancing math: group norms, factors, and applying factors to any tree.

For a pair instance with group norms ``||A_g||`` and ``||B_g||`` the factor is

  c_g = (||B_g|| / ||A_g||) ** (strength / 2)

strength=1 (hard SAGGS) equalises both norms at ``sqrt(||A_g|| ||B_g||)``, the
unique minimiser of ``||c A||^2 + ||B / c||^2``; 0 < strength < 1 shrinks the
log-imbalance ``log(||A_g|| / ||B_g||)`` by the factor ``1 - strength``. A side
of several tensors has the norm of all of them together.

When pairs overlap (one leaf in several), hard balancing minimises the total
squared norm of all declared leaves over all factors at once, a convex problem
in the log-factors solved by Newton steps and sweeps of the closed form above
(see :func:`solve`), which reports how far from converged it stopped; soft
balancing takes ``strength`` of those log-factors.

Guards, so that no NaN or Inf is ever produced:

* norms are scale-safe: they are kept as logarithms, and a leaf whose float32
  sums of squares overflow, underflow or meet a non-finite entry is recomputed
  in two passes: the group maxima, then the squares of entries divided by the
  tensor's largest finite group maximum;
* a zero or non-finite norm gives ``c_g = 1``, and a non-finite entry only
  affects its own group;
* a factor never overflows a leaf's dtype: ``c`` is clipped so that
  ``c ||A_g||`` and ``||B_g|| / c`` (followers included) stay below the largest
  finite value of each leaf's dtype, which bounds every scaled entry; a tensor
  whose norm exceeds that value is bounded by its largest entry instead. This
  only binds for tensors whose norm nears that value (float16 mostly); there
  the factor is the closest admissible one, or 1 if none is.

A leaf with blocks (see :class:`saggs_jax.Block`) is cut at their boundaries
into pieces (:attr:`saggs_jax.pairs.Plan.pieces`) whose entries move by the
same slots; its statistics are taken per piece through a mask along the block
axis, and its multiplier is each block's factors padded with ones along that
axis, so a sharded block axis stays sharded.

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
from saggs_jax.pairs import Instance, Plan, Slot, Span

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
  several = slot.axis is not None and not slot.per_index(v.shape[slot.axis])
  if several and not jax.sharding.get_abstract_mesh().empty:
    one_hot = jnp.asarray(slot.membership(v.shape[slot.axis]), v.dtype)  # (size, groups)
    mask = one_hot.reshape((1,) * slot.axis + one_hot.shape[:1] + (1,) * (v.ndim - slot.axis - 1)
                           + one_hot.shape[1:])
    s = reduce(v[..., None] * mask, axis=tuple(range(slot.stacked, v.ndim)))
  else:
    s = reduce(v, axis=slot.reduce_axes(v.ndim))
    if several:  # per index, then per group of that small vector (within a block)
      start, stop = slot.tiled(v.shape[slot.axis])
      s = reduce(s[..., start:stop].reshape(s.shape[:-1] + (slot.groups, -1)), axis=-1)
  s = replicated(s)
  return collective(s, axis_name) if axis_name else s  # () names no axis: nothing to sum


def _reduce(v: jax.Array, slots: Sequence[Slot], axis_name: AxisName, op: str = "sum"
            ) -> jax.Array:
  """``v >= 0`` reduced per group of every slot of one leaf: the leaf's stacked axes (those
  of its slot with the most) plus one axis per slot (of size 1 for a whole-tensor slot),
  replicated.

  With several slots (a leaf in overlapping pairs) the sum is taken per combination of
  groups, as one contraction with each grouped axis's one-hot membership; the ``max``
  is then bounded by the smallest of the per-slot maxima, which suffices for the
  overflow bounds it serves.
  """
  stacked = _stacked(slots)
  if len(slots) == 1:
    r = _group_reduce(v, slots[0], axis_name, op)
    return r if slots[0].axis is not None else r[..., None]
  if op == "max":
    return functools.reduce(jnp.minimum, [_at(_reduce(v, (s,), axis_name, op), i, slots)
                                          for i, s in enumerate(slots)])
  operands, out = [v, list(range(v.ndim))], list(range(stacked))
  for s in slots:
    if s.axis is None:
      continue
    if s.per_index(v.shape[s.axis]):
      out.append(s.axis)
    else:
      operands += [jnp.asarray(s.membership(v.shape[s.axis]), v.dtype), [s.axis, v.ndim + len(out)]]
      out.append(v.ndim + len(out))
  r = jnp.einsum(*operands, out, precision=jax.lax.Precision.HIGHEST)
  for i, s in enumerate(slots):
    if s.axis is None:
      r = jnp.expand_dims(r, stacked + i)
  r = replicated(r)
  return jax.lax.psum(r, axis_name) if axis_name else r


def _fast_log_sq(x: jax.Array, slots: Sequence[Slot], axis_name: AxisName):
  """``log sum x**2`` per group from one float32 pass. Inexact or infinite when the
  squares over- or underflow."""
  return jnp.log(_reduce(jnp.square(x.astype(compute_dtype(x.dtype))), slots, axis_name))


def _safe_stats(x: jax.Array, slots: Sequence[Slot], axis_name: AxisName):
  """``(log sum x**2, log max |x|)`` per group in two passes: the group maxima, then the
  squares of entries scaled by their copy's largest finite group maximum (to the nearest
  power of two), which cannot overflow. A non-finite group's sum is +inf and a zero
  group's -inf: both mean "do not balance"."""
  stacked = _stacked(slots)
  dtype = compute_dtype(x.dtype)
  x = x.astype(dtype)
  group_max = _reduce(jnp.abs(x), slots, axis_name, "max")  # inf or NaN where an entry is
  scale = jnp.max(jnp.where(jnp.isfinite(group_max), group_max, 0),
                  axis=tuple(range(stacked, group_max.ndim)))
  # Divide by 2**e, the scale's binary exponent, as two exact multiplies by normal
  # powers of two: 1 / scale itself is subnormal near the dtype's maximum, and flushed.
  _, e = jnp.frexp(scale)
  e = e.reshape(e.shape + (1,) * (x.ndim - stacked))
  x = x * jnp.ldexp(jnp.ones((), dtype), -(e // 2)) * jnp.ldexp(jnp.ones((), dtype), e // 2 - e)
  log_scale = (e.reshape(e.shape[:stacked] + (1,) * len(slots)) * np.log(2.0)).astype(dtype)
  sq = _reduce(jnp.square(x), slots, axis_name)
  return jnp.where(jnp.isfinite(sq), 2 * log_scale + jnp.log(sq), jnp.inf), jnp.log(group_max)


def _restrict(x: jax.Array, block: Span | None) -> jax.Array:
  """``x`` with zeros outside ``block``: a mask along the block axis, which keeps every
  axis of ``x`` (and its sharding) and fuses into the reduction that reads it."""
  if block is None:
    return x
  axis, start, stop = block
  index = jax.lax.broadcasted_iota(jnp.int32, tuple(n if i == axis else 1
                                                    for i, n in enumerate(x.shape)), axis)
  return jnp.where((index >= start) & (index < stop), x, jnp.zeros((), x.dtype))


def _log_max(dtype) -> float:
  """log of the largest value a leaf of ``dtype`` may be scaled to, with a rounding margin."""
  return float(np.log(float(jnp.finfo(dtype).max)) + np.log1p(-2.0**-8))


Stats = dict[tuple, tuple[jax.Array, jax.Array]]


def leaf_stats(plan: Plan, params: Any, axis_name: AxisName = None) -> Stats:
  """Per declared piece (a leaf, or a part of it between block boundaries) ``(log sum of
  squares, log of the largest magnitude)`` per group of each of its slots (see
  :func:`_reduce`), in float32.

  The common case takes one float32 pass per leaf. A leaf is recomputed by the
  scale-safe passes when one of its sums of squares overflowed, underflowed or
  met a non-finite entry, or a norm is so large that a factor bounded by it could
  overflow a dtype of its pair. Under jit a ``lax.while_loop`` takes those leaves
  one at a time (a ``lax.switch`` on the leaf), so it runs no iteration in the
  common case, and the compiled update holds the safe passes of one leaf, not of
  all. Called eagerly, the leaves to recompute are known: no loop is compiled.
  """
  if not plan.slots:  # no pairs (an empty discover result): nothing to measure
    return {}
  leaves = dict(paths.leaves_with_paths(params))
  dtype_max = {}  # the smallest dtype maximum among the leaves of each instance
  for path, slots in plan.slots.items():
    for s in slots:
      dtype_max[s.key] = min(dtype_max.get(s.key, np.inf), _log_max(leaves[path].dtype))
  limit = {k: min(dtype_max[s.key] for s in piece.slots) for k, piece in plan.pieces.items()}
  # The statistics of all pieces travel as two flat float32 vectors, each piece a static span.
  shapes = {k: leaves[piece.path].shape[:_stacked(piece.slots)]
            + tuple(1 if s.axis is None else s.groups for s in piece.slots)
            for k, piece in plan.pieces.items()}
  ends = np.cumsum([int(np.prod(s)) for s in shapes.values()])
  spans = [(int(e - np.prod(s)), int(e)) for s, e in zip(shapes.values(), ends)]

  def flat(values):
    return jnp.concatenate([jnp.ravel(values[p]).astype(jnp.float32) for p in shapes])

  pieces = plan.pieces.values()
  log_sq = flat({k: _fast_log_sq(_restrict(leaves[pc.path], pc.block), pc.slots, axis_name)
                 for k, pc in zip(shapes, pieces)})
  log_max = 0.5 * log_sq  # the norm bounds the largest entry
  lowest = {k: np.log(_SMALLEST_SAFE_SUM) if k[0] in plan.counted else -np.inf for k in shapes}
  trusted = ((log_sq <= flat({p: np.full(s, 2 * limit[p]) for p, s in shapes.items()}))
             & (log_sq >= flat({p: np.full(s, lowest[p]) for p, s in shapes.items()})))  # NaN fails
  # A piece is masked inside its branch: the leaf itself is the operand, never a copy.
  safe = [lambda x, pc=pc: [v.ravel().astype(jnp.float32)
                            for v in _safe_stats(_restrict(x, pc.block), pc.slots, axis_name)]
          for pc in pieces]

  if isinstance(trusted, jax.core.Tracer) or not trusted.is_fully_addressable:
    leaf_of = jnp.asarray(np.repeat(np.arange(len(spans)), [b - a for a, b in spans]))
    starts, stops = (jnp.asarray(v) for v in zip(*spans))
    width = max(b - a for a, b in spans)
    branches = [lambda xs, i=i: [jnp.pad(v, (0, width - v.size)) for v in safe[i](xs[i])]
                for i in range(len(spans))]

    def body(carry):  # the first leaf still untrusted, recomputed and written into its span
      bad, log_sq, log_max = carry
      leaf = leaf_of[jnp.argmax(bad)]
      index = jnp.arange(bad.size)
      span = (index >= starts[leaf]) & (index < stops[leaf])
      place = lambda v: jax.lax.dynamic_update_slice(  # noqa: E731
          jnp.zeros(bad.size + width, jnp.float32), v, (starts[leaf],))[:bad.size]
      sq, top = jax.lax.switch(leaf, branches, [leaves[pc.path] for pc in pieces])
      return bad & ~span, jnp.where(span, place(sq), log_sq), jnp.where(span, place(top), log_max)

    _, log_sq, log_max = jax.lax.while_loop(lambda c: jnp.any(c[0]), body,
                                            (~trusted, log_sq, log_max))
  else:
    for f, pc, (a, b) in zip(safe, pieces, spans):
      if not np.all(np.asarray(trusted[a:b])):
        sq, top = f(leaves[pc.path])
        log_sq, log_max = log_sq.at[a:b].set(sq), log_max.at[a:b].set(top)
  return {p: (log_sq[a:b].reshape(s), log_max[a:b].reshape(s))
          for (p, s), (a, b) in zip(shapes.items(), spans)}


def _stacked(slots: Sequence[Slot]) -> int:
  """The stacked axes kept in a leaf's statistics: a slot with fewer treats the others'
  copies as part of its groups (a norm gain shared by stacked experts)."""
  return max(s.stacked for s in slots)


def _at(u: jax.Array, i: int, slots: Sequence[Slot]) -> jax.Array:
  """Log-factors of one instance (``stacked_shape (+ (groups,))``) laid out on the
  statistics of a leaf (see :func:`_reduce`) along slot ``i``."""
  own = slots[i].stacked
  return u.reshape(u.shape[:own] + (1,) * (_stacked(slots) - own + i) + (-1,)
                   + (1,) * (len(slots) - 1 - i))


def _marginal(plan: Plan, piece: tuple, stats: jax.Array, u: dict, key: str, weight: int,
              reduce) -> jax.Array:
  """``stats`` of ``piece`` with the log-factors ``weight * sign * u`` of its other slots
  applied, reduced to the groups of instance ``key``."""
  slots = plan.pieces[piece].slots
  for i, s in enumerate(slots):
    if s.key != key:
      stats = stats + weight * s.sign * _at(u[s.key], i, slots)
  return _onto(plan, piece, stats, key, u[key].shape, reduce)


def _onto(plan: Plan, piece: tuple, x: jax.Array, key: str, shape: tuple[int, ...], reduce
          ) -> jax.Array:
  """``x``, on the statistics layout of ``piece``, reduced to the groups of instance ``key``
  (of factor shape ``shape``)."""
  slots = plan.pieces[piece].slots
  j = next(i for i, s in enumerate(slots) if s.key == key)
  kept = set(range(slots[j].stacked)) | {_stacked(slots) + j}
  others = tuple(d for d in range(x.ndim) if d not in kept)
  return (reduce(x, axis=others) if others else x).reshape(shape)


def _logsumexp(xs: list[jax.Array]) -> jax.Array:
  return xs[0] if len(xs) == 1 else jax.nn.logsumexp(jnp.stack(xs), axis=0)


def _side_log_sq(plan: Plan, stats: Stats, u: dict, inst: Instance, sign: int) -> jax.Array:
  """``log ||side||**2`` per group of ``inst``, its other pairs' log-factors ``u`` applied."""
  return _logsumexp([_marginal(plan, k, stats[k][0], u, inst.key, 2, jax.nn.logsumexp)
                     for name in inst.members(sign) for k in plan.pieces_of(name, inst.key)])


def _no_factors(plan: Plan) -> dict:
  """Log-factors 0 (factors 1) for every instance."""
  return {i.key: jnp.zeros(i.factor_shape, jnp.float32) for i in plan.instances}


def _bounds(plan: Plan, stats: Stats, dtypes: dict, u: dict, inst: Instance) -> tuple[jax.Array, jax.Array]:
  """``lo <= log c <= hi`` keeping every scaled entry of ``inst`` within its dtype."""
  lo, hi = jnp.full(inst.factor_shape, -jnp.inf), jnp.full(inst.factor_shape, jnp.inf)
  for sign in (+1, -1):
    for name in inst.members(sign) + inst.followers(sign):
      for k in plan.pieces_of(name, inst.key):
        size = _marginal(plan, k, stats[k][1], u, inst.key, 1, jnp.max)
        room = jnp.where(jnp.isfinite(size), _log_max(dtypes[k[0]]) - size, jnp.inf)
        lo, hi = (lo, jnp.minimum(hi, room)) if sign > 0 else (jnp.maximum(lo, -room), hi)
  return lo, hi


def _sweep(plan: Plan, stats: Stats, dtypes: dict, u: dict, scale: float
           ) -> tuple[dict, dict, jax.Array]:
  """One pass over the instances, each set to its best factor given the others: the
  minimiser of ``||c A||^2 + ||B / c||^2`` with the others' factors applied, times
  ``scale`` in log space and clipped to the dtype bounds; 1 (log 0) where a side's norm
  is zero or non-finite or no factor fits. Also returns, per instance, where the factor
  is free (balanced by the closed form, neither frozen at 1 nor clipped), and the
  largest finite log squared norm of a side met, which bounds every leaf's after it."""
  u, free, top = dict(u), {}, jnp.float32(-jnp.inf)
  for inst in plan.instances:
    la, lb = (_side_log_sq(plan, stats, u, inst, sign) for sign in (+1, -1))
    lo, hi = _bounds(plan, stats, dtypes, u, inst)
    ok = jnp.isfinite(la) & jnp.isfinite(lb) & (lo <= hi)
    best = scale * 0.25 * jnp.where(ok, lb - la, 0)
    u[inst.key] = jnp.where(ok, jnp.clip(best, lo, hi), 0)
    free[inst.key] = ok & (best >= lo) & (best <= hi)
    top = jnp.maximum(top, jnp.max(jnp.where(ok, jnp.maximum(la, lb), -jnp.inf), initial=-jnp.inf))
  return u, free, top


def _signed_sum(plan: Plan, piece: tuple, u: dict) -> jax.Array:
  """``sum_s sign_s u_s`` over the slots of ``piece``, on its statistics layout."""
  slots = plan.pieces[piece].slots
  return sum(s.sign * _at(u[s.key], i, slots) for i, s in enumerate(slots))


def _newton(plan: Plan, stats: Stats, u: dict, free: dict, shift: jax.Array) -> dict:
  """One damped Newton step on ``f(u) = sum_leaves ||T_u(leaf)||^2`` over the free
  log-factors.

  With ``E`` a leaf's squared norm per combination of groups (factors applied), the
  gradient for instance k is ``2 s_k sum E`` over its groups, and the Hessian
  ``(H v)_k = 4 s_k sum E (sum_l s_l v_l)``: graph-Laplacian-like, the instances
  coupled through shared leaves. The step solves ``H du = -grad`` by conjugate
  gradients preconditioned by the diagonal ``4 sum E`` (at most ``MAX_CG``
  products, relative residual ``CG_TOLERANCE``), then takes the longest step
  ``2**-k`` (k < ``LINE_SEARCH_STEPS``) that decreases ``f`` (Armijo, the change
  summed as ``E * expm1(t * change)`` so that float32 resolves it near the minimum).

  ``E`` is taken relative to ``exp(shift)``, a bound on the largest (from the last
  sweep; computing it here makes XLA's compile time grow with the square of the
  number of leaves): groups more than ~1e38 below it underflow to no step here and are
  left to the sweeps.
  """
  members = {k for i in plan.instances for sign in (+1, -1) for name in i.members(sign)
             for k in plan.pieces_of(name, i.key)}
  counted = [k for k in plan.pieces if k in members]
  log_e = {p: stats[p][0] + 2 * _signed_sum(plan, p, u) - shift for p in counted}
  # A non-finite combination freezes (not free) every group it touches: drop it from f.
  e = {p: jnp.where(jnp.isfinite(v), jnp.exp(jnp.minimum(v, 80.0)), 0.0) for p, v in log_e.items()}
  # Vectors over all log-factors travel flat, each instance a static span.
  shapes = {i.key: i.factor_shape for i in plan.instances}
  ends = np.cumsum([int(np.prod(v)) for v in shapes.values()])
  flat = lambda d: jnp.concatenate([jnp.ravel(d[k]) for k in shapes])  # noqa: E731
  split = lambda v: {k: v[end - int(np.prod(sh)):end].reshape(sh)  # noqa: E731
                     for (k, sh), end in zip(shapes.items(), ends)}
  mask = flat(free).astype(jnp.float32)

  def per_instance(weighted):  # sum_p sign * E_p * weighted(p), onto every instance
    out = {k: jnp.zeros(v, jnp.float32) for k, v in shapes.items()}
    for p in counted:
      x = e[p] * weighted(p)
      for s in plan.pieces[p].slots:
        out[s.key] = out[s.key] + s.sign * _onto(plan, p, x, s.key, shapes[s.key], jnp.sum)
    return flat(out) * mask

  grad = per_instance(lambda p: 2.0)
  diag = flat({k: 4 * _onto_all(plan, e, counted, k, shapes[k]) for k in shapes})
  inverse = jnp.where(diag > 0, 1 / jnp.where(diag > 0, diag, 1), 0)

  def cg(carry):
    x, r, p, rz, k = carry
    dirs = split(p)
    hp = per_instance(lambda piece: 4 * _signed_sum(plan, piece, dirs))
    curv = p @ hp
    alpha = jnp.where(curv > 0, rz / jnp.where(curv > 0, curv, 1), 0)
    x, r = x + alpha * p, r - alpha * hp
    z = inverse * r
    new = r @ z
    return x, r, z + jnp.where(rz > 0, new / jnp.where(rz > 0, rz, 1), 0) * p, new, k + 1

  z = -inverse * grad
  rz0 = -grad @ z
  du, *_ = jax.lax.while_loop(lambda c: (c[3] > CG_TOLERANCE**2 * rz0) & (c[4] < MAX_CG), cg,
                              (jnp.zeros_like(grad), -grad, z, rz0, 0))
  slope = grad @ du
  du = split(du)
  change = {p: 2 * _signed_sum(plan, p, du) for p in counted}

  # Backtracking without a loop: the Armijo test at every step 2**-k at once.
  steps = 2.0 ** -jnp.arange(LINE_SEARCH_STEPS, dtype=jnp.float32)
  decrease = sum(jnp.sum(e[p][..., None] * jnp.expm1(steps * change[p][..., None]),
                         axis=tuple(range(e[p].ndim))) for p in counted)
  passed = (decrease <= 1e-4 * steps * slope) & (slope < 0)
  t = jnp.where(jnp.any(passed), steps[jnp.argmax(passed)], 0.0)
  return {k: u[k] + t * du[k] for k in u}


def _onto_all(plan: Plan, e: dict, counted: list, key: str, shape) -> jax.Array:
  """``sum_p E_p`` over the counted pieces in instance ``key``, onto its groups."""
  return sum(_onto(plan, p, e[p], key, shape, jnp.sum) for p in counted
             if any(s.key == key for s in plan.pieces[p].slots))


# Overlapping pairs: the joint solve stops once a sweep moves no log-factor by more than
# TOLERANCE, or after MAX_ITERATIONS rounds of one Newton step and one sweep.
TOLERANCE = 1e-6
MAX_ITERATIONS = 30
MAX_CG = 256
CG_TOLERANCE = 1e-3
LINE_SEARCH_STEPS = 12


def solve(plan: Plan, stats: Stats, dtypes: dict, strength: float) -> tuple[Factors, jax.Array]:
  """The factors of every instance, and how far from converged the joint solve stopped.

  The log-factors are ``strength * u``, ``u`` minimising the total squared norm of the
  declared leaves over the orbit. Without overlaps each instance is independent and one
  sweep gives the closed form ``c = (||B|| / ||A||) ** (strength / 2)``; the residual is 0.
  With overlaps the objective is convex in the log-factors (a sum of exponentials of
  linear functions), and its gradient for an instance is ``2 (||A||^2 - ||B||^2)``: at the
  minimum every instance is balanced. One sweep of closed-form steps comes first; then
  each round, under ``jit``, takes one Newton step (see :func:`_newton`) and one sweep
  (which keeps every factor within its dtype bounds), until the sweep moves no log-factor
  by more than ``TOLERANCE`` or ``MAX_ITERATIONS`` rounds have run. Coordinate descent
  alone would need sweeps growing with the square of the depth of the overlaps (a chain
  of layers); the Newton step propagates along it at once.

  The residual is the largest move of a log-factor in the last sweep (half a
  ``log(||A|| / ||B||)`` that the sweep found): at most ``TOLERANCE`` when converged.
  """
  u = _no_factors(plan)
  if not plan.overlapping:
    return {k: jnp.exp(v) for k, v in _sweep(plan, stats, dtypes, u, strength)[0].items()
            }, jnp.float32(0.0)

  def moved(a, b):
    return functools.reduce(jnp.maximum, [jnp.max(jnp.abs(a[k] - b[k]), initial=0.0) for k in a])

  def body(carry):
    u, free, shift, _, n = carry
    stepped = _newton(plan, stats, u, free, jnp.where(jnp.isfinite(shift), shift, 0.0))
    new, free, shift = _sweep(plan, stats, dtypes, stepped, 1.0)
    return new, free, shift, moved(new, stepped), n + 1

  free = jax.tree.map(lambda v: jnp.ones(v.shape, bool), u)  # the sweep clips after
  top = functools.reduce(jnp.maximum, [jnp.max(jnp.where(jnp.isfinite(v), v, -jnp.inf))
                                       for v, _ in stats.values()])
  u, _, _, residual, _ = jax.lax.while_loop(
      lambda c: (c[3] > TOLERANCE) & (c[4] < MAX_ITERATIONS), body,
      (u, free, top, jnp.float32(jnp.inf), 0))
  return {k: jnp.exp(strength * v) for k, v in u.items()}, residual


def _dtypes(params: Any) -> dict:
  return {path: leaf.dtype for path, leaf in paths.arrays_with_paths(params)}


def log_norms(plan: Plan, params: Any) -> dict[str, tuple[jax.Array, jax.Array]]:
  """Per instance: ``log`` of the group norms of sides A and B (scale-safe)."""
  stats, u = leaf_stats(plan, params), _no_factors(plan)
  return {i.key: tuple(0.5 * _side_log_sq(plan, stats, u, i, s) for s in (+1, -1))
          for i in plan.instances}


def compute_factors(plan: Plan, params: Any, strength: float, axis_name: AxisName = None
                    ) -> tuple[Factors, jax.Array]:
  """The balancing factors of every instance in ``plan`` for ``params``, and the joint
  solve's residual (see :func:`solve`)."""
  return solve(plan, leaf_stats(plan, params, axis_name), _dtypes(params), strength)


def _multiplier(slot: Slot, shape: tuple[int, ...], factors: Factors, power: float, dtype):
  """``factors ** (sign * power)`` expanded to one entry per index of the group axis, and
  with a block, to its span of the block axis, padded with ones outside it."""
  f = factors[slot.key].astype(dtype)
  e = slot.sign * power
  e = int(e) if float(e).is_integer() else e  # integer powers multiply exactly
  f = 1 / f if e == -1 else f**e
  inner = shape  # the shape of what the factors tile: the block
  if slot.block is not None:
    axis, start, stop = slot.block
    inner = shape[:axis] + (stop - start,) + shape[axis + 1:]
  if slot.axis is not None:  # (..., groups) -> (..., size): each factor over its group
    n = inner[slot.axis]
    f = jnp.broadcast_to(f[..., None], f.shape + (n // slot.groups,)).reshape(f.shape[:-1] + (n,))
  f = f.reshape(slot.broadcast_shape(inner))
  if slot.block is not None:  # ones on either side of the block: a concatenation, no reshape
    f = jnp.broadcast_to(f, f.shape[:axis] + (stop - start,) + f.shape[axis + 1:])
    pad = [(0, 0)] * len(shape)
    pad[axis] = (start, shape[axis] - stop)
    f = jnp.pad(f, pad, constant_values=1)
  return f


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
