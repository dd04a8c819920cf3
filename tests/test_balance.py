"""Multi-tensor symmetries (a side of several tensors) and jointly balanced overlapping pairs.

Oracles are NumPy: side norms taken by hand over all tensors of a side, the
closed-form factor, hand-written moment transport, and for overlaps a float64
Newton solve of the convex objective ``sum_leaves ||T_u(leaf)||^2`` in the
log-factors ``u``.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import models
import saggs_jax as saggs

RNG = np.random.default_rng(0)
GAIN = saggs.Pair("g", ("q", "k", "v"), axes=(0, 0), name="gain")


def _small():
  rng = np.random.default_rng(1)
  return {
    "g": jnp.asarray(1 + rng.random(4), jnp.float32),
    **{
      n: jnp.asarray(rng.standard_normal((4, 6)) * s, jnp.float32)
      for n, s in (("q", 3.0), ("k", 0.5), ("v", 1.0))
    },
    "o": jnp.asarray(rng.standard_normal((6, 4)), jnp.float32),
  }


def _np(tree):
  return {k: np.asarray(v, np.float64) for k, v in tree.items()}


def test_multi_tensor_side_factor_against_numpy():
  """c_i = (||B_i|| / ||A_i||)^(1/2), ||B_i||^2 summing row i of q, k and v; soft: c^strength."""
  p = _np(_small())
  norm_b = np.sqrt(sum((p[n] ** 2).sum(1) for n in "qkv"))
  c = np.sqrt(norm_b / np.abs(p["g"]))
  balanced, _ = saggs.canonicalize(_small(), None, [GAIN])
  np.testing.assert_allclose(balanced["g"], p["g"] * c, rtol=2e-6)
  for n in "qkv":
    np.testing.assert_allclose(balanced[n], p[n] / c[:, None], rtol=2e-6)
  np.testing.assert_array_equal(balanced["o"], p["o"].astype(np.float32))  # not declared

  tx = saggs.chain(optax.sgd(0.0), saggs.soft([GAIN], strength=0.25))
  params = _small()
  updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  np.testing.assert_allclose(state[1].factors["g|q+k+v"], c**0.25, rtol=2e-6)
  np.testing.assert_allclose(
    optax.apply_updates(params, updates)["q"], p["q"] / c[:, None] ** 0.25, rtol=2e-6
  )


def test_axes_per_pattern_and_moments_transported_by_hand():
  """axes=(0, (0, 1)): o is grouped along its axis 1; mu moves by 1/c on A, c on B, nu by squares."""
  pair = saggs.Pair("g", ("q", "o"), axes=(0, (0, 1)))
  params = _small()
  opt = optax.adam(1e-2)
  grads = jax.tree.map(lambda x: jnp.asarray(RNG.standard_normal(x.shape), x.dtype), params)
  _, state = opt.update(grads, opt.init(params), params)
  c = np.exp(RNG.uniform(-1, 1, 4))
  new_p, new_s = saggs.reparameterize(params, state, [pair], lambda path, shape: c)
  p, mu, nu = _np(params), _np(state[0].mu), _np(state[0].nu)
  expect = {"g": (c, 1), "q": (c[:, None], 1), "o": (c[None, :], 1)}  # B side divides
  for name, (f, _) in expect.items():
    sign = 1 if name == "g" else -1
    np.testing.assert_allclose(new_p[name], p[name] * f**sign, rtol=2e-6)
    np.testing.assert_allclose(new_s[0].mu[name], mu[name] * f**-sign, rtol=2e-6)
    np.testing.assert_allclose(new_s[0].nu[name], nu[name] * f ** (-2 * sign), rtol=2e-6)
  for name in "kv":
    np.testing.assert_array_equal(new_p[name], params[name])


@pytest.mark.parametrize(
  "pair, msg",
  [
    (
      saggs.Pair("g", ("q", "o"), axes=(0, 0)),
      "group axes differ in size ('g' (4,), 'q' (4, 6), 'o' (6, 4))",
    ),
    (saggs.Pair("g", ("q", "nope"), axes=(0, 0)), "pattern 'nope' matches no parameter path"),
  ],
)
def test_malformed_multi_tensor_declarations(pair, msg):
  with pytest.raises(ValueError, match=re.escape(msg)):
    saggs.describe(_small(), [pair])


@pytest.mark.parametrize(
  "kwargs, msg",
  [
    (dict(axes=(0, (0, 1, 0))), "axes must be None or a pair of ints (axis_a, axis_b), got"),
    (dict(axes=((0,), 0)), "axes must be None or a pair of ints"),  # one pattern: an int
    (
      dict(b=("q", "layers/*/k"), axes=(0, 0)),
      "pattern 'layers/*/k' has a different number of wildcards than 'g'",
    ),
    (dict(b=()), "side b needs at least one pattern"),
  ],
)
def test_malformed_multi_tensor_pair(kwargs, msg):
  kwargs = {"a": "g", "b": ("q", "k"), **kwargs}
  with pytest.raises(ValueError, match=re.escape(msg)):
    saggs.Pair(**kwargs)


def test_missing_partner_in_one_pattern_is_named():
  params = {"layers": {str(i): {"g": jnp.ones(4), "q": jnp.ones((4, 2))} for i in range(2)}}
  params["layers"]["1"]["k"] = jnp.ones((4, 2))
  params["layers"]["0"]["x"] = jnp.ones(1)
  pair = saggs.Pair("layers/*/g", ("layers/*/q", "layers/*/k"), axes=(0, 0))
  with pytest.raises(
    ValueError, match=re.escape("'layers/0/g' (matched by a) has no partner matching 'layers/*/k'")
  ):
    saggs.describe(params, [pair])


def _newton_oracle(leaves, slots, shapes, iters=60):
  """float64 minimiser of sum_leaf sum_e x_e^2 exp(2 sum_s sign_s u_s[index_s(e)]).

  ``slots[leaf]``: list of (name, sign, index) with ``index(entry) -> flat factor index``;
  ``shapes[name]``: that factor's shape. Newton's method with a backtracking line search.
  """
  names = list(shapes)
  offsets = np.cumsum([0] + [int(np.prod(shapes[n])) for n in names])

  def design(leaf):
    """Per entry of ``leaf``, the row of signs on the flat log-factor vector."""
    x = leaves[leaf]
    rows = np.zeros(x.shape + (offsets[-1],))
    for name, sign, index in slots[leaf]:
      for idx in np.ndindex(x.shape):
        rows[idx + (offsets[names.index(name)] + index(idx),)] += sign
    return x.reshape(-1) ** 2, rows.reshape(-1, offsets[-1])

  terms = [design(leaf) for leaf in leaves]

  def f(u):
    return sum(np.sum(w * np.exp(2 * a @ u)) for w, a in terms)

  u = np.zeros(offsets[-1])
  for _ in range(iters):
    grad = sum(a.T @ (2 * w * np.exp(2 * a @ u)) for w, a in terms)
    hess = sum(a.T @ (a * (4 * w * np.exp(2 * a @ u))[:, None]) for w, a in terms)
    step = np.linalg.lstsq(hess, -grad, rcond=None)[0]
    t = 1.0
    while f(u + t * step) > f(u) + 0.25 * t * grad @ step and t > 1e-8:
      t /= 2
    u = u + t * step
  return {n: u[offsets[i] : offsets[i + 1]].reshape(shapes[n]) for i, n in enumerate(names)}


def _whole(idx):
  return 0


def _star(seed):
  """q/k, v/k, o/k on whole (3, 5) tensors of unequal scales, k shared by all three, and the
  NumPy Newton oracle's joint log-factors."""
  rng = np.random.default_rng(seed)
  params = {
    n: jnp.asarray(rng.standard_normal((3, 5)) * s, jnp.float32)
    for n, s in (("q", 4.0), ("k", 0.2), ("v", 1.0), ("o", 9.0))
  }
  pairs = [saggs.Pair("q", "k"), saggs.Pair("v", "k"), saggs.Pair("o", "k")]
  u = _newton_oracle(
    _np(params),
    {
      "q": [("q", 1, _whole)],
      "v": [("v", 1, _whole)],
      "o": [("o", 1, _whole)],
      "k": [(n, -1, _whole) for n in "qvo"],
    },
    {n: () for n in "qvo"},
  )
  return params, pairs, u


