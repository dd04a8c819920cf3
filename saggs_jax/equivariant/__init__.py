"""Symmetry-compatible update rules and a layerwise stack that routes
parameters to them by path, after Lau and Su, "Symmetry-Compatible Principle
for Optimizer Design: Embeddings, LM Heads, SwiGLU MLPs, and MoE Routers"
(2026).

Each rule's update is equivariant under the symmetry group of its weight block:
polar (Muon) for general matrices, row-norm / one-sided spectral / hybrid rules
for blocks whose units can be permuted (embeddings, LM heads, SwiGLU neurons,
MoE experts), centred variants where a shared shift changes nothing. Layouts are declared
with ``optax.contrib.MuonDimensionNumbers`` (polar) and
:class:`UnitDimensionNumbers` (unit rules); :func:`role_dimension_numbers`
emits the tree ``optax.contrib.muon`` takes for the same matrices.

Example:
  >>> import jax.numpy as jnp, optax
  >>> from saggs_jax import equivariant as eqv
  >>> tx = eqv.layerwise(
  ...     {"embed/embedding": eqv.optimizer(eqv.scale_by_row_norm(unit_axis=0), 0.01),
  ...      ("q_proj/kernel", "k_proj/kernel"): eqv.optimizer(eqv.scale_by_polar(heads=eqv.Heads(num=2)), 0.02)},
  ...     default=optax.adamw(3e-4))
  >>> params = {"embed": {"embedding": jnp.ones((16, 8))},
  ...           "q_proj": {"kernel": jnp.ones((8, 8))}, "k_proj": {"kernel": jnp.ones((8, 8))},
  ...           "norm": {"scale": jnp.ones(8)}}
  >>> updates, state = tx.update(params, tx.init(params), params)
"""

from optax.contrib import MuonDimensionNumbers

from saggs_jax._src.equivariant.dimension_numbers import (
  Heads,
  UnitDimensionNumbers,
  muon_dimension_numbers,
)
from saggs_jax._src.equivariant.linalg import CoefficientSet
from saggs_jax._src.equivariant.roles import ROLE_PATTERNS, role_dimension_numbers
from saggs_jax._src.equivariant.rules import (
  REFERENCE,
  MomentumState,
  scale_by_hybrid,
  scale_by_left_spectral,
  scale_by_polar,
  scale_by_right_spectral,
  scale_by_row_norm,
)
from saggs_jax._src.equivariant.settings import InverseSqrt, NewtonSchulz
from saggs_jax._src.equivariant.stack import (
  Decoder,
  RoleRules,
  layerwise,
  optimizer,
  symmetry_compatible,
)

__all__ = [
  "CoefficientSet",
  "Decoder",
  "Heads",
  "InverseSqrt",
  "MomentumState",
  "MuonDimensionNumbers",
  "NewtonSchulz",
  "REFERENCE",
  "ROLE_PATTERNS",
  "RoleRules",
  "UnitDimensionNumbers",
  "layerwise",
  "muon_dimension_numbers",
  "optimizer",
  "role_dimension_numbers",
  "scale_by_hybrid",
  "scale_by_left_spectral",
  "scale_by_polar",
  "scale_by_right_spectral",
  "scale_by_row_norm",
  "symmetry_compatible",
]
