"""Settings the update rules share, grouped as optax groups Muon's dimension numbers.

:class:`NewtonSchulz` configures the polar factor of :func:`scale_by_polar` and of
:func:`scale_by_hybrid`; :class:`InverseSqrt` the Gram inverse square root of the spectral
rules and of ``scale_by_hybrid(polar=InverseSqrt(...))``.

Example:
  >>> import jax.numpy as jnp
  >>> from saggs_jax import equivariant as eqv
  >>> eqv.NewtonSchulz(steps=10, dtype=jnp.float32)
  NewtonSchulz(coeffs='polar_express', steps=10, dtype=<class 'jax.numpy.float32'>, gram=False)
  >>> tx = eqv.scale_by_polar(heads=eqv.Heads(num=2), newton_schulz=eqv.NewtonSchulz(coeffs="quintic"))
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from saggs_jax._src.equivariant import linalg


class NewtonSchulz(NamedTuple):
  """The Newton-Schulz iterations of a polar factor (see :func:`newton_schulz`).

  Attributes:
    coeffs: ``"polar_express"`` (default), ``"quintic"`` (Keller Jordan's Muon), another
      name of :data:`COEFFICIENT_SETS`, a :class:`CoefficientSet` or explicit triples.
    steps: iterations.
    dtype: dtype of the iterations' matmuls.
    gram: iterate on the Gram matrix of each block (faster for blocks several times as
      long as wide).
  """

  coeffs: linalg.Coeffs = "polar_express"
  steps: int = 5
  dtype: Any = jnp.bfloat16
  gram: bool = False


class InverseSqrt(NamedTuple):
  """The inverse square root of a Gram matrix ``C + ε' I``.

  Attributes:
    method: ``"eigh"`` (exact) or a coefficient set for the iterative inverse square root
      (see :func:`saggs_jax._src.equivariant.linalg.inv_sqrt`).
    steps: iterations of the iterative inverse square root.
    gram: ``"smaller"``, ``"right"`` (``Xᵀ X``) or ``"left"`` (``X Xᵀ``): the Gram matrix
      whose inverse square root is taken.
    relative_eps: the floor ``ε'`` is the rule's ``eps`` times ``||X||_F²`` (the map is
      then scale-equivariant); False: ``eps`` itself.
  """

  method: str | linalg.Coeffs = "eigh"
  steps: int = 5
  gram: linalg.Gram = "smaller"
  relative_eps: bool = True
