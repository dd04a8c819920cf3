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

The three jobs live in their own modules: :mod:`~saggs_jax.balance.statistics`
(scale-safe group norms), :mod:`~saggs_jax.balance.solver` (the factors, jointly
for overlapping pairs) and :mod:`~saggs_jax.balance.scaling` (applying factors
to parameters and moments). No NaN or Inf is ever produced: each module's
docstring says how.
"""

from __future__ import annotations

from typing import Any

import jax

from saggs_jax import paths
from saggs_jax.balance._common import AxisName, Factors, compute_dtype, replicated
from saggs_jax.balance.scaling import leaf_multiplier, scale_leaf, scale_tree
from saggs_jax.balance.solver import TOLERANCE, no_factors, side_log_sq, solve
from saggs_jax.balance.statistics import Stats, leaf_stats
from saggs_jax.pairs import Plan

__all__ = [
    "TOLERANCE", "AxisName", "Factors", "Stats", "compute_dtype", "compute_factors",
    "leaf_multiplier", "leaf_stats", "log_norms", "replicated", "scale_leaf", "scale_tree",
    "solve",
]


def _dtypes(params: Any) -> dict:
  return {path: leaf.dtype for path, leaf in paths.arrays_with_paths(params)}


def log_norms(plan: Plan, params: Any) -> dict[str, tuple[jax.Array, jax.Array]]:
  """Per instance: ``log`` of the group norms of sides A and B (scale-safe)."""
  stats, u = leaf_stats(plan, params), no_factors(plan)
  return {i.key: (0.5 * side_log_sq(plan, stats, u, i, +1),
                  0.5 * side_log_sq(plan, stats, u, i, -1)) for i in plan.instances}


def compute_factors(plan: Plan, params: Any, strength: float, axis_name: AxisName = None
                    ) -> tuple[Factors, jax.Array]:
  """The balancing factors of every instance in ``plan`` for ``params``, and the joint
  solve's residual (see :func:`solve`)."""
  return solve(plan, leaf_stats(plan, params, axis_name), _dtypes(params), strength)