def test_three_pairs_sharing_one_leaf_balance_jointly():
  """q/k, v/k, o/k (whole tensors), k shared: one canonicalize reaches the joint minimum
  (the NumPy Newton oracle), every pair is balanced and a second one changes nothing.
  Applied pair by pair, the factors would oscillate instead."""
  params, pairs, u = _star(3)
  balanced, _ = saggs.canonicalize(params, None, pairs)
  p = _np(params)
  for n in "qvo":
    np.testing.assert_allclose(balanced[n], p[n] * np.exp(u[n]), rtol=1e-5)
  np.testing.assert_allclose(balanced["k"], p["k"] * np.exp(-sum(u.values())), rtol=1e-5)
  for v in saggs.imbalance(balanced, pairs).values():
    assert abs(float(v)) <= 1e-5
  again, _ = saggs.canonicalize(balanced, None, pairs)
  for n in params:
    np.testing.assert_allclose(again[n], balanced[n], rtol=1e-5)


@pytest.mark.parametrize("strength", [0.3, 0.7])
def test_soft_with_overlaps_takes_strength_of_the_joint_log_factors(strength):
  """Soft balancing of overlapping pairs moves ``strength`` of the way to the joint minimum in
  log space: factors ``exp(strength * u)``, ``u`` the NumPy Newton oracle's, i.e. the hard
  factors to the power ``strength`` (each pair's own closed form would not be)."""
  params, pairs, u = _star(5)
  tx = saggs.chain(optax.sgd(0.0), saggs.soft(pairs, strength=strength))
  updates, state = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  for n in "qvo":
    np.testing.assert_allclose(state[1].factors[f"{n}|k"], np.exp(strength * u[n]), rtol=1e-5)
  moved = optax.apply_updates(params, updates)
  p = _np(params)
  for n in "qvo":
    np.testing.assert_allclose(moved[n], p[n] * np.exp(strength * u[n]), rtol=1e-5)
  np.testing.assert_allclose(moved["k"], p["k"] * np.exp(-strength * sum(u.values())), rtol=1e-5)


