"""The balancing solve: the factors of every pair instance from its group norms.

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

This module solves for the factors; :mod:`saggs_jax._src.norms` takes the scale-safe
group norms it starts from and :mod:`saggs_jax._src.scaling` applies the factors to
parameters and moments. No NaN or Inf is ever produced: each module's docstring
says how. A factor never overflows a leaf's dtype: ``c`` is clipped so that
``c ||A_g||`` and ``||B_g|| / c`` (followers included) stay below the largest
finite value of each leaf's dtype, which bounds every scaled entry; a tensor whose
norm exceeds that value is bounded by its largest entry instead. This only binds
for tensors whose norm nears that value (float16 mostly); there the factor is the
closest admissible one, or 1 if none is. A zero or non-finite norm gives ``c_g = 1``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from saggs_jax._src import paths
from saggs_jax._src.norms import Stats, leaf_stats, stacked_axes
from saggs_jax._src.numerics import AxisName, Factors, log_dtype_max
from saggs_jax._src.plan import Instance, Plan

__all__ = ["TOLERANCE", "compute_factors", "log_norms", "solve"]


def _onto(plan: Plan, piece: tuple, x: jax.Array, inst: Instance, reduce) -> jax.Array:
  """``x``, on the statistics layout of ``piece``, reduced to the groups of ``inst``."""
  slots = plan.pieces[piece].slots
  j = next(i for i, s in enumerate(slots) if s.key == inst.key)
  copies = stacked_axes(slots)
  kept = {copies.index(a) for a in slots[j].stacked} | {len(copies) + j}
  others = tuple(d for d in range(x.ndim) if d not in kept)
  return (reduce(x, axis=others) if others else x).reshape(inst.factor_shape)


def _logsumexp(xs: list[jax.Array]) -> jax.Array:
  return xs[0] if len(xs) == 1 else jax.nn.logsumexp(jnp.stack(xs), axis=0)


def _side_log_sq(plan: Plan, stats: Stats, inst: Instance, sign: int) -> jax.Array:
  """``log ||side||**2`` per group of ``inst``, before any factor."""
  return _logsumexp(
    [
      _onto(plan, k, stats[k][0], inst, jax.nn.logsumexp)
      for name in inst.members(sign)
      for k in plan.pieces_of(name, inst.key)
    ]
  )


def _bounds(plan: Plan, stats: Stats, dtypes: dict, inst: Instance) -> tuple[jax.Array, jax.Array]:
  """``lo <= log c <= hi`` keeping every scaled entry of ``inst`` within its dtype."""
  lo, hi = jnp.full(inst.factor_shape, -jnp.inf), jnp.full(inst.factor_shape, jnp.inf)
  for sign in (+1, -1):
    for name in inst.members(sign) + inst.followers(sign):
      for k in plan.pieces_of(name, inst.key):
        size = _onto(plan, k, stats[k][1], inst, jnp.max)
        room = jnp.where(jnp.isfinite(size), log_dtype_max(dtypes[k[0]]) - size, jnp.inf)
        lo, hi = (lo, jnp.minimum(hi, room)) if sign > 0 else (jnp.maximum(lo, -room), hi)
  return lo, hi


def _closed_form(plan: Plan, stats: Stats, dtypes: dict, strength: float) -> Factors:
  """The factors of pairs that share no leaf, each independently: the minimiser of
  ``||c A||^2 + ||B / c||^2``, ``strength`` of the way in log space and clipped to the dtype
  bounds; 1 where a side's norm is zero or non-finite or no factor fits."""
  factors = {}
  for inst in plan.instances:
    la, lb = (_side_log_sq(plan, stats, inst, sign) for sign in (+1, -1))
    lo, hi = _bounds(plan, stats, dtypes, inst)
    ok = jnp.isfinite(la) & jnp.isfinite(lb) & (lo <= hi)
    factors[inst.key] = jnp.exp(jnp.where(ok, jnp.clip(strength * 0.25 * (lb - la), lo, hi), 0))
  return factors


