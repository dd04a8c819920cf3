"""Tests of saggs_jax.equivariant: each rule against a float64 numpy reference of
its definition, its symmetry group, zero rows, dtypes, per-head and joint
layouts, Newton-Schulz numerics, routing by path and Lau and Su's layerwise stack.

Rules run with beta=0 (the update is the direction of the gradient itself) and
float32 Polar Express iterations unless a test is about the defaults.
"""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from saggs_jax import equivariant as eqv
from saggs_jax.paths import path_str

U, F = 12, 5  # units x features of the test matrices (U > F + 1: P(G) keeps full rank)
EPS_SPECTRAL = 1e-6
EXACT_NS = dict(newton_schulz=eqv.NewtonSchulz("polar_express", steps=10, dtype=jnp.float32))


# ----------------------------------------------------------------- references


def center(x):
  return x - x.mean(axis=0, keepdims=True)


def row_norm(x, eps=1e-8):
  return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), eps)


def polar(x):
  u, s, vt = np.linalg.svd(x, full_matrices=False)
  keep = s > 1e-9 * s.max()
  return u[:, keep] @ vt[keep]


def nuclear(x):
  return np.linalg.svd(x, compute_uv=False).sum()


def right_spectral(x, eps=EPS_SPECTRAL):
  e = eps * np.sum(x**2)
  lam, q = np.linalg.eigh(x.T @ x)
  lam = np.maximum(lam, 0)
  nu = np.sum(lam / np.sqrt(lam + e))
  return nu * x @ (q / np.sqrt(lam + e)) @ q.T


def left_spectral(x, eps=EPS_SPECTRAL):
  e = eps * np.sum(x**2)
  lam, q = np.linalg.eigh(x @ x.T)
  lam = np.maximum(lam, 0)
  nu = np.sum(lam / np.sqrt(lam + e))
  return nu * (q / np.sqrt(lam + e)) @ q.T @ x


def rand(key, shape, dtype=np.float64):
  return np.random.default_rng(key).normal(size=shape).astype(dtype)


def orthogonal(key, n):
  q, r = np.linalg.qr(rand(key, (n, n)))
  return q * np.sign(np.diag(r))


def close(actual, expected, rtol=1e-4):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.abs(expected).max())


# ---------------------------------------------------------- rules on (U, F)

# name -> (rule with units on axis 0, reference, centred, zero rows stay zero)
RULES = {
  "row_norm": (eqv.scale_by_row_norm(0, beta=0.0), row_norm, False, True),
  "row_norm_centered": (
    eqv.scale_by_row_norm(0, center=True, beta=0.0),
    lambda x: center(row_norm(center(x))),
    True,
    False,
  ),
  "right_spectral": (eqv.scale_by_right_spectral(0, beta=0.0), right_spectral, False, True),
  "right_spectral_centered": (
    eqv.scale_by_right_spectral(0, center=True, beta=0.0),
    lambda x: right_spectral(center(x)),
    True,
    False,
  ),
  "left_spectral": (
    eqv.scale_by_left_spectral(0, beta=0.0),
    lambda x: center(left_spectral(center(x))),
    True,
    False,
  ),
  "hybrid_row_then_polar": (
    eqv.scale_by_hybrid(0, beta=0.0, **EXACT_NS),
    lambda x: nuclear(row_norm(x)) * polar(row_norm(x)),
    False,
    True,
  ),
  "hybrid_row_then_polar_centered": (  # re-centred between R and the polar step
    eqv.scale_by_hybrid(0, center=True, beta=0.0, **EXACT_NS),
    lambda x: center(nuclear(center(row_norm(center(x)))) * polar(center(row_norm(center(x))))),
    True,
    False,
  ),
  "hybrid_polar_then_row": (
    eqv.scale_by_hybrid(0, order="polar_then_row", beta=0.0, **EXACT_NS),
    lambda x: row_norm(polar(x)),
    False,
    True,
  ),
  "hybrid_polar_then_row_centered": (
    eqv.scale_by_hybrid(0, order="polar_then_row", center=True, beta=0.0, **EXACT_NS),
    lambda x: center(row_norm(polar(center(x)))),
    True,
    False,
  ),
  "polar": (eqv.scale_by_polar(0, 1, beta=0.0, **EXACT_NS), polar, False, True),
}
# One jitted update per rule, shared by every test that uses it.
STEP = {
  name: jax.jit(lambda g, tx=tx: tx.update(g, tx.init(g))[0]) for name, (tx, *_) in RULES.items()
}