def test_norm_gain_shared_by_stacked_experts_against_newton():
  """A gain g (d,) read by every expert's w_up (E, d, F), overlapping the per-expert
  up/down pair (stacked=1): the gain's factor spans the expert axis."""
  rng = np.random.default_rng(4)
  params = {
    "g": jnp.asarray(1 + rng.random(4), jnp.float32),
    "w_up": jnp.asarray(rng.standard_normal((3, 4, 5)) * 3, jnp.float32),
    "w_down": jnp.asarray(rng.standard_normal((3, 5, 4)) / 3, jnp.float32),
  }
  pairs = [
    saggs.Pair("g", "w_up", axes=(0, 1), name="gain"),
    saggs.Pair("w_up", "w_down", axes=(1, 0), stacked=1, name="experts"),
  ]
  u = _newton_oracle(
    _np(params),
    {
      "g": [("gain", 1, lambda i: i[0])],
      "w_up": [("gain", -1, lambda i: i[1]), ("experts", 1, lambda i: i[0] * 5 + i[2])],
      "w_down": [("experts", -1, lambda i: i[0] * 5 + i[1])],
    },
    {"gain": (4,), "experts": (3, 5)},
  )
  balanced, _ = saggs.canonicalize(params, None, pairs)
  p = _np(params)
  np.testing.assert_allclose(balanced["g"], p["g"] * np.exp(u["gain"]), rtol=1e-5)
  np.testing.assert_allclose(
    balanced["w_up"],
    p["w_up"] * np.exp(u["experts"][:, None, :] - u["gain"][None, :, None]),
    rtol=1e-5,
  )
  np.testing.assert_allclose(
    balanced["w_down"], p["w_down"] * np.exp(-u["experts"])[:, :, None], rtol=1e-5
  )