class _Graph(NamedTuple):
  """The overlapping pairs as flat arrays, for the joint solve: the statistics of every
  piece one vector (``N`` entries, pieces in plan order), the log-factors of every instance
  one vector (``F`` entries, instances in plan order), and static index arrays between them,
  so that each step of the solve is a few gathers and segment reductions whatever the
  number of pieces and instances (unrolled per piece, the solve's compile time grew with
  the model's depth).

  Attributes:
    spans: per instance, its ``(start, stop)`` in the factor vector.
    slot: ``(N, S)`` the factor each entry moves by in each slot of its piece (0 past the
      piece's slots); sign: ``(N, S)`` that slot's sign (0 past them).
    counted: ``(N,)`` whether the entry's piece is a member of some instance (its norm is
      minimised).
    entry, side, own: per member contribution (an instance, a side, a member and one of
      its pieces, as the closed form sums them), per entry of that piece: the entry, its
      factor (in ``F``) and side (+1, -1), and ``(C, S)`` which slots of the piece are the
      instance's own (left out of the marginal).
    bound_entry, bound_segment, bound_own: the same for the members and followers whose
      largest entries bound the factors: each (contribution, group) one segment.
    segment_factor, segment_side, segment_room: per segment, its factor, side and the
      log of its leaf's dtype maximum.
    colors: per colour, a ``(F,)`` mask of the instances in it: instances of one colour
      share no piece, so a sweep sets them at once, colour after colour (Gauss-Seidel in
      that order).
  """

  spans: tuple[tuple[int, int], ...]
  slot: np.ndarray
  sign: np.ndarray
  counted: np.ndarray
  entry: np.ndarray
  factor: np.ndarray
  side: np.ndarray
  own: np.ndarray
  bound_entry: np.ndarray
  bound_segment: np.ndarray
  bound_own: np.ndarray
  segment_factor: np.ndarray
  segment_side: np.ndarray
  segment_room: np.ndarray
  colors: np.ndarray

  @classmethod
  def of(cls, plan: Plan, stats: Stats, dtypes: dict) -> _Graph:
    shapes = {i.key: i.factor_shape for i in plan.instances}
    sizes = [int(np.prod(s)) for s in shapes.values()]
    ends = np.cumsum(sizes)
    offset = {k: int(e - n) for k, n, e in zip(shapes, sizes, ends)}
    pieces = list(plan.pieces)
    starts = [int(v) for v in np.cumsum([0] + [stats[k][0].size for k in pieces])]
    width = max(len(plan.pieces[k].slots) for k in pieces)
    n = starts[-1]
    slot, sign = np.zeros((n, width), np.int32), np.zeros((n, width), np.float32)
    members = {
      k
      for i in plan.instances
      for s in (1, -1)
      for m in i.members(s)
      for k in plan.pieces_of(m, i.key)
    }
    counted = np.zeros(n, bool)
    onto = {}  # (piece, key) -> the factor index of each entry of the piece
    for p, k in enumerate(pieces):
      slots, shape = plan.pieces[k].slots, stats[k][0].shape
      copies = stacked_axes(slots)
      index = np.indices(shape)
      counted[starts[p] : starts[p + 1]] = k in members
      for j, s in enumerate(slots):
        kept = [copies.index(a) for a in s.stacked] + [len(copies) + j]
        dims = [shape[d] for d in kept]
        f = offset[s.key] + np.ravel_multi_index([index[d] for d in kept], dims).ravel()
        onto.setdefault((k, s.key), f)
        slot[starts[p] : starts[p + 1], j] = f
        sign[starts[p] : starts[p + 1], j] = s.sign
    keys = [[s.key for s in plan.pieces[k].slots] for k in pieces]

    def contributions(inst, followers):
      out = []
      for side in (1, -1):
        for name in inst.members(side) + (inst.followers(side) if followers else ()):
          for k in plan.pieces_of(name, inst.key):
            p = pieces.index(k)
            own = np.array([key == inst.key for key in keys[p]] + [False] * (width - len(keys[p])))
            out.append((p, k, side, own))
      return out

    entry, factor, side, own = [], [], [], []
    b_entry, b_segment, b_own, s_factor, s_side, s_room = [], [], [], [], [], []
    segments = 0
    for inst in plan.instances:
      for p, k, sd, mine in contributions(inst, False):
        f = onto[k, inst.key]
        entry.append(np.arange(starts[p], starts[p + 1]))
        factor.append(f)
        side.append(np.full(f.size, sd))
        own.append(np.broadcast_to(mine, (f.size, width)))
      for p, k, sd, mine in contributions(inst, True):
        f = onto[k, inst.key]
        b_entry.append(np.arange(starts[p], starts[p + 1]))
        b_segment.append(segments + f - offset[inst.key])
        b_own.append(np.broadcast_to(mine, (f.size, width)))
        size = int(np.prod(inst.factor_shape))
        s_factor.append(offset[inst.key] + np.arange(size))
        s_side.append(np.full(size, sd))
        s_room.append(np.full(size, log_dtype_max(dtypes[k[0]]), np.float32))
        segments += size

    conflicts = {i.key: set() for i in plan.instances}
    for ks in keys:
      for a in ks:
        conflicts[a].update(b for b in ks if b != a)
    color: dict[str, int] = {}
    for inst in plan.instances:  # greedy, in declaration order
      taken = {color[b] for b in conflicts[inst.key] if b in color}
      color[inst.key] = next(c for c in range(len(color) + 1) if c not in taken)
    masks = []
    for c in range(max(color.values()) + 1):
      m = np.zeros(int(ends[-1]), bool)
      for key, cc in color.items():
        if cc == c:
          m[offset[key] : offset[key] + int(np.prod(shapes[key]))] = True
      masks.append(m)
    cat = np.concatenate
    return cls(
      tuple((offset[k], offset[k] + n) for k, n in zip(shapes, sizes)),
      slot,
      sign,
      counted,
      cat(entry),
      cat(factor),
      cat(side).astype(np.float32),
      cat(own),
      cat(b_entry),
      cat(b_segment),
      cat(b_own),
      cat(s_factor),
      cat(s_side).astype(np.float32),
      cat(s_room),
      np.stack(masks),
    )