@pytest.mark.parametrize("name", RULES)
def test_rule_matches_definition(name):
  _, reference, *_ = RULES[name]
  g = rand(0, (U, F), np.float32)
  close(STEP[name](g), reference(g.astype(np.float64)), rtol=2e-4)


@pytest.mark.parametrize("name", RULES)
def test_rule_equivariance(name):
  _, _, centred, _ = RULES[name]
  g = rand(1, (U, F), np.float32)
  out = np.asarray(STEP[name](g), np.float64)
  if name == "polar":  # orthogonal on both sides
    a, b = orthogonal(2, U), orthogonal(3, F)
    close(STEP[name]((a @ g @ b).astype(np.float32)), a @ out @ b)
  else:  # unit permutations x orthogonal maps of the features
    perm, q = np.random.default_rng(2).permutation(U), orthogonal(3, F)
    close(STEP[name]((g[perm] @ q).astype(np.float32)), out[perm] @ q)
  if centred:  # a shared shift of every unit vector changes nothing
    close(STEP[name](g + 3.0 * rand(4, (1, F), np.float32)), out, rtol=1e-3)


@pytest.mark.parametrize("name", RULES)
def test_zero_gradients(name):
  *_, zero_rows_stay = RULES[name]
  zero = np.asarray(STEP[name](np.zeros((U, F), np.float32)))
  assert np.all(zero == 0.0)
  g = rand(5, (U, F), np.float32)
  g[[2, 7]] = 0.0
  out = np.asarray(STEP[name](g))
  assert np.all(np.isfinite(out))
  if zero_rows_stay:
    assert np.all(out[[2, 7]] == 0.0)


@pytest.mark.parametrize(
  "name", ["row_norm_centered", "left_spectral", "hybrid_row_then_polar", "polar"]
)
def test_bfloat16_in_bfloat16_out(name):
  tx = RULES[name][0]
  g = rand(6, (U, F), np.float32)
  state = tx.init(jnp.asarray(g, jnp.bfloat16))
  chex.assert_trees_all_equal_dtypes(state.mu, jnp.zeros((), jnp.bfloat16))
  out = STEP[name](jnp.asarray(g, jnp.bfloat16))
  assert out.dtype == jnp.bfloat16
  close(out, STEP[name](jnp.asarray(g, jnp.bfloat16).astype(jnp.float32)), rtol=3e-2)


def test_unit_axis_and_momentum():
  """A (d, V) LM-head layout (units on axis 1) and two EMA steps."""
  tx = eqv.scale_by_row_norm(1, center=True, beta=0.9)
  g1, g2 = rand(7, (F, U), np.float32), rand(8, (F, U), np.float32)
  state = tx.init(g1)
  _, state = tx.update(g1, state)
  out, state = tx.update(g2, state)
  mu = 0.9 * (0.1 * g1) + 0.1 * g2
  close(state.mu, mu)
  close(out, center(row_norm(center(mu.T))).T)


def test_polar_nesterov_and_width_scale():
  tx = eqv.scale_by_polar(beta=0.9, **EXACT_NS)
  g1, g2 = rand(9, (4, 10), np.float32), rand(10, (4, 10), np.float32)
  _, state = tx.update(g1, tx.init(g1))
  out, _ = tx.update(g2, state)
  mu = 0.9 * (0.1 * g1) + 0.1 * g2
  close(out, np.sqrt(10 / 4) * polar(0.9 * mu + 0.1 * g2), rtol=1e-3)


# ------------------------------------------------------ heads, stacks, pairs