# The tiny LLaMA with its norm gains: every gain against the input rows of the linears
# reading its output, overlapping the Q/K, V/O and up/down pairs on q, k, v, gate and up.
GAINS = [
  saggs.Pair(
    "attn_norm/scale",
    ("attn/q_proj/kernel", "attn/k_proj/kernel", "attn/v_proj/kernel"),
    axes=(0, 0),
    name="attention norm gain",
  ),
  saggs.Pair(
    "mlp_norm/scale",
    ("mlp/gate_proj/kernel", "mlp/up_proj/kernel"),
    axes=(0, 0),
    name="MLP norm gain",
  ),
  saggs.Pair("final_norm/scale", "lm_head/kernel", axes=(0, 0), name="final norm gain"),
]
PAIRS = models.llama_pairs() + GAINS
X = models.tokens(0)
# One compiled canonicalize of the per-layer LLaMA params, shared by every test below.
_canon_llama = jax.jit(lambda p: saggs.canonicalize(p, None, PAIRS)[0])


def _side_norms_numpy(params, pairs):
  """log(||A_g|| / ||B_g||) per instance, from NumPy norms over every tensor of each side."""
  flat = dict(saggs._src.paths.leaves_with_paths(params))
  out = {}
  for inst in saggs._src.plan.resolve(pairs, params).instances:
    stacked = inst.pair.stacked
    sq = []
    for side, members in enumerate((inst.members_a, inst.members_b)):
      total = 0
      for path, axis in zip(members, inst.pair.side_axes(side)):
        x = np.asarray(flat[path], np.float64) ** 2
        x = np.moveaxis(x, stacked + axis % (x.ndim - stacked), -1)
        x = x.sum(axis=tuple(range(stacked, x.ndim - 1)))  # stacked + (size,)
        total = total + x.reshape(x.shape[:-1] + (inst.factor_shape[-1], -1)).sum(-1)
      sq.append(total)
    out[inst.key] = 0.5 * np.log(sq[0] / sq[1])
  return out


def test_llama_with_norm_gains_is_balanced_minimal_and_orbit_invariant():
  params = models.perturb(models.llama_init(0), PAIRS, seed=5)
  saggs.check_symmetry(models.llama_forward, params, PAIRS, X)
  canon = _canon_llama
  balanced = canon(params)
  # Same function.
  np.testing.assert_allclose(
    models.llama_apply(balanced, X), models.llama_apply(params, X), atol=2e-5
  )
  # Every declared symmetry balanced (NumPy norms over all tensors of each side).
  for key, imb in _side_norms_numpy(balanced, PAIRS).items():
    assert np.max(np.abs(imb)) <= 2e-5, key
  # Idempotent, and the same canonical point from anywhere on the orbit.
  again = canon(balanced)
  elsewhere = canon(models.perturb(params, PAIRS, seed=6))
  for a, b, c in zip(jax.tree.leaves(balanced), jax.tree.leaves(again), jax.tree.leaves(elsewhere)):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(c, a, rtol=1e-4, atol=1e-6)
  # A minimum: any small move along the orbit only adds squared norm.
  plan = saggs._src.plan.resolve(PAIRS, params)

  def total(p):
    return sum(
      float(np.sum(np.asarray(x, np.float64) ** 2))
      for path, x in saggs._src.paths.leaves_with_paths(p)
      if path in plan.counted
    )

  for seed in range(3):
    assert total(models.perturb(balanced, PAIRS, seed=seed, low=0.97, high=1.03)) > total(balanced)


