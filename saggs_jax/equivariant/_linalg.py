"""Matrix maths behind the equivariant rules.

Every function acts on a stack of matrices ``x`` of shape ``(..., units, features)``:
rows are the units that a block's symmetry permutes, leading axes are independent
copies. Inputs are floating arrays of at least float32; callers promote.
"""

from __future__ import annotations

import functools
from typing import Sequence, Union

import jax
import jax.numpy as jnp

Coeffs = Union[str, Sequence[float], Sequence[Sequence[float]]]

# Keller Jordan's Muon quintic: steep at 0, so 5 steps suffice, but it does not
# converge; singular values settle in about [0.68, 1.2].
QUINTIC = ((3.4445, -4.7750, 2.0315),)

# Polar Express (Amsel, Persson, Musco, Gower 2025, Algorithm 1): per-step
# degree-5 polynomials, each optimal for the interval its predecessor leaves,
# starting from [1e-3, 1]. The last one is the limit and repeats.
_POLAR_EXPRESS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
# The paper's safety factor: p(x/1.01) keeps bf16 round-off from pushing a
# singular value just past the interval the next polynomial was fitted on.
POLAR_EXPRESS = tuple(
    (a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _POLAR_EXPRESS[:-1]
) + _POLAR_EXPRESS[-1:]

NS_COEFFS = {"quintic": QUINTIC, "polar_express": POLAR_EXPRESS}


def _schedule(coeffs: Coeffs, steps: int) -> tuple[tuple[float, float, float], ...]:
  """``steps`` coefficient triples; a schedule shorter than ``steps`` repeats its last."""
  if isinstance(coeffs, str):
    if coeffs not in NS_COEFFS:
      raise ValueError(f"Unknown Newton-Schulz coefficients {coeffs!r}; expected one of {sorted(NS_COEFFS)}.")
    coeffs = NS_COEFFS[coeffs]
  elif len(coeffs) == 3 and all(isinstance(c, (int, float)) for c in coeffs):
    coeffs = (coeffs,)
  coeffs = tuple(tuple(float(c) for c in abc) for abc in coeffs)
  if not coeffs or any(len(abc) != 3 for abc in coeffs):
    raise ValueError(f"Newton-Schulz coefficients must be (a, b, c) triples, got {coeffs!r}.")
  return tuple(coeffs[min(i, len(coeffs) - 1)] for i in range(steps))


def newton_schulz(
    x: jax.Array,
    coeffs: Coeffs = "polar_express",
    steps: int = 5,
    dtype: jnp.dtype = jnp.bfloat16,
    eps: float = 1e-7,
) -> jax.Array:
  r"""Approximates the polar factor :math:`UV^\top` of each matrix in ``x``.

  With :math:`X_0 = X / \max(1.01\,\|X\|_F, \epsilon)` (singular values in
  :math:`[0, 1)`), each step applies the odd quintic
  :math:`X \leftarrow (aI + bG + cG^2)X`, :math:`G = XX^\top`, which maps every
  singular value :math:`\sigma` to :math:`a\sigma + b\sigma^3 + c\sigma^5` and
  leaves the singular vectors alone. Rows and columns that are zero stay
  exactly zero.

  The small factor :math:`aI + bG + cG^2` is formed in at least float32 and
  every matmul accumulates in at least float32, so only :math:`X`, :math:`G`
  and that factor are ever rounded to ``dtype``. The expanded form
  :math:`aX + (bG + cG^2)X` cancels terms near 20 in size down to about 2 in
  bfloat16: its error exceeds the 1% margin of Polar Express's safety factor,
  pushes a singular value past the interval the next polynomial was fitted on,
  where a quintic grows like :math:`\sigma^5`, and the remaining steps compound
  it (one 2 x 2 input went 2.01, 2.07, 2.8, 41, then 4.6e7).

  Args:
    x: ``(..., m, n)`` matrices.
    coeffs: ``"polar_express"`` (default), ``"quintic"``, one ``(a, b, c)``
      triple or a per-step sequence of triples (its last repeats). At equal
      steps Polar Express leaves every singular value closer to 1 than the
      quintic does: on a condition number ~1e3 input (16 x 32, bfloat16), 5
      steps give about [0.71, 1.12] against the quintic's [0.36, 1.16], and 6
      steps about [0.95, 1.00], a band the quintic never reaches (it settles in
      about [0.68, 1.2]).
    steps: number of iterations (unrolled: each is three small matmuls).
    dtype: dtype the matmul operands are rounded to (the normalisation is in
      ``x.dtype``, accumulation in at least float32).
    eps: floor of the normaliser, so a zero matrix maps to zero.

  Returns:
    An array like ``x`` (same dtype).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> x = jax.random.normal(jax.random.key(0), (4, 6))
    >>> o = newton_schulz(x, "polar_express", steps=8, dtype=jnp.float32)
    >>> bool(jnp.allclose(o @ o.T, jnp.eye(4), atol=1e-2))
    True
  """
  # Iterate on the wide orientation: the Gram matrix X X^T is then the small one.
  tall = x.shape[-2] > x.shape[-1]
  y = x.mT if tall else x
  norm = jnp.linalg.norm(y, axis=(-2, -1), keepdims=True)
  y = (y / jnp.maximum(1.01 * norm, eps)).astype(dtype)
  acc = jnp.promote_types(dtype, jnp.float32)
  matmul = functools.partial(jnp.matmul, preferred_element_type=acc)
  eye = jnp.eye(y.shape[-2], dtype=acc)

  # Unrolled rather than a scan: a handful of steps compiles quickly, and on GPU
  # a while loop costs a device-to-host sync of its predicate per iteration.
  for a, b, c in _schedule(coeffs, steps):
    gram = matmul(y, y.mT)
    poly = a * eye + b * gram + c * matmul(gram.astype(dtype), gram.astype(dtype))
    y = matmul(poly.astype(dtype), y).astype(dtype)
  y = y.astype(x.dtype)
  return y.mT if tall else y


def center(x: jax.Array) -> jax.Array:
  """P(X): subtracts the mean unit vector, removing the shared-shift direction."""
  return x - jnp.mean(x, axis=-2, keepdims=True)


def row_normalize(x: jax.Array, eps: float) -> jax.Array:
  """R(X): every unit vector divided by ``max(||row||, eps)``; zero rows stay zero."""
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


def spectral(x: jax.Array, eps: float) -> jax.Array:
  r"""The one-sided spectral map :math:`\nu\, X (X^\top X + \epsilon' I)^{-1/2}`.

  :math:`\nu = \operatorname{tr}(C (C + \epsilon' I)^{-1/2})` with
  :math:`C = X^\top X` is the nuclear norm softened below :math:`\sqrt{\epsilon'}`.
  The floor is relative, :math:`\epsilon' = \epsilon \|X\|_F^2`, so the map is
  positively homogeneous (scale the gradient, scale the update) and float32
  eigenvalues are resolved at any gradient scale.

  The push-through identity :math:`X f(X^\top X) = f(XX^\top) X` makes this
  equal to the left form :math:`\nu (XX^\top + \epsilon' I)^{-1/2} X`; the
  smaller Gram matrix is the one decomposed (with ``eigh``).
  """
  scale = jnp.linalg.norm(x, axis=(-2, -1), keepdims=True)
  y = x / jnp.maximum(scale, jnp.finfo(x.dtype).tiny)
  left = y.shape[-2] < y.shape[-1]
  gram = y @ y.mT if left else y.mT @ y
  lam, q = jnp.linalg.eigh(gram)
  lam = jnp.maximum(lam, 0.0)  # eigh can return tiny negatives
  inv_sqrt = jax.lax.rsqrt(lam + eps)
  nu = jnp.sum(lam * inv_sqrt, axis=-1)[..., None, None]
  root = (q * inv_sqrt[..., None, :]) @ q.mT
  return scale * nu * (root @ y if left else y @ root)