def test_polar_per_head_layouts():
  d, heads, hd = 8, 2, 4
  g = rand(11, (d, heads * hd), np.float32)
  per_head = np.concatenate([polar(g[:, h * hd : (h + 1) * hd]) for h in range(heads)], axis=1)
  for tx in (
    eqv.scale_by_polar(num_heads=heads, beta=0.0, **EXACT_NS),
    eqv.scale_by_polar(head_dim=hd, beta=0.0, **EXACT_NS),
  ):
    close(tx.update(g, tx.init(g))[0], per_head, rtol=1e-3)
  # The same kernel as a (d, H, hd) DenseGeneral: heads as a batch axis.
  tx = eqv.scale_by_polar(0, 2, 1, beta=0.0, **EXACT_NS)
  g3 = g.reshape(d, heads, hd)
  close(tx.update(g3, tx.init(g3))[0], per_head.reshape(d, heads, hd), rtol=1e-3)
  # An output kernel (H*hd, d): heads split the rows; scale sqrt(d / hd).
  tx = eqv.scale_by_polar(num_heads=heads, head_axis=-2, beta=0.0, **EXACT_NS)
  go = g.T
  expected = np.concatenate([polar(go[h * hd : (h + 1) * hd]) for h in range(heads)], axis=0)
  close(tx.update(go, tx.init(go))[0], np.sqrt(d / hd) * expected, rtol=1e-3)


def test_batch_axes_are_independent_copies():
  """Stacked layers of experts (L, E, in, out) and stacked LM heads (L, d, V)."""
  g = rand(12, (2, 3, 4, 6), np.float32)
  tx = eqv.scale_by_polar(batch_axes=(0, 1), beta=0.0, **EXACT_NS)
  out = np.asarray(tx.update(g, tx.init(g))[0])
  for layer in range(2):
    for e in range(3):
      close(out[layer, e], np.sqrt(6 / 4) * polar(g[layer, e]), rtol=1e-3)
  h = rand(13, (2, F, U), np.float32)
  tx = eqv.scale_by_right_spectral(eqv.UnitDimensionNumbers(-1, batch_axis=0), beta=0.0)
  out = np.asarray(tx.update(h, tx.init(h))[0])
  for layer in range(2):
    close(out[layer], right_spectral(h[layer].T).T, rtol=2e-4)


@pytest.mark.parametrize(
  "tx",
  [
    eqv.scale_by_polar(num_heads=2, beta=0.0, **EXACT_NS),
    eqv.scale_by_hybrid(1, beta=0.0, **EXACT_NS),
    eqv.scale_by_right_spectral(1, beta=0.0),
  ],
)
def test_same_sized_leaves_share_one_batched_call(tx):
  """Leaves whose matrices have one size run as one batch: the result is
  each leaf's own update."""
  tree = {
    f"layer_{i}": rand(40 + i, shape, np.float32)
    for i, shape in enumerate([(6, 8), (6, 8), (6, 8), (4, 8), (8, 6)])
  }
  out = tx.update(tree, tx.init(tree))[0]
  for name, g in tree.items():
    close(out[name], tx.update(g, tx.init(g))[0], rtol=1e-3)


SWIGLU = {
  "layers_0": {
    "mlp": {
      "gate_proj": {"kernel": rand(14, (F, U), np.float32)},
      "up_proj": {"kernel": rand(15, (F, U), np.float32)},
    }
  },
  "layers_1": {
    "mlp": {
      "gate_proj": {"kernel": rand(16, (F, U), np.float32)},
      "up_proj": {"kernel": rand(17, (F, U), np.float32)},
    }
  },
}
JOINT = ("gate_proj/kernel", "up_proj/kernel")


@pytest.mark.parametrize(
  "make, reference",
  [
    (eqv.scale_by_row_norm, row_norm),
    (eqv.scale_by_right_spectral, right_spectral),
  ],
)
def test_swiglu_gate_up_share_neurons(make, reference):
  """Units are hidden neurons; a neuron's vector is [gate column, up column]."""
  tx = make(-1, joint=JOINT, beta=0.0)
  out = tx.update(SWIGLU, tx.init(SWIGLU))[0]
  for layer in ("layers_0", "layers_1"):
    gate, up = (SWIGLU[layer]["mlp"][k]["kernel"] for k in ("gate_proj", "up_proj"))
    expected = reference(np.concatenate([gate.T, up.T], axis=1).astype(np.float64))
    close(out[layer]["mlp"]["gate_proj"]["kernel"], expected[:, :F].T)
    close(out[layer]["mlp"]["up_proj"]["kernel"], expected[:, F:].T)