def test_stacked_layers_with_norm_gains():
  c = models.STACKED
  pairs = models.llama_pairs(c) + [
    saggs.Pair(g.a, g.b, axes=g.axes, stacked=0 if g.a.startswith("final") else 1) for g in GAINS
  ]
  params = models.perturb(models.llama_init(0, c), pairs, seed=7)
  balanced = jax.jit(lambda p: saggs.canonicalize(p, None, pairs)[0])(params)  # one program
  np.testing.assert_allclose(
    models.llama_apply(balanced, X, c=c), models.llama_apply(params, X, c=c), atol=2e-5
  )
  for key, imb in _side_norms_numpy(balanced, pairs).items():
    assert imb.shape[:1] == ((c.num_layers,) if key.startswith("layers") else (16,))
    assert np.max(np.abs(imb)) <= 2e-5, key


BATCHES = models.batches(2, 8)


def test_equivalent_states_follow_one_trajectory_with_overlaps():
  """Hard SAGGS every=1 over overlapping pairs: two equivalent AdamW states agree after every
  step with no canonicalize; AdamW alone ends on different orbits."""
  tx = saggs.chain(optax.adamw(3e-3, weight_decay=0.1), saggs.saggs(PAIRS))
  p0 = models.llama_init(1)
  factors = models.orbit_factors(p0, PAIRS, seed=8, low=0.3, high=3.0)
  p1, _ = models.reparam(p0, None, PAIRS, factors)

  def run(opt, p):  # one compile per optimizer, shared by p0 and p1
    return models.train_scan(opt, p, BATCHES)

  def rel(a, b):
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)]) for t in (a, b))
    return np.linalg.norm(a - b) / np.linalg.norm(b)

  assert rel(run(tx, p0), run(tx, p1)) <= 1e-4
  inner = optax.adamw(3e-3, weight_decay=0.1)
  ends = [_canon_llama(run(inner, p)) for p in (p0, p1)]
  assert rel(*ends) > 1e-3


def test_checkpoint_restores_onto_the_joint_canonical_point(tmp_path):
  params = models.perturb(models.llama_init(2), PAIRS, seed=9)
  tx = saggs.chain(optax.adam(1e-3), saggs.saggs(PAIRS, every=100))
  state = tx.init(params)
  with ocp.CheckpointManager(tmp_path) as manager:
    saggs.checkpoint.save(manager, 3, params, state)
    manager.wait_until_finished()
    restored, _, step = saggs.checkpoint.restore(manager, params, state, PAIRS, tx=tx)
  assert step == 3
  expect = _canon_llama(params)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(expect)):
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_check_symmetry_rejects_a_gain_missing_one_reader():
  """The attention gain against q and k only (v left out) is not a symmetry."""
  params = models.llama_init(0)
  wrong = saggs.Pair(
    "attn_norm/scale",
    ("attn/q_proj/kernel", "attn/k_proj/kernel"),
    axes=(0, 0),
    name="partial gain",
  )
  with pytest.raises(
    ValueError,
    match=re.escape(
      "partial gain is not a symmetry of the model: rescaling 'layers/0/attn_norm/scale' by c and"
      " 'layers/0/attn/q_proj/kernel' and 'layers/0/attn/k_proj/kernel' by 1/c"
    ),
  ):
    saggs.check_symmetry(models.llama_forward, params, [wrong], X)


def test_describe_lists_every_tensor_and_the_shared_leaves():
  text = saggs.describe(models.llama_init(0), PAIRS)
  assert "attention norm gain  b     layers/0/attn/v_proj/kernel" in text
  assert re.search(r"In several pairs, so balanced jointly: .*layers/0/attn/q_proj/kernel", text)


