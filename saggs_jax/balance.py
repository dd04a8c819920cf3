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

This module solves for the factors; :mod:`saggs_jax.norms` takes the scale-safe
group norms it starts from and :mod:`saggs_jax.scaling` applies the factors to
parameters and moments. No NaN or Inf is ever produced: each module's docstring
says how. A factor never overflows a leaf's dtype: ``c`` is clipped so that
``c ||A_g||`` and ``||B_g|| / c`` (followers included) stay below the largest
finite value of each leaf's dtype, which bounds every scaled entry; a tensor whose
norm exceeds that value is bounded by its largest entry instead. This only binds
for tensors whose norm nears that value (float16 mostly); there the factor is the
closest admissible one, or 1 if none is. A zero or non-finite norm gives ``c_g = 1``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from saggs_jax import paths
from saggs_jax.norms import Stats, along_slot, leaf_stats, stacked_axes
from saggs_jax.numerics import AxisName, Factors, log_dtype_max
from saggs_jax.pairs import Instance, Plan

__all__ = ["TOLERANCE", "compute_factors", "log_norms", "solve"]


def _marginal(
  plan: Plan, piece: tuple, stats: jax.Array, u: dict, key: str, weight: int, reduce
) -> jax.Array:
  """``stats`` of ``piece`` with the log-factors ``weight * sign * u`` of its other slots
  applied, reduced to the groups of instance ``key``."""
  slots = plan.pieces[piece].slots
  for i, s in enumerate(slots):
    if s.key != key:
      stats = stats + weight * s.sign * along_slot(u[s.key], i, slots)
  return _onto(plan, piece, stats, key, u[key].shape, reduce)


def _onto(
  plan: Plan, piece: tuple, x: jax.Array, key: str, shape: tuple[int, ...], reduce
) -> jax.Array:
  """``x``, on the statistics layout of ``piece``, reduced to the groups of instance ``key``
  (of factor shape ``shape``)."""
  slots = plan.pieces[piece].slots
  j = next(i for i, s in enumerate(slots) if s.key == key)
  copies = stacked_axes(slots)
  kept = {copies.index(a) for a in slots[j].stacked} | {len(copies) + j}
  others = tuple(d for d in range(x.ndim) if d not in kept)
  return (reduce(x, axis=others) if others else x).reshape(shape)


def _logsumexp(xs: list[jax.Array]) -> jax.Array:
  return xs[0] if len(xs) == 1 else jax.nn.logsumexp(jnp.stack(xs), axis=0)


def _side_log_sq(plan: Plan, stats: Stats, u: dict, inst: Instance, sign: int) -> jax.Array:
  """``log ||side||**2`` per group of ``inst``, its other pairs' log-factors ``u`` applied."""
  return _logsumexp(
    [
      _marginal(plan, k, stats[k][0], u, inst.key, 2, jax.nn.logsumexp)
      for name in inst.members(sign)
      for k in plan.pieces_of(name, inst.key)
    ]
  )


def _no_factors(plan: Plan) -> dict:
  """Log-factors 0 (factors 1) for every instance."""
  return {i.key: jnp.zeros(i.factor_shape, jnp.float32) for i in plan.instances}


def _bounds(
  plan: Plan, stats: Stats, dtypes: dict, u: dict, inst: Instance
) -> tuple[jax.Array, jax.Array]:
  """``lo <= log c <= hi`` keeping every scaled entry of ``inst`` within its dtype."""
  lo, hi = jnp.full(inst.factor_shape, -jnp.inf), jnp.full(inst.factor_shape, jnp.inf)
  for sign in (+1, -1):
    for name in inst.members(sign) + inst.followers(sign):
      for k in plan.pieces_of(name, inst.key):
        size = _marginal(plan, k, stats[k][1], u, inst.key, 1, jnp.max)
        room = jnp.where(jnp.isfinite(size), log_dtype_max(dtypes[k[0]]) - size, jnp.inf)
        lo, hi = (lo, jnp.minimum(hi, room)) if sign > 0 else (jnp.maximum(lo, -room), hi)
  return lo, hi