def test_joint_errors_name_the_path():
  lonely = {"layers_0": {"mlp": {"gate_proj": {"kernel": np.zeros((F, U), np.float32)}}}}
  with pytest.raises(ValueError, match="layers_0/mlp/gate_proj/kernel"):
    eqv.scale_by_row_norm(-1, joint=JOINT).init(lonely)
  mismatched = {
    "mlp": {"gate_proj": {"kernel": np.zeros((F, U))}, "up_proj": {"kernel": np.zeros((F, U + 1))}}
  }
  with pytest.raises(ValueError, match="mlp/up_proj/kernel"):
    eqv.scale_by_row_norm(-1, joint=JOINT).init(mismatched)


@pytest.mark.parametrize(
  "name, kwargs, shape",
  [
    ("scale_by_row_norm", dict(unit_axis=0), (4,)),
    ("scale_by_right_spectral", dict(unit_axis=0), (4,)),
    ("scale_by_left_spectral", dict(unit_axis=0), (2, 3, 4)),
    ("scale_by_hybrid", dict(unit_axis=1), (2, 3, 4)),
    ("scale_by_polar", {}, (2, 3, 4)),
    ("scale_by_polar", dict(num_heads=3), (4, 8)),
  ],
)
def test_wrong_rank_or_layout_names_the_rule_and_path(name, kwargs, shape):
  """The error names the rule the user called, and the parameter."""
  with pytest.raises(ValueError, match=f"^{name}: parameter 'block/w' of shape"):
    getattr(eqv, name)(**kwargs).init({"block": {"w": np.zeros(shape)}})


# ------------------------------------------------------ Newton-Schulz numerics

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


NS_BF16 = jax.jit(eqv.newton_schulz, static_argnames=("coeffs", "steps"))
NS_F32 = jax.jit(
  functools.partial(eqv.newton_schulz, dtype=jnp.float32), static_argnames=("steps",)
)


def singular_values(x):
  return np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)


def test_polar_express_constants_are_the_published_ones():
  *early, last = PUBLISHED_POLAR_EXPRESS
  expected = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in early] + [last]
  np.testing.assert_allclose(np.array(eqv.POLAR_EXPRESS), np.array(expected), rtol=1e-13)


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
  assert np.all(np.asarray(eqv.newton_schulz(jnp.zeros((3, 16, 32)))) == 0.0)
  assert np.all(np.isfinite(np.asarray(eqv.newton_schulz(jnp.full((16, 32), 1e-30)))))


def test_newton_schulz_coefficient_forms():
  x = jnp.asarray(rand(20, (6, 9), np.float32))
  quintic = eqv.newton_schulz(x, "quintic")
  chex.assert_trees_all_close(eqv.newton_schulz(x, (3.4445, -4.7750, 2.0315)), quintic)
  chex.assert_trees_all_close(eqv.newton_schulz(x, [eqv.QUINTIC[0]] * 5), quintic)
  chex.assert_trees_all_close(eqv.newton_schulz(x), eqv.newton_schulz(x, eqv.POLAR_EXPRESS))
  with pytest.raises(ValueError, match="nope"):
    eqv.newton_schulz(x, "nope")


# ------------------------------------------------------------ routing, stack


def linen_params():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, ids):
      x = nn.Embed(U, 8, name="embed")(ids)
      part = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
      x = nn.Dense(8, name="q_proj", kernel_init=part)(x)
      return nn.LayerNorm(name="norm")(x)

  return Block().init(jax.random.key(0), jnp.zeros((1, 3), jnp.int32))


def nnx_state():
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(U, 8, rngs=rngs)
      self.q_proj = nnx.Linear(8, 8, rngs=rngs)
      self.norm = nnx.LayerNorm(8, rngs=rngs)

  return nnx.split(Block(nnx.Rngs(0)), nnx.Param)[1]


ROUTED = eqv.layerwise(
  {
    "embed/embedding": eqv.scale_by_row_norm(0, beta=0.0),
    ("q_proj/kernel",): eqv.scale_by_polar(num_heads=2, beta=0.0, **EXACT_NS),
  },
  default=optax.sgd(1.0),
)
ROUTED_STEP = jax.jit(lambda g: ROUTED.update(g, ROUTED.init(g))[0])