def _relu_chain(depth, width=6, jump=20, seed=11):
  """A ReLU MLP ``x -> w_{n-1} ... relu(w_1 relu(w_0 x))`` (kernels (in, out)), layer
  ``jump`` 100x larger; each hidden channel of w_i pairs with the same row of w_{i+1}."""
  rng = np.random.default_rng(seed)
  params = {
    f"w{i:02d}": jnp.asarray(
      rng.standard_normal((width, width)) / np.sqrt(width) * (100.0 if i == jump else 1.0),
      jnp.float32,
    )
    for i in range(depth)
  }
  pairs = [saggs.Pair(f"w{i:02d}", f"w{i + 1:02d}", axes=(1, 0)) for i in range(depth - 1)]
  return params, pairs


def _chain_forward_numpy(params, x):
  ws = [np.asarray(params[k], np.float64) for k in sorted(params)]
  for w in ws[:-1]:
    x = np.maximum(x @ w, 0)
  return x @ ws[-1]


def _chain_log_ratios_numpy(params):
  """log(||column j of w_i|| / ||row j of w_{i+1}||) for every pair of consecutive layers."""
  ws = [np.asarray(params[k], np.float64) for k in sorted(params)]
  return np.stack(
    [np.log(np.linalg.norm(a, axis=0) / np.linalg.norm(b, axis=1)) for a, b in zip(ws[:-1], ws[1:])]
  )


def test_deep_relu_chain_converges_and_is_idempotent():
  """40 layers, one x100: sweeps of closed-form steps alone stop at their cap with
  |log ratio| ~1e-3 here (they need sweeps growing with depth squared); the Newton steps
  reach the joint minimum. Oracle: NumPy norms, the NumPy forward pass, and a second
  canonicalize."""
  params, pairs = _relu_chain(40)
  canon = jax.jit(lambda p: saggs.canonicalize(p, None, pairs)[0])
  balanced = canon(params)
  assert np.max(np.abs(_chain_log_ratios_numpy(params))) > 1  # far from balanced at first
  assert np.max(np.abs(_chain_log_ratios_numpy(balanced))) <= 1e-4
  x = np.random.default_rng(12).standard_normal((5, 6))
  want = _chain_forward_numpy(params, x)
  np.testing.assert_allclose(
    _chain_forward_numpy(balanced, x), want, atol=1e-4 * np.max(np.abs(want))
  )
  again = canon(balanced)
  for k in params:
    b = np.asarray(balanced[k], np.float64)
    assert np.max(np.abs(np.asarray(again[k], np.float64) - b)) <= 1e-4 * np.max(np.abs(b)), k


def test_joint_solve_stopped_at_its_cap_is_reported(monkeypatch, tmp_path):
  """One round without its Newton step (a single sweep) does not balance a chain with a
  x100 layer: canonicalize warns (eagerly and under jit), so does a canonicalising restore,
  and SaggsState.residual says so. With the caps as they are the residual is within
  tolerance."""
  params, pairs = _relu_chain(6, jump=3)
  zeros = jax.tree.map(jnp.zeros_like, params)

  def residual():  # a new transformation, traced afresh with the caps of the moment
    tx = saggs.chain(optax.sgd(0.0), saggs.saggs(pairs))
    return float(jax.jit(tx.update)(zeros, tx.init(params), params)[1][1].residual)

  assert residual() <= saggs._src.balance.TOLERANCE
  monkeypatch.setattr(saggs._src.balance, "MAX_ITERATIONS", 1)
  monkeypatch.setattr(saggs._src.balance, "MAX_CG", 0)
  assert residual() > 1e-3
  with pytest.warns(RuntimeWarning, match="stopped at its iteration cap"):
    saggs.canonicalize(params, None, pairs)
  with pytest.warns(RuntimeWarning, match="stopped at its iteration cap"):
    jax.block_until_ready(jax.jit(lambda p: saggs.canonicalize(p, None, pairs)[0])(params))
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    saggs.checkpoint.save(manager, 1, params, None)
    with pytest.warns(RuntimeWarning, match="stopped at its iteration cap"):
      saggs.checkpoint.restore(manager, params, None, pairs)
