"""saggs_jax._src.equivariant.linalg: Newton-Schulz against the published Polar Express
polynomials and an SVD, its coefficient forms and edge inputs, the Gram form, and the
iterative inverse square root against ``eigh``."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from equivariant_oracles import orthogonal, polar, rand
from saggs_jax._src.equivariant import linalg

# Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932): the
# degree-5 polynomials as published, before the paper's 1.01 safety factor
# p(x / 1.01), which applies to every step but the last (the limit, repeated).
PUBLISHED_POLAR_EXPRESS = (
  (8.28721201814563, -23.595886519098837, 17.300387312530933),
  (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
  (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
  (3.3184196573706015, -2.488488024314874, 0.51004894012372),
  (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
  (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
  (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
  (1.875, -1.25, 0.375),
)


def polar_express_map(sigma, steps):
  """The scalar map Newton-Schulz applies to each normalised singular value (float64)."""
  *early, last = PUBLISHED_POLAR_EXPRESS
  schedule = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in early] + [last]
  for k in range(steps):
    a, b, c = schedule[min(k, len(schedule) - 1)]
    sigma = a * sigma + b * sigma**3 + c * sigma**5
  return sigma


def newton_schulz_oracle(x, steps, eps=1e-7):
  """U f(S / max(1.01 ||x||_F, eps)) V^T from a float64 SVD, f = polar_express_map."""
  u, s, vt = np.linalg.svd(np.asarray(x, np.float64), full_matrices=False)
  scale = np.maximum(1.01 * np.linalg.norm(s, axis=-1, keepdims=True), eps)
  return (u * polar_express_map(s / scale, steps)[..., None, :]) @ vt


def ill_conditioned(m, n, cond=1e3):
  k = min(m, n)
  a, b = np.linalg.qr(rand(18, (m, k)))[0], np.linalg.qr(rand(19, (n, k)))[0]
  return ((a * np.logspace(0, -np.log10(cond), k)) @ b.T).astype(np.float32)


NS_BF16 = jax.jit(linalg.newton_schulz, static_argnames=("coeffs", "steps"))


NS_F32 = jax.jit(
  functools.partial(linalg.newton_schulz, dtype=jnp.float32), static_argnames=("steps",)
)


def singular_values(x):
  return np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)


def test_polar_express_constants_are_the_published_ones():
  *early, last = PUBLISHED_POLAR_EXPRESS
  expected = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in early] + [last]
  np.testing.assert_allclose(np.array(linalg.POLAR_EXPRESS), np.array(expected), rtol=1e-13)


@pytest.mark.parametrize("steps", range(1, 9))
def test_newton_schulz_applies_the_published_polynomials(steps):
  """In float32, step k maps every singular value by the k-th published
  polynomial and keeps the singular vectors: each step's coefficients are
  checked (a digit swap such as -2.9478 -> -2.9748 moves some singular value
  by more than 0.04; the tolerance is 1e-4)."""
  x = ill_conditioned(16, 32)
  expected = newton_schulz_oracle(x, steps)
  np.testing.assert_allclose(
    NS_F32(jnp.asarray(x), steps=steps), expected, atol=1e-4 * np.abs(expected).max()
  )


@pytest.mark.parametrize("cond,steps", [(1e2, 5), (1e3, 6)])
@pytest.mark.parametrize("shape", [(16, 32), (32, 16)])
def test_newton_schulz_default_singular_values(shape, cond, steps):
  """The default schedule (Polar Express) in bfloat16 on ill-conditioned input:
  the singular values stay in the band of the float64 map (widened by bfloat16
  round-off), so in [0.7, 1.2] with the default 5 steps at condition number
  1e2, and with 6 steps at 1e3 (about [0.95, 1.00]; 5 steps leave the
  smallest at about 0.7 there)."""
  x = ill_conditioned(*shape, cond=cond)
  out = NS_BF16(jnp.asarray(x), steps=steps)
  assert out.dtype == jnp.float32
  s, exact = singular_values(out), singular_values(newton_schulz_oracle(x, steps))
  assert exact.min() - 0.05 <= s.min() and s.max() <= exact.max() + 0.02, (s, exact)
  assert 0.7 <= s.min() and s.max() <= 1.2, (s.min(), s.max())
  # And the singular vectors are those of x: out ~ polar(x) up to the band.
  assert np.linalg.norm(out - polar(x.astype(np.float64))) <= 0.3 * np.sqrt(min(shape))


def in_default_band(x, out):
  """bfloat16 Polar Express's band: no singular value above 1.14 (the float64
  map's maximum is 1.124), none below 0.8 when every normalised singular value
  of ``x`` is at least 3e-3 (the map's minimum there is 0.870)."""
  s_in = singular_values(x)
  s_in = s_in / np.maximum(1.01 * np.linalg.norm(s_in, axis=-1, keepdims=True), 1e-7)
  s = singular_values(out)
  assert np.all(np.isfinite(s)) and s.max() <= 1.14, s.max()
  conditioned = s_in.min(axis=-1) >= 3e-3
  assert s.min(axis=-1)[conditioned].min() >= 0.8, s.min(axis=-1)[conditioned].min()


@pytest.mark.parametrize("shape", [(2, 2), (2, 3), (3, 2), (3, 3), (4, 6)])
def test_newton_schulz_default_never_blows_up_on_small_matrices(shape):
  """bfloat16 Polar Express on 20000 random small matrices at scales 1e-9 to
  1e3 stays in its band. Rounding the expanded form aX + (bG + cG^2)X to
  bfloat16 blew up about 1 in 2000 of them, to as much as 1e11."""
  rng = np.random.default_rng(0)
  n = 20000
  x = rng.normal(size=(n, *shape)) * 10.0 ** rng.uniform(-9, 3, size=(n, 1, 1))
  x = x.astype(np.float32)
  in_default_band(x, NS_BF16(jnp.asarray(x)))


def test_newton_schulz_issue_9_example():
  """The input that reached 2.7e7 with the expanded form."""
  x = np.array([[-2.57e-05, 1.17e-04], [1.27e-04, -7.45e-05]], np.float32)
  in_default_band(x[None], NS_BF16(jnp.asarray(x))[None])


@pytest.mark.parametrize("shape", [(16, 32), (32, 16), (64, 256)])
def test_polar_express_beats_quintic_at_equal_steps(shape):
  """Why Polar Express is the default: at Muon's 5 steps its singular values
  are closer to 1 at both ends than the quintic's."""
  x = jnp.asarray(ill_conditioned(*shape))
  pe, quintic = (
    singular_values(NS_BF16(x, coeffs=c, steps=5)) for c in ("polar_express", "quintic")
  )
  assert pe.min() > quintic.min() and pe.max() < quintic.max(), (pe, quintic)


@pytest.mark.parametrize("shape", [(16, 32), (32, 16)])
def test_quintic_settles_in_its_band(shape):
  """The quintic does not converge: its iterates settle where p maps about
  [0.68, 1.2] into itself (min of p there ~0.68), so 0.7 is out of reach."""
  x = ill_conditioned(*shape)
  out = NS_BF16(jnp.asarray(x), coeffs="quintic", steps=8)
  s = singular_values(out)
  assert 0.6 <= s.min() and s.max() <= 1.25, (s.min(), s.max())
  assert np.linalg.norm(out - polar(x.astype(np.float64))) <= 0.4 * np.sqrt(min(shape))


def test_newton_schulz_default_zero_and_tiny_inputs():
  """Default settings (bfloat16 Polar Express): a zero matrix maps to zero, not
  NaN, and one whose squares underflow float32 stays finite."""
  assert np.all(np.asarray(linalg.newton_schulz(jnp.zeros((3, 16, 32)))) == 0.0)
  assert np.all(np.isfinite(np.asarray(linalg.newton_schulz(jnp.full((16, 32), 1e-30)))))


def test_newton_schulz_coefficient_forms():
  x = jnp.asarray(rand(20, (6, 9), np.float32))
  quintic = linalg.newton_schulz(x, "quintic")
  chex.assert_trees_all_close(linalg.newton_schulz(x, (3.4445, -4.7750, 2.0315)), quintic)
  chex.assert_trees_all_close(linalg.newton_schulz(x, [linalg.QUINTIC[0]] * 5), quintic)
  chex.assert_trees_all_close(
    linalg.newton_schulz(x), linalg.newton_schulz(x, linalg.POLAR_EXPRESS)
  )
  with pytest.raises(ValueError, match="nope"):
    linalg.newton_schulz(x, "nope")


NS_GRAM = jax.jit(
  functools.partial(linalg.newton_schulz, gram=True), static_argnames=("coeffs", "steps", "dtype")
)


@pytest.mark.parametrize("shape", [(8, 40), (40, 8), (3, 12, 12)])
def test_gram_newton_schulz_matches_exact_polar(shape):
  """Float32, enough steps: the Gram iteration reaches the SVD polar factor, up to
  rounding that grows with the condition number (2 to 150 here): iterating on
  X^T X, whose condition number is the square, costs accuracy. The bound is
  8 kappa eps per matrix: the errors reached 1.4e-5 to 5e-5 (1.7 to 2.9 kappa
  eps) for the square blocks on one CPU, and stayed under 2e-5 on another;
  three steps instead of ten miss it by four orders of magnitude."""
  x = rand(30, shape, np.float32)
  out = np.asarray(NS_GRAM(jnp.asarray(x), steps=10, dtype=jnp.float32), np.float64)
  mats = x.reshape((-1,) + shape[-2:]).astype(np.float64)
  expected = np.stack([polar(m) for m in mats])
  sv = np.linalg.svd(mats, compute_uv=False)
  bound = 8 * sv.max(-1) / sv.min(-1) * np.finfo(np.float32).eps
  err = np.abs(out.reshape(expected.shape) - expected).max(axis=(-2, -1))
  assert np.all(err <= bound), (err, bound)


@pytest.mark.parametrize("shape", [(16, 64), (64, 16)])
def test_gram_newton_schulz_default_bfloat16(shape):
  """bfloat16 matmuls, 5 steps, condition number 1e2: the band of the plain
  iteration ([0.7, 1.3]), and within 0.2 (relative) of it; zeros stay zeros."""
  x = jnp.asarray(ill_conditioned(*shape, cond=1e2))
  gram, plain = NS_GRAM(x, steps=5, dtype=jnp.bfloat16), NS_BF16(x, steps=5)
  s = singular_values(gram)
  assert 0.7 <= s.min() and s.max() <= 1.3, (s.min(), s.max())
  assert np.linalg.norm(gram - plain) <= 0.2 * np.linalg.norm(plain)
  assert np.all(np.asarray(NS_GRAM(jnp.zeros(shape), steps=5, dtype=jnp.bfloat16)) == 0.0)


def test_iterative_inverse_square_root():
  """The coupled iteration behind Lau & Su's spectral rules reaches the exact
  (C + d I)^(-1/2) given steps (12 here, condition number 1e2); at their 5
  steps it is within 20% of it."""
  q = orthogonal(32, 6)
  c = (q * np.logspace(0, -2, 6)) @ q.T
  lam, v = np.linalg.eigh(c + 1e-3 * np.eye(6))
  exact = (v / np.sqrt(lam)) @ v.T
  inv_sqrt = linalg.inv_sqrt
  for steps, tol in ((12, 1e-4), (5, 0.2)):
    out = np.asarray(
      inv_sqrt(jnp.asarray(c, jnp.float32), 1e-3, "polar_express_1.05", steps), np.float64
    )
    assert np.linalg.norm(out - exact) <= tol * np.linalg.norm(exact), (
      steps,
      np.linalg.norm(out - exact),
    )
