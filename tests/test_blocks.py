"""Blocks of a fused leaf, through every part of the library, against NumPy oracles.

Two tiny models in plain JAX: GPT-2 (Hugging Face Flax names and layout: FlaxConv1D
kernels are (out, in)) with q|k|v fused in the rows of ``c_attn`` (3d, d) and its bias,
and a gemma-style one with K and V stacked on a
leading axis of ``kv_einsum/w`` (2, KV, d, hd) and gate and up on one of
``gating_einsum/w`` (2, d, f). The oracle is the orbit move written out by hand:
which columns, rows or slices each factor multiplies.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import models
import saggs_jax as saggs
from saggs_jax._src import paths

# ---------------------------------------------------------------------------
# Tiny GPT-2: 2 layers, d=8, 2 heads of 4, LayerNorms, GELU MLP, tied embeddings.

D, HEADS, HD, LAYERS, VOCAB, T = 8, 2, 4, 2, 11, 5
GPT2_PAIRS = saggs.presets.gpt2(num_heads=HEADS)


def gpt2_init(seed=0):
  rng = np.random.default_rng(seed)

  def w(*shape, scale=0.5):
    return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)

  def ln():
    return {"scale": 1 + w(D, scale=0.3), "bias": w(D, scale=0.3)}

  layer = lambda: {  # noqa: E731
    "ln_1": ln(),
    "attn": {
      "c_attn": {"kernel": w(3 * D, D), "bias": w(3 * D)},  # (out, in)
      "c_proj": {"kernel": w(D, D), "bias": w(D)},
    },
    "ln_2": ln(),
    "mlp": {
      "c_fc": {"kernel": w(4 * D, D), "bias": w(4 * D)},
      "c_proj": {"kernel": w(D, 4 * D), "bias": w(D)},
    },
  }
  return {
    "transformer": {
      "wte": w(VOCAB, D),
      "wpe": w(T, D),
      "ln_f": ln(),
      "h": {str(i): layer() for i in range(LAYERS)},
    }
  }


def _layer_norm(x, p):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + 1e-5) * p["scale"] + p["bias"]


def gpt2_forward(params, ids):
  t = params["transformer"]
  x = t["wte"][ids] + t["wpe"][: ids.shape[-1]]
  causal = jnp.tril(jnp.ones((ids.shape[-1],) * 2, bool))
  for i in range(LAYERS):
    p = t["h"][str(i)]
    h = _layer_norm(x, p["ln_1"])
    qkv = h @ p["attn"]["c_attn"]["kernel"].T + p["attn"]["c_attn"]["bias"]
    q, k, v = (a.reshape(a.shape[:-1] + (HEADS, HD)) for a in jnp.split(qkv, 3, axis=-1))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HD)
    a = jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(x.shape)
    x = x + o @ p["attn"]["c_proj"]["kernel"].T + p["attn"]["c_proj"]["bias"]
    h = _layer_norm(x, p["ln_2"])
    h = jax.nn.gelu(h @ p["mlp"]["c_fc"]["kernel"].T + p["mlp"]["c_fc"]["bias"])
    x = x + h @ p["mlp"]["c_proj"]["kernel"].T + p["mlp"]["c_proj"]["bias"]
  return _layer_norm(x, t["ln_f"]) @ t["wte"].T


IDS = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, T)))
gpt2_logits = jax.jit(gpt2_forward)


def gpt2_instance(layer, which):
  """The name the library gives pair instance ``which`` of ``layer`` (its first member)."""
  base = f"transformer/h/{layer}"
  return {
    "qk": f"{base}/attn/c_attn/kernel[q]",
    "vo": f"{base}/attn/c_attn/kernel[v]",
    "ln_1": f"{base}/ln_1/scale",
    "ln_2": f"{base}/ln_2/scale",
  }[which]


def gpt2_move(tree, factors, power):
  """The orbit move by hand: every leaf of ``tree`` (laid out as the GPT-2 parameters) times
  its multiplier ``** power``; ``factors`` maps ``gpt2_instance`` names to factors."""
  out = jax.tree.map(lambda x: np.array(x, np.float64), tree)
  for i in range(LAYERS):
    p = out["transformer"]["h"][str(i)]
    qk, vo, ln1, ln2 = (
      np.asarray(factors[gpt2_instance(i, w)], np.float64) ** power
      for w in ("qk", "vo", "ln_1", "ln_2")
    )
    rows = np.concatenate([np.repeat(qk, HD), 1 / np.repeat(qk, HD), np.repeat(vo, HD)])
    p["attn"]["c_attn"]["kernel"] *= rows[:, None] / ln1[None, :]  # outputs by heads, inputs
    p["attn"]["c_attn"]["bias"] *= rows
    p["attn"]["c_proj"]["kernel"] /= np.repeat(vo, HD)[None, :]  # its input columns
    for leaf in ("scale", "bias"):
      p["ln_1"][leaf] *= ln1
      p["ln_2"][leaf] *= ln2
    p["mlp"]["c_fc"]["kernel"] /= ln2[None, :]
  return out


def random_factors(seed, low=0.3, high=3.0):
  """A ``factor`` callable drawing random factors per instance, and what it drew."""
  rng, drawn = np.random.default_rng(seed), {}
  return (lambda a, shape: drawn.setdefault(a, rng.uniform(low, high, shape))), drawn


def gpt2_norms(params):
  """NumPy: per instance and group, the norms of side A and side B."""
  out = {}
  for i in range(LAYERS):
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params["transformer"]["h"][str(i)])
    w = p["attn"]["c_attn"]["kernel"]  # (3D, D): q, k, v rows
    heads = lambda m: np.sqrt((m.reshape(HEADS, HD, -1) ** 2).sum((1, 2)))  # noqa: E731
    out[gpt2_instance(i, "qk")] = heads(w[:D]), heads(w[D : 2 * D])
    out[gpt2_instance(i, "vo")] = (
      heads(w[2 * D :]),
      heads(p["attn"]["c_proj"]["kernel"].T),
    )  # input columns
    out[gpt2_instance(i, "ln_1")] = np.abs(p["ln_1"]["scale"]), np.sqrt((w**2).sum(0))
    out[gpt2_instance(i, "ln_2")] = (
      np.abs(p["ln_2"]["scale"]),
      np.sqrt((p["mlp"]["c_fc"]["kernel"] ** 2).sum(0)),
    )
  return out


def imbalanced_gpt2(seed=0):
  """GPT-2 parameters with q scaled by 8 and k by 1/8, v by 8 and c_proj by 1/8, by hand."""
  params = gpt2_init(seed)
  for i in range(LAYERS):
    p = params["transformer"]["h"][str(i)]["attn"]
    scale = jnp.concatenate([jnp.full(D, 8.0), jnp.full(D, 1 / 8), jnp.full(D, 8.0)])
    p["c_attn"] = {
      "kernel": p["c_attn"]["kernel"] * scale[:, None],
      "bias": p["c_attn"]["bias"] * scale,
    }
    p["c_proj"] = dict(p["c_proj"], kernel=p["c_proj"]["kernel"] / 8)
  return params


def assert_tree_close(got, want, **tol):
  for (path, g), w in zip(paths.leaves_with_paths(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g, np.float64), w, err_msg=path, **tol)


# ---------------------------------------------------------------------------
# GPT-2


def test_reparameterize_moves_blocks_by_hand_and_keeps_the_function():
  params = gpt2_init(0)
  factor, drawn = random_factors(1)
  moved, _ = saggs.reparameterize(params, None, GPT2_PAIRS, factor)
  assert set(drawn) == {
    gpt2_instance(i, w) for i in range(LAYERS) for w in ("qk", "vo", "ln_1", "ln_2")
  }
  assert_tree_close(moved, gpt2_move(params, drawn, 1), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(gpt2_logits(moved, IDS), gpt2_logits(params, IDS), atol=2e-5)


def test_moments_are_transported_by_hand():
  params = gpt2_init(0)
  state = models.random_like(optax.adam(1e-3).init(params), 3)
  factor, drawn = random_factors(2)
  moved, moved_state = saggs.reparameterize(params, state, GPT2_PAIRS, factor)
  adam = moved_state[0]
  assert_tree_close(moved, gpt2_move(params, drawn, 1), rtol=1e-6, atol=1e-7)
  assert_tree_close(adam.mu, gpt2_move(state[0].mu, drawn, -1), rtol=1e-6, atol=1e-7)
  assert_tree_close(adam.nu, gpt2_move(state[0].nu, drawn, -2), rtol=1e-5, atol=1e-7)


@jax.jit
def _hard_step(params):
  tx = saggs.chain(optax.sgd(0.0), saggs.saggs(GPT2_PAIRS, every=1))
  updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  return optax.apply_updates(params, updates), state


def test_hard_saggs_balances_an_8x_imbalance_in_one_update():
  params = imbalanced_gpt2()
  before = gpt2_norms(params)
  assert np.log(before[gpt2_instance(0, "qk")][0] / before[gpt2_instance(0, "qk")][1]).min() > 3
  balanced, state = _hard_step(params)
  for key, (a, b) in gpt2_norms(balanced).items():
    np.testing.assert_allclose(a, b, rtol=1e-4, err_msg=key)
  np.testing.assert_allclose(gpt2_logits(balanced, IDS), gpt2_logits(params, IDS), atol=5e-5)
  assert any("kernel[q]|" in k for k in state[1].factors)


_canonical = jax.jit(lambda p: saggs.canonicalize(p, None, GPT2_PAIRS)[0])


def test_blocks_whose_squares_overflow_float32_are_balanced():
  """q at 1e20 and k at 1e-20: their float32 sums of squares overflow and underflow, so
  the scale-safe statistics run (on the q and k pieces of the leaf, under jit). Through
  canonicalize: an optimizer's update ``target - params`` cannot carry a move from 1e20
  to 1 in float32."""
  params = gpt2_init(0)
  for i in range(LAYERS):
    p = params["transformer"]["h"][str(i)]["attn"]["c_attn"]
    p["kernel"] = (
      p["kernel"] * jnp.concatenate([jnp.full(D, 1e20), jnp.full(D, 1e-20), jnp.ones(D)])[:, None]
    )
  balanced = _canonical(params)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(balanced))
  for key, (a, b) in gpt2_norms(balanced).items():
    np.testing.assert_allclose(a, b, rtol=1e-4, err_msg=key)


def test_canonicalize_is_idempotent_orbit_invariant_and_keeps_logits():
  params = imbalanced_gpt2()
  canon = _canonical
  once = canon(params)
  np.testing.assert_allclose(gpt2_logits(once, IDS), gpt2_logits(params, IDS), atol=5e-5)
  chex.assert_trees_all_close(canon(once), once, rtol=1e-5, atol=1e-6)
  factor, _ = random_factors(3)
  elsewhere = saggs.reparameterize(params, None, GPT2_PAIRS, factor)[0]
  chex.assert_trees_all_close(canon(elsewhere), once, rtol=1e-4, atol=1e-6)


def test_imbalance_and_describe_show_blocks():
  params = imbalanced_gpt2()
  got = saggs.imbalance(params, GPT2_PAIRS)
  for key, (a, b) in gpt2_norms(params).items():
    match = [k for k in got if k.startswith(key + "|")]
    assert len(match) == 1, (key, list(got))
    np.testing.assert_allclose(got[match[0]], np.log(a / b), rtol=1e-5, atol=1e-6)
  qk = "transformer/h/0/attn/c_attn/kernel"
  assert f"{qk}[q]|{qk}[k]" in got
  text = saggs.describe(params, GPT2_PAIRS)
  rows = [line.split() for line in text.splitlines()]
  for row in (
    f"attention Q/K a {qk}[q] (24, 8) axis 0 [0:8] 0 (2,)",
    f"attention Q/K b {qk}[k] (24, 8) axis 0 [8:16] 0 (2,)",
    f"attention V/O a {qk}[v] (24, 8) axis 0 [16:24] 0 (2,)",
    "attention V/O b transformer/h/0/attn/c_proj/kernel (8, 8) all 1 (2,)",
    "attention Q/K a+ transformer/h/0/attn/c_attn/bias[q] (24,) axis 0 [0:8] 0 (2,)",
    f"LayerNorm ln_1 b {qk} (24, 8) all 1 (8,)",
  ):
    assert row.split() in rows, text
  assert f"In several pairs, so balanced jointly: {qk}, transformer/h/1" in text


def test_check_symmetry_accepts_the_blocks_and_rejects_q_against_v():
  deviations = saggs.check_symmetry(gpt2_forward, gpt2_init(0), GPT2_PAIRS, IDS)
  assert len(deviations) == 4 * LAYERS
  qkv = dict(axis=0, parts=("q", "k", "v"))
  wrong = saggs.Pair(
    saggs.Block("attn/c_attn/kernel", part="q", **qkv),
    saggs.Block("attn/c_attn/kernel", part="v", **qkv),
    axes=(0, 0),
    groups=HEADS,
    name="Q against V",
  )
  with pytest.raises(
    ValueError,
    match=r"Q against V is not a symmetry of the model: rescaling"
    r" 'transformer/h/0/attn/c_attn/kernel\[q\]' by c and"
    r" 'transformer/h/0/attn/c_attn/kernel\[v\]' by 1/c",
  ):
    saggs.check_symmetry(gpt2_forward, gpt2_init(0), [wrong], IDS)


def test_a_bias_left_out_of_a_block_pair_is_named():
  qkv = dict(axis=0, parts=("q", "k", "v"))
  no_bias = saggs.Pair(
    saggs.Block("attn/c_attn/kernel", part="q", **qkv),
    saggs.Block("attn/c_attn/kernel", part="k", **qkv),
    axes=(0, 0),
    groups=HEADS,
    follow_b=saggs.Block("attn/c_attn/bias", part="k", **qkv),
  )
  with pytest.raises(
    ValueError,
    match=r"a follower left out: with Block\('transformer/h/0/attn/"
    r"c_attn/bias', axis=0, parts=\('q', 'k', 'v'\), part='q'\) in follow_a",
  ):
    saggs.check_symmetry(gpt2_forward, gpt2_init(0), [no_bias], IDS)


@pytest.fixture
def manager(tmp_path):
  mngr = ocp.CheckpointManager(tmp_path / "ckpt")
  yield mngr
  mngr.close()


def _chain_tx(pairs):
  return saggs.chain(optax.adamw(1e-2), saggs.saggs(pairs, every=1))


def _chain_state(pairs, params):
  return models.random_like(_chain_tx(pairs).init(params), 6)


def test_checkpoint_round_trip_and_the_layout_names_blocks(manager):
  params = gpt2_init(0)
  state = _chain_state(GPT2_PAIRS, params)
  record = saggs.checkpoint.layout(state)
  qk = "transformer/h/0/attn/c_attn/kernel"
  assert record[f"1/factors/{qk}[q]|{qk}[k]"] == "float32[2]"
  assert saggs.checkpoint.save(manager, 1, params, state)
  factor, _ = random_factors(4)
  target = saggs.reparameterize(gpt2_init(1), _chain_state(GPT2_PAIRS, params), GPT2_PAIRS, factor)
  got = saggs.checkpoint.restore(manager, *target, canonicalize=False)
  chex.assert_trees_all_equal(got[:2], (params, state))
  got = saggs.checkpoint.restore(manager, *target, pairs=GPT2_PAIRS, tx=_chain_tx(GPT2_PAIRS))[:2]
  chex.assert_trees_all_close(
    got, saggs.canonicalize(params, state, GPT2_PAIRS), rtol=1e-5, atol=1e-6
  )
  # The same leaves paired otherwise (K against Q) is another layout: refused by name.
  swapped = [
    saggs.Pair(
      GPT2_PAIRS[0].b,
      GPT2_PAIRS[0].a,
      axes=(0, 0),
      groups=HEADS,
      follow_a=GPT2_PAIRS[0].follow_b,
      follow_b=GPT2_PAIRS[0].follow_a,
    ),
    *GPT2_PAIRS[1:],
  ]
  with pytest.raises(
    ValueError,
    match=rf"does not fit the target at"
    rf" 'opt_state/1/factors/{qk}\[k\]\|{qk}\[q\]': nothing there",
  ):
    saggs.checkpoint.restore(manager, params, _chain_state(swapped, params), pairs=swapped)


def test_gpt2_preset_is_exact_on_flax_gpt2_names():
  params = gpt2_init(2)
  plan = saggs._src.plan.resolve(GPT2_PAIRS, params)
  assert [i.pair.name for i in plan.instances] == (
    ["attention Q/K"] * LAYERS
    + ["attention V/O"] * LAYERS
    + ["LayerNorm ln_1"] * LAYERS
    + ["LayerNorm ln_2"] * LAYERS
  )
  assert plan.overlapping  # c_attn's rows and its column blocks are balanced jointly
  no_norms = saggs.presets.gpt2(num_heads=HEADS, norms=False)
  assert len(saggs.check_symmetry(gpt2_forward, params, no_norms, IDS)) == 2 * LAYERS


# ---------------------------------------------------------------------------
# gemma-style: K and V stacked on axis 0 of one leaf, gate and up on axis 0 of another.

N, KV, GD, GH, F = 4, 2, 6, 3, 10
KV_BLOCK = dict(axis=0, parts=("k", "v"))
GATE_UP = dict(axis=0, parts=("gate", "up"))
GEMMA_PAIRS = [
  saggs.Pair(
    "attn/q_einsum/w",
    saggs.Block("attn/kv_einsum/w", part="k", **KV_BLOCK),
    axes=(0, 1),
    groups=KV,
    name="Q/K",
  ),
  saggs.Pair(
    saggs.Block("attn/kv_einsum/w", part="v", **KV_BLOCK),
    "attn/attn_vec_einsum/w",
    axes=(1, 0),
    groups=KV,
    name="V/O",
  ),
  saggs.Pair(
    saggs.Block("mlp/gating_einsum/w", part="up", **GATE_UP),
    "mlp/linear/w",
    axes=(2, 0),
    name="up/down",
  ),
]


def gemma_init(seed=0):
  rng = np.random.default_rng(seed)
  w = lambda *s: jnp.asarray(0.5 * rng.standard_normal(s), jnp.float32)  # noqa: E731
  return {
    f"layer_{i}": {
      "attn": {
        "q_einsum": {"w": w(N, GD, GH)},
        "kv_einsum": {"w": w(2, KV, GD, GH)},
        "attn_vec_einsum": {"w": w(N, GH, GD)},
      },
      "mlp": {"gating_einsum": {"w": w(2, GD, F)}, "linear": {"w": w(F, GD)}},
    }
    for i in range(2)
  }


def gemma_forward(params, x):
  for i in range(2):
    p = params[f"layer_{i}"]
    q = jnp.einsum("btd,ndh->btnh", x, p["attn"]["q_einsum"]["w"])
    k, v = jnp.einsum("btd,ckdh->cbtkh", x, p["attn"]["kv_einsum"]["w"])
    k, v = (jnp.repeat(a, N // KV, axis=2) for a in (k, v))  # query head n reads KV head n // 2
    a = jax.nn.softmax(jnp.einsum("bsnh,btnh->bnst", q, k), axis=-1)
    o = jnp.einsum("bnst,btnh->bsnh", a, v)
    x = x + jnp.einsum("bsnh,nhd->bsd", o, p["attn"]["attn_vec_einsum"]["w"])
    gate, up = jnp.einsum("btd,cdf->cbtf", x, p["mlp"]["gating_einsum"]["w"])
    x = x + (jax.nn.gelu(gate) * up) @ p["mlp"]["linear"]["w"]
  return x


X = jnp.asarray(np.random.default_rng(5).standard_normal((2, 3, GD)), jnp.float32)
gemma_out = jax.jit(gemma_forward)


def gemma_move(params, drawn):
  out = jax.tree.map(lambda x: np.array(x, np.float64), params)
  for i in range(2):
    p, name = out[f"layer_{i}"], f"layer_{i}"
    qk = drawn[f"{name}/attn/q_einsum/w"]
    vo = drawn[f"{name}/attn/kv_einsum/w[v]"]
    up = drawn[f"{name}/mlp/gating_einsum/w[up]"]
    p["attn"]["q_einsum"]["w"] *= np.repeat(qk, N // KV)[:, None, None]
    p["attn"]["kv_einsum"]["w"][0] /= qk[:, None, None]
    p["attn"]["kv_einsum"]["w"][1] *= vo[:, None, None]
    p["attn"]["attn_vec_einsum"]["w"] /= np.repeat(vo, N // KV)[:, None, None]
    p["mlp"]["gating_einsum"]["w"][1] *= up[None, :]
    p["mlp"]["linear"]["w"] /= up[:, None]
  return out


def test_gemma_stacked_kv_and_gate_up_blocks():
  params = gemma_init(0)
  saggs.check_symmetry(gemma_forward, params, GEMMA_PAIRS, X)
  factor, drawn = random_factors(6)
  moved, _ = saggs.reparameterize(params, None, GEMMA_PAIRS, factor)
  assert_tree_close(moved, gemma_move(params, drawn), rtol=1e-6, atol=1e-7)
  out = gemma_out(params, X)
  np.testing.assert_allclose(gemma_out(moved, X), out, atol=1e-5 * np.max(np.abs(out)))
  # Hard balancing: per KV head and per channel, NumPy norms of the blocks agree.
  balanced, _ = saggs.canonicalize(moved, None, GEMMA_PAIRS)
  for i in range(2):
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), balanced[f"layer_{i}"])
    q = (p["attn"]["q_einsum"]["w"] ** 2).reshape(KV, -1).sum(1)
    kv = (p["attn"]["kv_einsum"]["w"] ** 2).sum((2, 3))
    o = (p["attn"]["attn_vec_einsum"]["w"] ** 2).reshape(KV, -1).sum(1)
    up = (p["mlp"]["gating_einsum"]["w"][1] ** 2).sum(0)
    down = (p["mlp"]["linear"]["w"] ** 2).sum(1)
    for a, b in ((q, kv[0]), (kv[1], o), (up, down)):
      np.testing.assert_allclose(a, b, rtol=1e-4)
  # The gate block is untouched by any factor.
  np.testing.assert_array_equal(
    moved["layer_0"]["mlp"]["gating_einsum"]["w"][0],
    params["layer_0"]["mlp"]["gating_einsum"]["w"][0],
  )


# ---------------------------------------------------------------------------
# Declarations


def test_block_repr_is_python_and_unequal_sizes_resolve():
  b = saggs.Block("attn/qkv/kernel", axis=-1, parts=("q", "k", "v"), part="k", sizes=(8, 4, 4))
  assert eval(repr(b), {"Block": saggs.Block}) == b
  params = {"attn": {"qkv": {"kernel": jnp.ones((6, 16))}, "o": {"kernel": jnp.ones((4, 6))}}}
  v = saggs.Block("attn/qkv/kernel", axis=-1, parts=("q", "k", "v"), part="v", sizes=(8, 4, 4))
  pair = saggs.Pair(v, "attn/o/kernel", axes=(1, 0), groups=2)
  plan = saggs._src.plan.resolve([pair], params)
  assert plan.slot("attn/qkv/kernel[v]", plan.instances[0].key).block == (1, 12, 16)


@pytest.mark.parametrize(
  "block, msg",
  [
    (dict(part="x"), r"part must be one of \('q', 'k', 'v'\)"),
    (dict(part=3), r"part must be one of .* or an index below 3"),
    (dict(parts=3, part="q"), r"parts=3, part='q'\): part must be an index below 3"),
    (dict(parts=("q", "q"), part="q"), "parts must be distinct"),
    (dict(sizes=(8, 8)), "sizes must be 3 positive ints"),
  ],
)
def test_malformed_block(block, msg):
  kwargs = dict(pattern="c_attn/kernel", axis=-1, parts=("q", "k", "v"), part="q") | block
  with pytest.raises(ValueError, match=r"Block\('c_attn/kernel', .*" + msg):
    saggs.Block(**kwargs)


def _block(part, **kw):
  return saggs.Block("c_attn/kernel", **(dict(axis=-1, parts=("q", "k", "v"), part=part) | kw))


@pytest.mark.parametrize(
  "pairs, msg",
  [
    (
      [saggs.Pair(_block("q", sizes=(4, 4, 4)), _block("k", sizes=(4, 4, 4)))],
      r"Block\('c_attn/kernel'.*sizes=\(4, 4, 4\)\) sizes sum to 12, but axis 1 of 'c_attn/kernel'"
      r" with shape \(8, 24\) has size 24",
    ),
    (
      [saggs.Pair(_block(0, parts=5), _block(1, parts=5))],
      r"cannot split axis 1 of size 24 of 'c_attn/kernel' with shape \(8, 24\) into 5 equal",
    ),
    (
      [saggs.Pair(_block("q", axis=2), _block("k", axis=2))],
      r"axis 2 is out of range for 'c_attn/kernel' with shape \(8, 24\)",
    ),
    (
      [saggs.Pair(_block("q"), _block("q"))],
      r"'c_attn/kernel' is both side a and side b, overlapping",
    ),
    ([saggs.Pair(_block("q"), "c_attn/kernel", axes=(0, 0))], r"is both side a and side b"),
    (
      [saggs.Pair(_block("q"), _block("k")), saggs.Pair(_block(0, axis=0, parts=2), "w")],
      r"'c_attn/kernel' is split along axis 1 by .* and along axis 0 by",
    ),
    (
      [saggs.Pair(_block("q"), "w", axes=(1, 1), groups=3)],
      r"3 groups do not divide axis of size 8 of 'c_attn/kernel\[q\]' with shape \(8, 8\)",
    ),
  ],
)
def test_bad_blocks_name_pattern_path_and_shape(pairs, msg):
  params = {"c_attn": {"kernel": jnp.ones((8, 24))}, "w": jnp.ones((8, 8))}
  with pytest.raises(ValueError, match=msg):
    saggs._src.plan.resolve(pairs, params)


def test_adafactor_refuses_a_block_edge_along_a_factored_axis():
  qkv = dict(axis=0, parts=("q", "k", "v"))
  pairs = [
    saggs.Pair(
      saggs.Block("attn/c_attn/kernel", part="q", **qkv),
      saggs.Block("attn/c_attn/kernel", part="k", **qkv),
    )
  ]
  params = gpt2_init(0)
  state = optax.adafactor(1e-2, min_dim_size_to_factor=4).init(params)
  with pytest.raises(
    TypeError,
    match=r"c_attn/kernel'\]: the factors change along axis 0 \(a block\), which Adafactor"
    r" averages\. Pass adafactor\(\.\.\., factored=False\)",
  ):
    saggs.reparameterize(params, state, pairs, 2.0)