def _segment_logsumexp(v: jax.Array, ids: np.ndarray, n: int) -> jax.Array:
  """``log sum exp v`` per segment (-inf where empty or all -inf, +inf where any is)."""
  top = jax.ops.segment_max(v, ids, n)
  top = jnp.where(jnp.isfinite(top), top, 0)
  return jnp.log(jax.ops.segment_sum(jnp.exp(v - top[ids]), ids, n)) + top


def _terms(g: _Graph, u: jax.Array) -> jax.Array:
  """``sign * u`` of every slot of every entry, ``(N, S)``."""
  return u[g.slot] * g.sign


def _flat_sweep(
  g: _Graph, log_sq: jax.Array, log_max: jax.Array, u: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One pass of closed-form steps over the instances (as :func:`_closed_form`, each given
  the others' log-factors ``u``), in colour order: the instances of one colour share no
  piece, so setting them at once is setting them one after another. Also returns where each
  factor is free (neither frozen at 1 nor clipped) and the largest finite log squared norm
  of a side met."""
  size, segments = u.size, g.segment_factor.size

  def color(c, carry):  # one colour's instances, set at once; traced once for all colours
    u, free, top = carry
    mask = jnp.asarray(g.colors)[c]
    w = _terms(g, u)
    z = jnp.sum(w, axis=1)
    other = z[g.entry] - jnp.sum(jnp.where(g.own, w[g.entry], 0), axis=1)
    v = log_sq[g.entry] + 2 * other
    # Both sides in one segment reduction: side b's factors after side a's.
    sides = _segment_logsumexp(v, g.factor + size * (g.side < 0), 2 * size)
    la, lb = sides[:size], sides[size:]
    b_other = z[g.bound_entry] - jnp.sum(jnp.where(g.bound_own, w[g.bound_entry], 0), axis=1)
    biggest = jax.ops.segment_max(log_max[g.bound_entry] + b_other, g.bound_segment, segments)
    room = jnp.where(jnp.isfinite(biggest), g.segment_room - biggest, jnp.inf)
    # hi = min(room) over side a's segments, lo = max(-room) over side b's: one maximum.
    bounds = jax.ops.segment_max(-room, g.segment_factor + size * (g.segment_side < 0), 2 * size)
    hi, lo = -bounds[:size], bounds[size:]
    ok = jnp.isfinite(la) & jnp.isfinite(lb) & (lo <= hi) & mask
    best = 0.25 * jnp.where(ok, lb - la, 0)
    u = jnp.where(mask, jnp.where(ok, jnp.clip(best, lo, hi), 0), u)
    free = jnp.where(mask, ok & (best >= lo) & (best <= hi), free)
    top = jnp.maximum(top, jnp.max(jnp.where(ok, jnp.maximum(la, lb), -jnp.inf), initial=-jnp.inf))
    return u, free, top

  return jax.lax.fori_loop(
    0, len(g.colors), color, (u, jnp.zeros(size, bool), jnp.float32(-jnp.inf))
  )


def _flat_newton(
  g: _Graph, log_sq: jax.Array, u: jax.Array, free: jax.Array, shift: jax.Array
) -> jax.Array:
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
  size = u.size
  ids = g.slot.ravel()
  log_e = log_sq + 2 * jnp.sum(_terms(g, u), axis=1) - shift
  e = jnp.where(g.counted & jnp.isfinite(log_e), jnp.exp(jnp.minimum(log_e, 80.0)), 0.0)
  mask = free.astype(jnp.float32)

  def per_instance(x):  # sum over entries and slots of sign * x, onto every factor
    return jax.ops.segment_sum((x[:, None] * g.sign).ravel(), ids, size) * mask

  # The gradient and the diagonal of the Hessian in one segment sum.
  both = jax.ops.segment_sum(
    (e[:, None, None] * np.stack([g.sign, np.abs(g.sign)], -1)).reshape(-1, 2), ids, size
  )
  grad, diag = 2.0 * both[:, 0] * mask, 4 * both[:, 1]
  inverse = jnp.where(diag > 0, 1 / jnp.where(diag > 0, diag, 1), 0)

  def cg(carry):
    x, r, p, rz, k = carry
    hp = per_instance(4 * e * jnp.sum(_terms(g, p), axis=1))
    curv = p @ hp
    alpha = jnp.where(curv > 0, rz / jnp.where(curv > 0, curv, 1), 0)
    x, r = x + alpha * p, r - alpha * hp
    z = inverse * r
    new = r @ z
    return x, r, z + jnp.where(rz > 0, new / jnp.where(rz > 0, rz, 1), 0) * p, new, k + 1

  z = -inverse * grad
  rz0 = -grad @ z
  du, *_ = jax.lax.while_loop(
    lambda c: (c[3] > CG_TOLERANCE**2 * rz0) & (c[4] < MAX_CG),
    cg,
    (jnp.zeros_like(grad), -grad, z, rz0, 0),
  )
  slope = grad @ du
  change = 2 * jnp.sum(_terms(g, du), axis=1)
  steps = 2.0 ** -jnp.arange(LINE_SEARCH_STEPS, dtype=jnp.float32)
  decrease = jnp.sum(e[:, None] * jnp.expm1(steps * change[:, None]), axis=0)
  passed = (decrease <= 1e-4 * steps * slope) & (slope < 0)
  t = jnp.where(jnp.any(passed), steps[jnp.argmax(passed)], 0.0)
  return u + t * du


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
  minimum every instance is balanced. From no factors, each round, under ``jit``, takes one
  Newton step (see :func:`_flat_newton`) and one sweep of closed-form steps (which keeps
  every factor within its dtype bounds), until the sweep moves no log-factor
  by more than ``TOLERANCE`` or ``MAX_ITERATIONS`` rounds have run. Coordinate descent
  alone would need sweeps growing with the square of the depth of the overlaps (a chain
  of layers); the Newton step propagates along it at once.

  The residual is the largest move of a log-factor in the last sweep (half a
  ``log(||A|| / ||B||)`` that the sweep found): at most ``TOLERANCE`` when converged.
  """
  if not plan.overlapping:
    return _closed_form(plan, stats, dtypes, strength), jnp.float32(0.0)

  g = _Graph.of(plan, stats, dtypes)
  pieces = list(plan.pieces)
  log_sq = jnp.concatenate([jnp.ravel(stats[k][0]) for k in pieces])
  log_max = jnp.concatenate([jnp.ravel(stats[k][1]) for k in pieces])

  def body(carry):
    u, free, shift, _, n = carry
    stepped = _flat_newton(g, log_sq, u, free, jnp.where(jnp.isfinite(shift), shift, 0.0))
    new, free, shift = _flat_sweep(g, log_sq, log_max, stepped)
    return new, free, shift, jnp.max(jnp.abs(new - stepped), initial=0.0), n + 1

  size = g.spans[-1][1]
  top = jnp.max(jnp.where(jnp.isfinite(log_sq), log_sq, -jnp.inf))
  u, _, _, residual, _ = jax.lax.while_loop(
    lambda c: (c[3] > TOLERANCE) & (c[4] < MAX_ITERATIONS),
    body,
    (jnp.zeros(size, jnp.float32), jnp.ones(size, bool), top, jnp.float32(jnp.inf), 0),
  )
  return {
    i.key: jnp.exp(strength * u[a:b]).reshape(i.factor_shape)
    for i, (a, b) in zip(plan.instances, g.spans)
  }, residual


def _dtypes(params: Any) -> dict:
  return {path: leaf.dtype for path, leaf in paths.arrays_with_paths(params)}


def log_norms(plan: Plan, params: Any) -> dict[str, tuple[jax.Array, jax.Array]]:
  """Per instance: ``log`` of the group norms of sides A and B (scale-safe)."""
  stats = leaf_stats(plan, params)
  return {
    i.key: (0.5 * _side_log_sq(plan, stats, i, +1), 0.5 * _side_log_sq(plan, stats, i, -1))
    for i in plan.instances
  }


def compute_factors(
  plan: Plan, params: Any, strength: float, axis_name: AxisName = None
) -> tuple[Factors, jax.Array]:
  """The balancing factors of every instance in ``plan`` for ``params``, and the joint
  solve's residual (see :func:`solve`)."""
  return solve(plan, leaf_stats(plan, params, axis_name), _dtypes(params), strength)