@pytest.mark.parametrize("make", [linen_params, nnx_state])
def test_layerwise_routes_flax_trees(make):
  grads = jax.tree.map(lambda x: x + 0.1, make())  # nonzero biases
  out = ROUTED_STEP(grads)
  chex.assert_trees_all_equal_structs(out, grads)
  flat = {path_str(k): v for k, v in jax.tree_util.tree_flatten_with_path(out)[0]}
  g = {path_str(k): v for k, v in jax.tree_util.tree_flatten_with_path(grads)[0]}
  emb = next(k for k in flat if k.endswith("embed/embedding"))
  q = next(k for k in flat if k.endswith("q_proj/kernel"))
  bias = next(k for k in flat if k.endswith("q_proj/bias"))
  close(flat[emb], row_norm(np.asarray(g[emb], np.float64)))
  wq = np.asarray(g[q], np.float64)
  close(flat[q], np.concatenate([polar(wq[:, :4]), polar(wq[:, 4:])], axis=1), rtol=1e-3)
  close(flat[bias], -np.asarray(g[bias]))  # default: sgd(1.0)


def test_layerwise_errors_name_the_path():
  params = {"params": {"q_proj": {"kernel": np.zeros((4, 4)), "bias": np.zeros(4)}}}
  double = eqv.layerwise({"q_proj/kernel": optax.sgd(1.0), "q_proj/*": optax.sgd(1.0)})
  with pytest.raises(ValueError, match="'params/q_proj/kernel' is matched by several"):
    double.init(params)
  wrong_rank = eqv.layerwise({"q_proj/*": eqv.scale_by_polar()})
  with pytest.raises(ValueError, match="params/q_proj/bias"):
    wrong_rank.init(params)
  no_default = eqv.layerwise([("q_proj/kernel", optax.sgd(1.0))])
  with pytest.raises(ValueError, match="params/q_proj/bias"):
    no_default.init(params)


def test_optimizer_decoupled_weight_decay_and_schedule():
  lr = optax.linear_schedule(0.1, 0.05, transition_steps=1)
  tx = eqv.optimizer(eqv.scale_by_row_norm(0, beta=0.0), lr, weight_decay=0.5)
  w = rand(21, (U, F), np.float32)
  g = rand(22, (U, F), np.float32)
  state = tx.init(w)
  for step_lr in (0.1, 0.05):
    u, state = tx.update(g, state, w)
    close(optax.apply_updates(w, u), w * (1 - step_lr * 0.5) - step_lr * row_norm(g))


H, KV, HD, D, FF, V, E = 2, 1, 4, 8, 6, 10, 3


def llama_grads(key, layers=None):
  """Gradients of a tiny LLaMA-style decoder with one MoE block, Flax layouts."""
  lead = () if layers is None else (layers,)
  shapes = {
    "embed/embedding": (V, D),
    "lm_head/kernel": (D, V),
    "norm/scale": (D,),
    "layers/attn/q_proj/kernel": lead + (D, H * HD),
    "layers/attn/k_proj/kernel": lead + (D, KV * HD),
    "layers/attn/v_proj/kernel": lead + (D, KV * HD),
    "layers/attn/o_proj/kernel": lead + (H * HD, D),
    "layers/mlp/gate_proj/kernel": lead + (D, FF),
    "layers/mlp/up_proj/kernel": lead + (D, FF),
    "layers/mlp/down_proj/kernel": lead + (FF, D),
    "layers/moe/router/kernel": lead + (D, E),
    "layers/moe/experts/w_in": lead + (E, D, FF),
    "layers/attn_norm/scale": lead + (D,),
  }
  tree = {}
  for i, (path, shape) in enumerate(shapes.items()):
    *parents, leaf = path.split("/")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = rand(key + i, shape, np.float32)
  return tree


def unit_rule(kind, x, centred=False):
  """A unit rule on (units, features) in numpy: row-norm, hybrid (row then
  polar, scaled by the nuclear norm; centred: re-centred before the polar
  step too) or left spectral."""
  p = center if centred else (lambda y: y)
  if kind == "row_norm":
    return p(row_norm(p(x)))
  if kind == "hybrid":
    r = p(row_norm(p(x)))
    return p(nuclear(r) * polar(r))
  assert kind == "left_spectral", kind
  return p(left_spectral(p(x)))