def _sweep(
  plan: Plan, stats: Stats, dtypes: dict, u: dict, scale: float
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
  return functools.reduce(
    jnp.add, [s.sign * along_slot(u[s.key], i, slots) for i, s in enumerate(slots)]
  )


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
  members = {
    k
    for i in plan.instances
    for sign in (+1, -1)
    for name in i.members(sign)
    for k in plan.pieces_of(name, i.key)
  }
  counted = [k for k in plan.pieces if k in members]
  log_e = {p: stats[p][0] + 2 * _signed_sum(plan, p, u) - shift for p in counted}
  # A non-finite combination freezes (not free) every group it touches: drop it from f.
  e = {p: jnp.where(jnp.isfinite(v), jnp.exp(jnp.minimum(v, 80.0)), 0.0) for p, v in log_e.items()}
  # Vectors over all log-factors travel flat, each instance a static span.
  shapes = {i.key: i.factor_shape for i in plan.instances}
  ends = np.cumsum([int(np.prod(v)) for v in shapes.values()])
  flat = lambda d: jnp.concatenate([jnp.ravel(d[k]) for k in shapes])
  split = lambda v: {
    k: v[end - int(np.prod(sh)) : end].reshape(sh) for (k, sh), end in zip(shapes.items(), ends)
  }
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
  du, *_ = jax.lax.while_loop(
    lambda c: (c[3] > CG_TOLERANCE**2 * rz0) & (c[4] < MAX_CG),
    cg,
    (jnp.zeros_like(grad), -grad, z, rz0, 0),
  )
  slope = grad @ du
  du = split(du)
  change = {p: 2 * _signed_sum(plan, p, du) for p in counted}

  # Backtracking without a loop: the Armijo test at every step 2**-k at once.
  steps = 2.0 ** -jnp.arange(LINE_SEARCH_STEPS, dtype=jnp.float32)
  decrease = sum(
    jnp.sum(e[p][..., None] * jnp.expm1(steps * change[p][..., None]), axis=tuple(range(e[p].ndim)))
    for p in counted
  )
  passed = (decrease <= 1e-4 * steps * slope) & (slope < 0)
  t = jnp.where(jnp.any(passed), steps[jnp.argmax(passed)], 0.0)
  return {k: u[k] + t * du[k] for k in u}


def _onto_all(plan: Plan, e: dict, counted: list, key: str, shape) -> jax.Array:
  """``sum_p E_p`` over the counted pieces in instance ``key``, onto its groups."""
  return functools.reduce(
    jnp.add,
    [
      _onto(plan, p, e[p], key, shape, jnp.sum)
      for p in counted
      if any(s.key == key for s in plan.pieces[p].slots)
    ],
  )


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
    return {
      k: jnp.exp(v) for k, v in _sweep(plan, stats, dtypes, u, strength)[0].items()
    }, jnp.float32(0.0)

  def moved(a, b):
    return functools.reduce(jnp.maximum, [jnp.max(jnp.abs(a[k] - b[k]), initial=0.0) for k in a])

  def body(carry):
    u, free, shift, _, n = carry
    stepped = _newton(plan, stats, u, free, jnp.where(jnp.isfinite(shift), shift, 0.0))
    new, free, shift = _sweep(plan, stats, dtypes, stepped, 1.0)
    return new, free, shift, moved(new, stepped), n + 1

  free = jax.tree.map(lambda v: jnp.ones(v.shape, bool), u)  # the sweep clips after
  top = functools.reduce(
    jnp.maximum, [jnp.max(jnp.where(jnp.isfinite(v), v, -jnp.inf)) for v, _ in stats.values()]
  )
  u, _, _, residual, _ = jax.lax.while_loop(
    lambda c: (c[3] > TOLERANCE) & (c[4] < MAX_ITERATIONS),
    body,
    (u, free, top, jnp.float32(jnp.inf), 0),
  )
  return {k: jnp.exp(strength * v) for k, v in u.items()}, residual


def _dtypes(params: Any) -> dict:
  return {path: leaf.dtype for path, leaf in paths.arrays_with_paths(params)}


def log_norms(plan: Plan, params: Any) -> dict[str, tuple[jax.Array, jax.Array]]:
  """Per instance: ``log`` of the group norms of sides A and B (scale-safe)."""
  stats, u = leaf_stats(plan, params), _no_factors(plan)
  return {
    i.key: (0.5 * _side_log_sq(plan, stats, u, i, +1), 0.5 * _side_log_sq(plan, stats, u, i, -1))
    for i in plan.instances
  }


def compute_factors(
  plan: Plan, params: Any, strength: float, axis_name: AxisName = None
) -> tuple[Factors, jax.Array]:
  """The balancing factors of every instance in ``plan`` for ``params``, and the joint
  solve's residual (see :func:`solve`)."""
  return solve(plan, leaf_stats(plan, params, axis_name), _dtypes(params), strength)
