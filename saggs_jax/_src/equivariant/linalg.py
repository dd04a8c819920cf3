"""Matrix maths behind the equivariant rules.

Every function acts on a stack of matrices ``x`` of shape ``(..., units, features)``:
rows are the units that a block's symmetry permutes, leading axes are independent
copies. Inputs are floating arrays of at least float32; callers promote.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Literal, NamedTuple, cast

import jax
import jax.numpy as jnp

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


def _with_safety(safety: float):
  """Algorithm 1's set as p(x / safety) on every step but the last (the limit)."""
  return (
    tuple((a / safety, b / safety**3, c / safety**5) for a, b, c in _POLAR_EXPRESS[:-1])
    + _POLAR_EXPRESS[-1:]
  )


# The paper's safety factor: p(x/1.01) keeps bf16 round-off from pushing a
# singular value just past the interval the next polynomial was fitted on.
POLAR_EXPRESS = _with_safety(1.01)

# The set the Polar Express authors ship for Muon (5 steps, fitted with a 2e-2
# safety margin and a cushion of 2); it assumes the normaliser 1.02 ||X||_F.
# Lau & Su's reference code uses it for Muon.
POLAR_EXPRESS_CUSHION = (
  (8.156554524902461, -22.48329292557795, 15.878769915207462),
  (4.042929935166739, -2.808917465908714, 0.5000178451051316),
  (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
  (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
  (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# Algorithm 1's set with the safety factor 1.05 instead of 1.01; Lau & Su's
# reference code uses it for its inverse square roots, after normalising by
# 1.02 ||A||_F.
POLAR_EXPRESS_105 = _with_safety(1.05)


class CoefficientSet(NamedTuple):
  """Per-step ``(a, b, c)`` triples (the last repeats) and the normaliser they
  were fitted for: the input is divided by ``headroom * ||X||_F`` first."""

  triples: tuple[tuple[float, float, float], ...]
  headroom: float = 1.01


Coeffs = str | CoefficientSet | Sequence[float] | Sequence[Sequence[float]]


NS_COEFFS = MappingProxyType(
  {
    "quintic": CoefficientSet(QUINTIC),
    "polar_express": CoefficientSet(POLAR_EXPRESS),
    "polar_express_cushion": CoefficientSet(POLAR_EXPRESS_CUSHION, 1.02),
    "polar_express_1.05": CoefficientSet(POLAR_EXPRESS_105, 1.02),
  }
)

EpsForm = Literal["floor", "add"]


def _guard(norm: jax.Array, eps: float, form: EpsForm) -> jax.Array:
  """``max(norm, eps)`` ("floor": exact above eps) or ``norm + eps`` ("add")."""
  if form == "floor":
    return jnp.maximum(norm, eps)
  if form == "add":
    return norm + eps
  raise ValueError(f"eps_form must be 'floor' or 'add', got {form!r}.")


def _schedule(coeffs: Coeffs, steps: int) -> tuple[tuple[tuple[float, float, float], ...], float]:
  """``steps`` coefficient triples (a set shorter than ``steps`` repeats its
  last) and the headroom of the normaliser."""
  headroom = 1.01
  if isinstance(coeffs, str):
    if coeffs not in NS_COEFFS:
      raise ValueError(
        f"Unknown Newton-Schulz coefficients {coeffs!r}; expected one of {sorted(NS_COEFFS)}."
      )
    coeffs = NS_COEFFS[coeffs]
  if isinstance(coeffs, CoefficientSet):
    rows, headroom = coeffs
  elif len(coeffs) == 3 and all(isinstance(c, (int, float)) for c in coeffs):
    rows = (coeffs,)
  else:
    rows = coeffs
  rows = tuple(tuple(float(c) for c in abc) for abc in cast(Sequence[Sequence[float]], rows))
  if not rows or any(len(abc) != 3 for abc in rows):
    raise ValueError(f"Newton-Schulz coefficients must be (a, b, c) triples, got {rows!r}.")
  triples = cast(tuple[tuple[float, float, float], ...], rows)
  return tuple(triples[min(i, len(triples) - 1)] for i in range(steps)), headroom


def newton_schulz(
  x: jax.Array,
  coeffs: Coeffs = "polar_express",
  steps: int = 5,
  dtype: jax.typing.DTypeLike = jnp.bfloat16,
  eps: float = 1e-7,
  eps_form: EpsForm = "floor",
  gram: bool = False,
) -> jax.Array:
  """Approximates the polar factor ``U Vᵀ`` of each matrix in ``x``.

  With ``X₀ = X / max(h ||X||_F, ε)`` (``eps_form="add"``: ``h ||X||_F + ε``; ``h`` the
  coefficient set's headroom, 1.01 by default), each step applies the odd quintic
  ``X <- (a I + b G + c G²) X``, ``G = X Xᵀ``, which maps every singular value ``σ`` to
  ``a σ + b σ³ + c σ⁵``. Zero rows and columns stay zero. Only the matmul operands are
  rounded to ``dtype``; the iterate stays in ``x.dtype`` (at least float32).

  Args:
    x: ``(..., m, n)`` matrices.
    coeffs: a name in :data:`NS_COEFFS` (``"polar_express"``, the default; ``"quintic"``;
      the reference code's ``"polar_express_cushion"`` and ``"polar_express_1.05"``), a
      :class:`CoefficientSet`, one ``(a, b, c)`` triple or a per-step sequence of them.
    steps: number of iterations (unrolled: each is three small matmuls).
    dtype: dtype the matmul operands are rounded to.
    eps: floor (or shift) of the normaliser, so a zero matrix maps to zero.
    eps_form: ``"floor"`` or ``"add"``.
    gram: iterate on the small Gram matrix ``X Xᵀ`` of the wide orientation instead of
      on ``X`` (``m x m`` products only; cheaper once ``n`` is a few times ``m``). Same
      result in exact arithmetic.

  Returns:
    An array like ``x`` (same dtype).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> x = jax.random.normal(jax.random.key(0), (4, 6))
    >>> o = newton_schulz(x, "polar_express", steps=8, dtype=jnp.float32)
    >>> bool(jnp.allclose(o @ o.T, jnp.eye(4), atol=1e-2))
    True
  """
  # Numerics. The factored form (a I + b G + c G²) X, not the expanded a X + (b G + c G²) X:
  # the latter cancels terms near 20 down to about 2, which in bfloat16 exceeds the 1% margin
  # of Polar Express's safety factor, pushes a singular value past the interval the next
  # polynomial was fitted on (where a quintic grows like σ⁵), and later steps compound it.
  # Holding the iterate in float32 instead of rounding it each step lowers the error further
  # (bench/bench_newton_schulz_accuracy.py measures both, and prints each set's band: the
  # quintic never converges, it settles in about [0.68, 1.2]). The Gram variant: every
  # iterate is Q X₀ with Q a polynomial in A₀ = X₀ X₀ᵀ, so the steps update
  # P = a I + b A + c A², Q <- P Q, A <- P A P, about 4 m³ flops a step against
  # 2 m² n + m³ (bench/bench_gram_newton_schulz.py).
  triples, headroom = _schedule(coeffs, steps)
  y = x / _guard(headroom * jnp.linalg.norm(x, axis=(-2, -1), keepdims=True), eps, eps_form)
  eye = jnp.eye(min(x.shape[-2:]), dtype=y.dtype)

  def dot(p, q):
    return jnp.matmul(p.astype(dtype), q.astype(dtype), preferred_element_type=y.dtype)

  # The small Gram matrix (X^T X of a tall X, X X^T otherwise), and
  # polynomials in it applied on its side: X (aI + bG + cG^2) for a tall X.
  tall = x.shape[-2] > x.shape[-1]
  gram_of = lambda y: dot(y.mT, y) if tall else dot(y, y.mT)  # noqa: E731
  apply = lambda p, y: dot(y, p) if tall else dot(p, y)  # noqa: E731

  # Unrolled rather than a scan: a handful of steps compiles quickly, and on GPU
  # a while loop costs a device-to-host sync of its predicate per iteration.
  if gram:
    # The m x m products are not rounded to `dtype`: that would let A drift
    # from Q A_0 Q, and the polynomials blow up what drifts past their interval.
    a_k, q = gram_of(y), None
    for a, b, c in triples:
      p = a * eye + b * a_k + c * a_k @ a_k
      q = p if q is None else p @ q
      a_k = p @ a_k @ p
    y = apply(q, y)
  else:
    for a, b, c in triples:
      g = gram_of(y)
      y = apply(a * eye + b * g + c * dot(g, g), y)
  # XLA's CPU backend folds a caller's transpose into the last dot's output
  # layout, for which it has no bfloat16 x bfloat16 -> float32 kernel.
  return jax.lax.optimization_barrier(y)


def center(x: jax.Array) -> jax.Array:
  """P(X): subtracts the mean unit vector, removing the shared-shift direction."""
  return x - jnp.mean(x, axis=-2, keepdims=True)


def row_normalize(x: jax.Array, eps: float, eps_form: EpsForm = "floor") -> jax.Array:
  """R(X): every unit vector divided by ``max(||row||, eps)`` (or ``||row|| + eps``);
  zero rows stay zero."""
  return x / _guard(jnp.linalg.norm(x, axis=-1, keepdims=True), eps, eps_form)


def inv_sqrt(a: jax.Array, damping: jax.Array | float, coeffs: Coeffs, steps: int) -> jax.Array:
  """An iterative ``(A + δ I)^(-1/2)`` of symmetric PSD matrices ``a``.

  With ``B = A + δ I`` divided by ``s = h ||B||_F + δ`` (spectrum in
  ``(0, 1)``), the coupled iteration

    Y₀ = B / s,   Z₀ = I,   T = φ(I - Z Y),   Y <- Y T,   Z <- T Z,
    φ(r) = (a + b + c) - (b + 2c) r + c r²

  applies the same odd quintic ``p(x) = x φ(1 - x²)`` to the singular values
  of ``(B / s)^(1/2)`` that :func:`newton_schulz` applies to a matrix's, so
  ``Y -> (B / s)^(1/2)`` and ``Z -> (B / s)^(-1/2)``; the result is
  ``Z / √s``. Runs in the dtype of ``a``.

  Args:
    a: ``(..., n, n)`` symmetric PSD matrices (symmetrised first).
    damping: ``δ``, a float or an array broadcasting against
      ``(..., 1, 1)``.
    coeffs: a coefficient set (see :func:`newton_schulz`); its headroom is h.
    steps: iterations.
  """
  triples, headroom = _schedule(coeffs, steps)
  eye = jnp.eye(a.shape[-1], dtype=a.dtype)
  b = 0.5 * (a + a.mT) + damping * eye
  scale = headroom * jnp.linalg.norm(b, axis=(-2, -1), keepdims=True) + damping
  scale = jnp.maximum(scale, jnp.finfo(a.dtype).tiny)
  y, z = b / scale, jnp.broadcast_to(eye, b.shape)
  for ca, cb, cc in triples:
    r = eye - z @ y
    r = 0.5 * (r + r.mT)
    t = (ca + cb + cc) * eye - (cb + 2 * cc) * r + cc * r @ r
    y, z = y @ t, t @ z
  return z * jax.lax.rsqrt(scale)


Gram = Literal["smaller", "right", "left"]


def spectral(
  x: jax.Array,
  eps: float,
  *,
  relative: bool = True,
  method: Literal["eigh"] | Coeffs = "eigh",
  steps: int = 5,
  gram: Gram = "smaller",
) -> tuple[jax.Array, jax.Array]:
  """The one-sided spectral map, as its direction and its nuclear-norm factor.

  Returns

    X (Xᵀ X + ε' I)^(-1/2)   and   ν = tr(C (C + ε' I)^(-1/2)),   C = Xᵀ X,

  ``ν`` the nuclear norm softened below ``√ε'`` (shape ``(..., 1, 1)``).
  With ``relative`` the floor is ``ε' = ε ||X||_F²``, so the map is positively
  homogeneous (scale the gradient, scale ``ν``) and float32 eigenvalues are
  resolved at any gradient scale; otherwise ``ε' = ε``.

  The push-through identity ``X f(Xᵀ X) = f(X Xᵀ) X`` makes this equal to the
  left form ``(X Xᵀ + ε' I)^(-1/2) X`` (and ``ν`` to
  ``tr(C' (C' + ε' I)^(-1/2))``, ``C' = X Xᵀ``): ``gram`` picks the Gram
  matrix, by default the smaller. ``method="eigh"`` decomposes it exactly
  (after dividing X by its norm); a coefficient set runs :func:`inv_sqrt` on
  the Gram of X as given, for ``steps`` steps. The iteration is approximate:
  the two Gram matrices then give different results.
  """
  rows, cols = x.shape[-2:]
  left = gram == "left" or (gram == "smaller" and rows < cols)
  if gram not in ("smaller", "right", "left"):
    raise ValueError(f"gram must be 'smaller', 'right' or 'left', got {gram!r}.")
  norm = jnp.linalg.norm(x, axis=(-2, -1), keepdims=True)
  if isinstance(method, str) and method == "eigh":
    y = x / jnp.maximum(norm, jnp.finfo(x.dtype).tiny)
    floor = eps if relative else eps / jnp.maximum(norm, jnp.finfo(x.dtype).tiny) ** 2
    c = y @ y.mT if left else y.mT @ y
    lam, q = jnp.linalg.eigh(c)
    lam = jnp.maximum(lam, 0.0)  # eigh can return tiny negatives
    inv = jax.lax.rsqrt(lam + floor)
    nu = norm * jnp.sum(lam * inv, axis=-1)[..., None, None]
    root = (q * inv[..., None, :]) @ q.mT
  else:
    c = x @ x.mT if left else x.mT @ x
    root = inv_sqrt(c, eps * norm**2 if relative else eps, method, steps)
    nu = jnp.sum(c * root.mT, axis=(-2, -1), keepdims=True)  # tr(C R)
    y = x
  return (root @ y if left else y @ root), nu