def expected_llama_directions(
  g, embedding="row_norm", lm_head="row_norm", mlp="row_norm", down="column", router="row_norm"
):
  """Lau and Su's stack by hand (beta=0): each role's direction, by path."""
  L = g["layers"]
  gu = np.concatenate([L["mlp"]["gate_proj"]["kernel"].T, L["mlp"]["up_proj"]["kernel"].T], axis=1)
  neurons = unit_rule(mlp, gu)
  per_head = lambda w, n, axis: np.concatenate(  # noqa: E731
    [polar(b) for b in np.split(w, n, axis=axis)], axis=axis
  )
  w_down = L["mlp"]["down_proj"]["kernel"]
  return {
    "embed/embedding": unit_rule(embedding, g["embed"]["embedding"]),
    "lm_head/kernel": unit_rule(lm_head, g["lm_head"]["kernel"].T, centred=True).T,
    "layers/attn/q_proj/kernel": per_head(L["attn"]["q_proj"]["kernel"], H, 1),
    "layers/attn/k_proj/kernel": per_head(L["attn"]["k_proj"]["kernel"], KV, 1),
    "layers/attn/v_proj/kernel": per_head(L["attn"]["v_proj"]["kernel"], KV, 1),
    "layers/attn/o_proj/kernel": np.sqrt(D / HD) * per_head(L["attn"]["o_proj"]["kernel"], H, 0),
    "layers/mlp/gate_proj/kernel": neurons[:, :D].T,
    "layers/mlp/up_proj/kernel": neurons[:, D:].T,
    "layers/mlp/down_proj/kernel": (
      unit_rule(mlp, w_down) if down == "column" else np.sqrt(D / FF) * polar(w_down)
    ),
    "layers/moe/router/kernel": unit_rule(router, L["moe"]["router"]["kernel"].T, centred=True).T,
    "layers/moe/experts/w_in": np.stack(
      [polar(w) for w in L["moe"]["experts"]["w_in"]]
    ),  # fan_out < fan_in: scale 1
  }


# Distinct rates and decays, one per-role override: each must reach its leaves.
LR, ADAMW_LR, WD, ADAMW_WD, OUTPUT_LR = 0.3, 0.05, 0.1, 0.2, 0.7
ADAMW_PATHS = ("norm/scale", "layers/attn_norm/scale")


@functools.cache
def stack_step(stacked, **variants):
  tx = eqv.symmetry_compatible(
    LR,
    adamw_learning_rate=ADAMW_LR,
    weight_decay=WD,
    adamw_weight_decay=ADAMW_WD,
    learning_rates={"output": OUTPUT_LR},
    num_heads=H,
    num_kv_heads=KV,
    stacked=stacked,
    beta=0.0,
    **EXACT_NS,
    **rules_and_rest(variants),
  )
  return jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])


def rules_and_rest(variants):
  """``symmetry_compatible``'s keywords for ``variants``: the role rules as a RoleRules."""
  rules = {k: v for k, v in variants.items() if k in eqv.RoleRules._fields}
  rest = {k: v for k, v in variants.items() if k not in eqv.RoleRules._fields}
  return dict(rules=eqv.RoleRules(**rules), **rest)


def flat_paths(tree):
  return {
    path_str(k): np.asarray(v, np.float64) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def check_llama_update(out, g, p, **variants):
  """u = -lr (direction + wd p) per role; AdamW's first step on the rest:
  -lr (g / (|g| + eps) + wd p) = -lr (sign(g) + wd p)."""
  directions = expected_llama_directions(jax.tree.map(np.float64, g), **variants)
  out, g, p = flat_paths(out), flat_paths(g), flat_paths(p)
  assert set(directions) | set(ADAMW_PATHS) == set(out)
  for path, direction in directions.items():
    lr = OUTPUT_LR if path == "layers/attn/o_proj/kernel" else LR
    close(out[path], -lr * (direction + WD * p[path]), rtol=1e-3)
  for path in ADAMW_PATHS:
    close(out[path], -ADAMW_LR * (np.sign(g[path]) + ADAMW_WD * p[path]), rtol=1e-5)


def test_symmetry_compatible_stack():
  g, p = llama_grads(100), llama_grads(600)
  out = stack_step(False)(g, p)
  check_llama_update(out, g, p)
  # The stacked-layers layout gives every layer the update of the unstacked one.
  gs, ps = [g, llama_grads(200)], [p, llama_grads(700)]
  stack = lambda trees: {
    **trees[0],
    "layers": jax.tree.map(  # noqa: E731
      lambda *x: np.stack(x), *[t["layers"] for t in trees]
    ),
  }
  stacked = stack_step(True)(stack(gs), stack(ps))
  for i, single in enumerate([out, stack_step(False)(gs[1], ps[1])]):
    chex.assert_trees_all_close(
      jax.tree.map(lambda x, i=i: x[i], stacked["layers"]), single["layers"], rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize(
  "variants",
  [
    dict(
      embedding="hybrid",
      lm_head="hybrid",
      mlp="hybrid",
      down="polar",
      router="left_spectral",
      head_dim=HD,
    ),
    dict(mlp="hybrid"),  # a column-aware hybrid down
  ],
)
def test_symmetry_compatible_variants(variants):
  """Each option builds the rule it names, checked against numpy."""
  g, p = llama_grads(400), llama_grads(800)
  check_llama_update(
    stack_step(False, **variants)(g, p),
    g,
    p,
    **{k: v for k, v in variants.items() if k != "head_dim"},
  )


def test_symmetry_compatible_tied_and_errors():
  tied = eqv.symmetry_compatible(1.0, tie_embeddings=True, beta=0.0)
  g = {"embed": {"embedding": rand(300, (V, D), np.float32)}}
  out = tied.update(g, tied.init(g), g)[0]["embed"]["embedding"]
  close(-out, center(row_norm(center(g["embed"]["embedding"]))))
  with pytest.raises(ValueError, match=r"Unknown roles \['bogus'\]"):
    eqv.symmetry_compatible(1.0, patterns={"bogus": "x"})
  with pytest.raises(ValueError, match="down must be 'column' or 'polar', got 'rows'"):
    eqv.symmetry_compatible(1.0, rules=eqv.RoleRules(down="rows"))  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize(
  "variants",
  [
    {},
    dict(embedding="hybrid", lm_head="hybrid", mlp="hybrid", down="polar", router="left_spectral"),
  ],
)
def test_stack_defaults_on_zero_gradients(variants):
  """The default Newton-Schulz (bfloat16 Polar Express, 5 steps): zero
  gradients give a zero update, never a NaN, from a fresh state and after
  steps with gradients whose squares underflow float32."""
  tx = eqv.symmetry_compatible(0.1, num_heads=H, num_kv_heads=KV, **rules_and_rest(variants))
  zeros = jax.tree.map(np.zeros_like, llama_grads(500))
  tiny = jax.tree.map(lambda x: 1e-30 * x, llama_grads(500))
  step = jax.jit(lambda g, state: tx.update(g, state, zeros))
  out, state = step(zeros, tx.init(zeros))
  assert all(np.all(np.asarray(x) == 0.0) for x in jax.tree.leaves(out))
  for grads in (tiny, zeros):
    out, state = step(grads, state)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(out))


# --------------------------------------------- Gram Newton-Schulz, inverse root

NS_GRAM = jax.jit(
  functools.partial(eqv.newton_schulz, gram=True), static_argnames=("coeffs", "steps", "dtype")
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


def test_polar_rule_with_gram_newton_schulz():
  g = rand(31, (8, 3 * 16), np.float32)  # three (8, 16) heads
  tx, gram_tx = (
    eqv.scale_by_polar(
      num_heads=3, beta=0.0, newton_schulz=EXACT_NS["newton_schulz"]._replace(gram=flag)
    )
    for flag in (False, True)
  )
  close(gram_tx.update(g, gram_tx.init(g))[0], tx.update(g, tx.init(g))[0], rtol=1e-4)


def test_iterative_inverse_square_root():
  """The coupled iteration behind Lau & Su's spectral rules reaches the exact
  (C + d I)^(-1/2) given steps (12 here, condition number 1e2); at their 5
  steps it is within 20% of it."""
  q = orthogonal(32, 6)
  c = (q * np.logspace(0, -2, 6)) @ q.T
  lam, v = np.linalg.eigh(c + 1e-3 * np.eye(6))
  exact = (v / np.sqrt(lam)) @ v.T
  inv_sqrt = eqv._linalg.inv_sqrt
  for steps, tol in ((12, 1e-4), (5, 0.2)):
    out = np.asarray(
      inv_sqrt(jnp.asarray(c, jnp.float32), 1e-3, "polar_express_1.05", steps), np.float64
    )
    assert np.linalg.norm(out - exact) <= tol * np.linalg.norm(exact), (
      steps,
      np.linalg.norm(out - exact),
    )
