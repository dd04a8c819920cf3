"""QK-clip: logits land on τ, K2's clip in NumPy, α-free under hard SAGGS, GQA, stacked, sharded.

The model is one causal attention layer in plain JAX, kernels (d, heads·head_dim),
query head h reading KV head h // (heads // kv_heads). Oracles are written here:
a NumPy Adam + K2 clip, the logits recomputed from the clipped kernels, and per
head products W_q^h W_k^gᵀ (which the Q/K gauge leaves unchanged).
"""

import functools
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import saggs_jax as saggs
from xla_env import cpu_env

D, HD, T, B = 8, 4, 6, 2
ROOT = pathlib.Path(__file__).resolve().parent.parent


def make_params(heads, kv_heads, seed=0, scale=1.0, stacked=()):
  rng = np.random.default_rng(seed)
  mk = lambda cols: jnp.asarray(rng.standard_normal(stacked + (D, cols)) * scale, jnp.float32)
  wo = jnp.asarray(rng.standard_normal(stacked + (heads * HD, D)), jnp.float32)
  return {
    "attn": {"wq": mk(heads * HD), "wk": mk(kv_heads * HD), "wv": mk(kv_heads * HD), "wo": wo}
  }


def qk(attn, x):
  q = (x @ attn["wq"]).reshape(x.shape[:2] + (-1, HD))
  k = (x @ attn["wk"]).reshape(x.shape[:2] + (-1, HD))
  return q, k


def logits_of(params, x):
  """{query path: per-head max logit}, with saggs.max_logits (one layer)."""
  return {"attn/wq": saggs.max_logits(*qk(params["attn"], x), is_causal=True)}


def loss_fn(params, x):
  a = params["attn"]
  q, k = qk(a, x)
  v = (x @ a["wv"]).reshape(x.shape[:2] + (-1, HD))
  out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  return jnp.mean((out.reshape(x.shape[:2] + (-1,)) @ a["wo"] - x) ** 2)


def batch(seed=1):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, D)), jnp.float32)


def qk_pair(kv_heads, stacked=0, prefix="attn"):
  return saggs.Pair(f"{prefix}/wq", f"{prefix}/wk", axes=(1, 1), groups=kv_heads, stacked=stacked)


@functools.cache
def stepper(tx_key):
  """One jitted train step per optimizer description (compiled once, shared by tests)."""
  tx = TXS[tx_key[0]](*tx_key[1:])

  @jax.jit
  def step(params, state, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    updates, state = tx.update(grads, state, params, max_logits=logits_of(params, x))
    return optax.apply_updates(params, updates), state, loss

  return tx, step


TAU = 20.0
TXS = {
  "lr0": lambda kv, alpha: saggs.chain(optax.sgd(0.0), saggs.qk_clip([qk_pair(kv)], TAU, alpha)),
  "adam": lambda kv, alpha, lr: saggs.chain(
    optax.adam(lr), saggs.qk_clip([qk_pair(kv)], TAU, alpha)
  ),
  "hard": lambda kv, alpha, lr: saggs.chain(
    optax.adam(lr), saggs.saggs([qk_pair(kv)]), saggs.qk_clip([qk_pair(kv)], TAU, alpha)
  ),
}


def run(tx_key, params, steps, x=None):
  tx, step = stepper(tx_key)
  state, losses = tx.init(params), []
  for s in range(steps):
    params, state, loss = step(params, state, batch(s) if x is None else x)
    losses.append(float(loss))
  return params, state, np.array(losses)


@pytest.mark.parametrize("kv_heads,alpha,seed", [(4, 0.5, 0), (2, 0.5, 2), (2, 1.0, 0)])
def test_lr0_clipped_heads_land_on_tau_and_the_others_are_untouched(kv_heads, alpha, seed):
  params, x = make_params(4, kv_heads, seed), batch()
  before = np.asarray(logits_of(params, x)["attn/wq"])
  assert (before > TAU).any() and (before < TAU).any(), before  # the scale makes both kinds
  new = run(("lr0", kv_heads, alpha), params, 1, x)[0]
  after = np.asarray(logits_of(new, x)["attn/wq"])
  over = before > TAU
  np.testing.assert_allclose(after[over], TAU, rtol=3e-6)
  np.testing.assert_allclose(after[~over], before[~over], rtol=3e-6)
  # A query head stays bit for bit when its KV group has no clipped head (any α), or when
  # alpha = 1 (its own γ_h = 1 and no share of the group's clip).
  clean = ~over.reshape(kv_heads, -1).any(1)  # per KV head: none of its query heads clipped
  keep = ~over if alpha == 1 else clean.repeat(4 // kv_heads)
  assert keep.any()
  q0, q1 = (np.asarray(p["attn"]["wq"]).reshape(D, 4, HD) for p in (params, new))
  np.testing.assert_array_equal(q1[:, keep], q0[:, keep])
  k0, k1 = (np.asarray(p["attn"]["wk"]).reshape(D, kv_heads, HD) for p in (params, new))
  k_keep = np.ones_like(clean) if alpha == 1 else clean  # α = 1 leaves every key alone
  np.testing.assert_array_equal(k1[:, k_keep], k0[:, k_keep])
  assert not np.array_equal(q1[:, over], q0[:, over])


def numpy_adam_k2(params, steps, lr, b1=0.9, b2=0.999, eps=1e-8):
  """Adam and then K2's QK-clip (α = 1/2, moments untouched), in NumPy; gradients and
  logits at the NumPy parameters from the model above."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  mu, nu = (jax.tree.map(np.zeros_like, p) for _ in range(2))
  grad = jax.jit(jax.grad(loss_fn))
  for t in range(1, steps + 1):
    x = batch(t - 1)
    f32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p)
    g = jax.tree.map(lambda a: np.asarray(a, np.float64), grad(f32, x))
    q = np.einsum("btd,dhe->bthe", np.asarray(x, np.float64), p["attn"]["wq"].reshape(D, -1, HD))
    k = np.einsum("btd,dhe->bthe", np.asarray(x, np.float64), p["attn"]["wk"].reshape(D, -1, HD))
    s = np.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(HD)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf).max(axis=(0, 2, 3))
    for leaf in p["attn"]:
      mu["attn"][leaf] = b1 * mu["attn"][leaf] + (1 - b1) * g["attn"][leaf]
      nu["attn"][leaf] = b2 * nu["attn"][leaf] + (1 - b2) * g["attn"][leaf] ** 2
      m, v = mu["attn"][leaf] / (1 - b1**t), nu["attn"][leaf] / (1 - b2**t)
      p["attn"][leaf] = p["attn"][leaf] - lr * m / (np.sqrt(v) + eps)
    for h in np.nonzero(s > TAU)[0]:
      root = np.sqrt(TAU / s[h])
      p["attn"]["wq"][:, h * HD : (h + 1) * HD] *= root
      p["attn"]["wk"][:, h * HD : (h + 1) * HD] *= root
  return p, mu, nu


def test_half_split_on_mha_is_k2_qk_clip():
  params = make_params(4, 4)
  new, state, _ = run(("adam", 4, 0.5, 0.05), params, 4)
  want, mu, nu = numpy_adam_k2(params, 4, 0.05)
  for leaf in ("wq", "wk", "wv", "wo"):
    np.testing.assert_allclose(new["attn"][leaf], want["attn"][leaf], rtol=2e-4, atol=2e-5)
  # Moments untouched by the clip: Adam's own, up to float32 gradients.
  np.testing.assert_allclose(state[0][0].mu["attn"]["wq"], mu["attn"]["wq"], rtol=2e-4, atol=1e-5)
  np.testing.assert_allclose(state[0][0].nu["attn"]["wk"], nu["attn"]["wk"], rtol=2e-4, atol=1e-7)


def head_products(params, kv_heads):
  """W_q^h W_k^gᵀ per query head: what the logits see; the Q/K gauge leaves it alone."""
  q = np.asarray(params["attn"]["wq"], np.float64).reshape(D, kv_heads, -1, HD)
  k = np.asarray(params["attn"]["wk"], np.float64).reshape(D, kv_heads, HD)
  return np.einsum("dgne,fge->gndf", q, k)


def test_hard_saggs_makes_the_trajectory_independent_of_alpha_gqa():
  params = make_params(4, 2)
  runs = {a: run(("hard", 2, a, 0.05), params, 5) for a in (0.25, 0.5, 0.75)}
  clipped = np.asarray(logits_of(runs[0.5][0], batch(0))["attn/wq"])
  assert (np.asarray(logits_of(params, batch(0))["attn/wq"]) > TAU).any()
  ref_p, _, ref_loss = runs[0.5]
  for a in (0.25, 0.75):
    p, _, loss = runs[a]
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5)
    np.testing.assert_allclose(
      head_products(p, 2),
      head_products(ref_p, 2),
      rtol=1e-4,
      atol=1e-5 * np.abs(head_products(ref_p, 2)).max(),
    )
    np.testing.assert_allclose(p["attn"]["wv"], ref_p["attn"]["wv"], rtol=1e-4, atol=1e-6)
  assert np.isfinite(clipped).all()
  # Without SAGGS the split steers Adam: α does matter, so the equality above is no accident.
  free = {a: run(("adam", 2, a, 0.05), params, 5)[2] for a in (0.25, 0.75)}
  assert np.abs(free[0.25] - free[0.75]).max() > 1e-4


def test_stacked_layers_clip_each_layer_by_its_own_logits():
  layers = 2
  params = make_params(4, 2, stacked=(layers,))
  x = batch()
  per_layer = lambda p: jax.vmap(lambda a: saggs.max_logits(*qk(a, x), is_causal=True))(p["attn"])
  before = np.asarray(per_layer(params))
  assert before.shape == (layers, 4) and (before > TAU).any() and (before < TAU).any()
  tx = saggs.chain(optax.sgd(0.0), saggs.qk_clip([qk_pair(2, stacked=1)], TAU))
  updates, _ = jax.jit(lambda p: tx.update(p, tx.init(p), p, max_logits={"attn/wq": per_layer(p)}))(
    params
  )
  after = np.asarray(per_layer(optax.apply_updates(params, updates)))
  np.testing.assert_allclose(after, np.minimum(before, TAU), rtol=3e-6)
  with pytest.raises(ValueError, match=r"max_logits\['attn/wq'\] has shape \(4,\).*\(2,\) \+"):
    tx.update(params, tx.init(params), params, max_logits={"attn/wq": before[0]})


def test_jit_traces_once_and_the_missing_argument_is_named():
  params, traces = make_params(4, 2), []
  tx = saggs.chain(optax.adam(0.05), saggs.saggs([qk_pair(2)]), saggs.qk_clip([qk_pair(2)], TAU))

  @jax.jit
  def step(params, state, x):
    traces.append(1)
    grads = jax.grad(loss_fn)(params, x)
    updates, state = tx.update(grads, state, params, max_logits=logits_of(params, x))
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for s in range(3):
    params, state = step(params, state, batch(s))
  assert len(traces) == 1
  for chained in (tx, optax.chain(optax.adam(0.05), saggs.qk_clip([qk_pair(2)], TAU))):
    with pytest.raises(
      ValueError,
      match=r"needs the measured maximum logits.*max_logits=\{"
      r"'attn/wq': \(2,\) \+ \('heads',\)\}|max_logits=\{'attn/wq': \('heads',\)",
    ):
      chained.update(params, chained.init(params), params)
  with pytest.raises(ValueError, match=r"got keys \['attn/wv'\]"):
    tx.update(params, state, params, max_logits={"attn/wv": jnp.ones(4)})


def test_example_lm_sows_logits_by_query_path_and_its_step_clips_them():
  """lm.make_max_logits_step (examples/qk_clip.py's step) on a tiny lm.LM, with the
  example's clip arm: its sown logits, keyed as the clip reads them, land on τ after an
  update with lr 0."""
  from harness import lm

  config = lm.ModelConfig(
    d_model=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, mlp_hidden=24, seq_len=8
  )
  graphdef, params = lm.init_model(config, seed=0)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 9)), jnp.int32)
  measure = jax.jit(lm.loss_and_max_logits, static_argnums=1)  # compiled once, used twice
  _, before = measure(params, graphdef, tokens)
  assert {k: v.shape for k, v in before.items()} == {
    f"layers/{i}/attn/q_proj/kernel": (4,) for i in range(2)
  }
  # τ between layer 0's logits and above layer 1's: the clip of layer 0 changes the inputs
  # of layer 1, whose logits are then no longer the measured ones.
  first, second = (np.asarray(before[f"layers/{i}/attn/q_proj/kernel"]) for i in range(2))
  tau = float(np.median(first))
  assert second.max() < tau < first.max()
  qk = saggs.presets.llama(config.num_kv_heads, mlp=False)[:1]  # every layer's Q/K pair
  tx = saggs.chain(optax.adamw(0.0), saggs.qk_clip(qk, tau))
  new, _, _, top = lm.make_max_logits_step(graphdef, tx)(
    lm.donatable_copy(params), tx.init(params), tokens
  )
  assert float(top) == max(float(v.max()) for v in before.values())
  _, after = measure(new, graphdef, tokens)
  np.testing.assert_allclose(
    after["layers/0/attn/q_proj/kernel"], np.minimum(first, tau), rtol=1e-5
  )
  for name in ("q_proj", "k_proj"):
    np.testing.assert_array_equal(
      new["layers"][1]["attn"][name]["kernel"][...],
      params["layers"][1]["attn"][name]["kernel"][...],
    )


def test_max_logits_matches_numpy_with_masks():
  rng = np.random.default_rng(3)
  q = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
  k = rng.standard_normal((2, 5, 2, 5)).astype(np.float32)
  mask = rng.random((2, 1, 3, 5)) < 0.5
  mask[1, 0, 2] = False  # a query row with nothing to attend
  s = np.einsum("bqhe,bkhe->bhqk", q, np.repeat(k, 2, axis=2)) * 0.3
  causal = np.tril(np.ones((3, 5), bool), 2)
  for kwargs, keep in [
    ({}, np.ones((1, 1, 3, 5), bool)),
    ({"is_causal": True}, causal),
    ({"mask": jnp.asarray(mask)}, mask),
    ({"mask": jnp.asarray(mask), "is_causal": True}, mask & causal),
  ]:
    got = saggs.max_logits(jnp.asarray(q), jnp.asarray(k), scale=0.3, **kwargs)
    want = np.where(np.broadcast_to(keep, s.shape), s, -np.inf).max(axis=(0, 2, 3))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got.dtype == jnp.float32
  masked_head = saggs.max_logits(jnp.asarray(q), jnp.asarray(k), mask=jnp.zeros((1, 4, 1, 1), bool))
  assert np.isneginf(masked_head).all()


FSDP_SCRIPT = textwrap.dedent(r"""
    import sys
    sys.path[:0] = [@TESTS@, @ROOT@]
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import saggs_jax as saggs
    import test_qk_clip as t

    assert jax.device_count() == 8
    params = t.make_params(4, 2)
    params["attn"] = {k: (jnp.tile(v, (1, 2)) if k != "wo" else jnp.tile(v, (2, 1)))
                      for k, v in params["attn"].items()}  # 8 heads, 4 KV heads
    x = t.batch()
    tx, step = t.stepper(("hard", 4, 0.25, 0.05))  # SAGGS, then the clip with its gauge moved
    plain = step(params, tx.init(params), x)
    for axis_type in ("Auto", "Explicit"):
      mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
      spec = lambda a: NamedSharding(mesh, P("fsdp") if a.ndim and a.shape[0] % 8 == 0 else P())
      with jax.set_mesh(mesh):
        sharded = jax.device_put(params, jax.tree.map(spec, params))
        state = jax.device_put(tx.init(params), jax.tree.map(spec, tx.init(params)))
        got = step(sharded, state, jax.device_put(x, NamedSharding(mesh, P())))
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plain)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
      for a, b in zip(jax.tree.leaves(got[:2]), jax.tree.leaves((sharded, state))):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (axis_type, a.sharding, b.sharding)
    print("fsdp OK")
""")


def test_fsdp_mesh_equals_unsharded():
  script = FSDP_SCRIPT.replace("@TESTS@", repr(str(ROOT / "tests"))).replace(
    "@ROOT@", repr(str(ROOT))
  )
  env = cpu_env(8)
  proc = subprocess.run(
    [sys.executable, "-c", script],
    capture_output=True,
    text=True,
    timeout=600,
    env=env,
    check=False,
  )
  assert proc.returncode == 0 and "fsdp OK" in proc.stdout, (
    proc.stdout[-3000:] + proc.stderr[-6000:]
  )


# --- max_logits of the wrong length, a pair without declared heads, a non-finite S ---------


def numpy_max_logits(params, x, heads, kv_heads):
  """Per query head, the largest causal logit q·k/sqrt(HD) over the batch, in NumPy float64."""
  a = {n: np.asarray(w, np.float64) for n, w in params["attn"].items()}
  x = np.asarray(x, np.float64)
  q = (x @ a["wq"]).reshape(B, T, heads, HD)
  k = np.repeat((x @ a["wk"]).reshape(B, T, kv_heads, HD), heads // kv_heads, axis=2)
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HD)
  causal = np.tril(np.ones((T, T), bool))
  return np.where(causal, logits, -np.inf).max(axis=(0, 2, 3))


@pytest.mark.parametrize("kv_heads,given", [(4, 8), (2, 2)], ids=["8_for_4_heads", "per_kv_head"])
def test_max_logits_with_the_wrong_number_of_heads_is_refused(kv_heads, given):
  """8 values for 4 heads divide the query axis (16 entries) and the KV groups, as do the 2
  per-KV-head maxima of 4 GQA heads: both used to be read as heads and left the clipped heads'
  logits at 1.4x and 2.26x τ. Now refused, naming the path and the 4 heads it wants; with
  the 4 measured values every head's max logit (in NumPy) ends at most τ."""
  params, x = make_params(4, kv_heads, seed=2, scale=1.5), batch()
  tx = saggs.chain(optax.sgd(0.0), saggs.qk_clip([qk_pair(kv_heads)], TAU))
  state = tx.init(params)
  with pytest.raises(
    ValueError, match=rf"max_logits\['attn/wq'\] has shape \({given},\).*heads = 4"
  ):
    tx.update(params, state, params, max_logits={"attn/wq": jnp.full(given, 2 * TAU)})
  before = numpy_max_logits(params, x, 4, kv_heads)
  assert (before > 1.5 * TAU).any()
  updates, _ = tx.update(params, state, params, max_logits=logits_of(params, x))
  after = numpy_max_logits(optax.apply_updates(params, updates), x, 4, kv_heads)
  assert np.all(after <= TAU * (1 + 1e-5)), after
  np.testing.assert_allclose(after, np.minimum(before, TAU), rtol=1e-5)


PER_CHANNEL = saggs.Pair("attn/wq", "attn/wk", axes=(1, 1))


def test_a_per_channel_pair_clips_per_head_as_the_declared_heads_do():
  """discover's Q/K pair of a model without RoPE has one group per channel and declares no
  heads: with num_heads (MHA: the K axis as wide as the Q axis) the clip lands where the pair
  with 4 declared KV heads lands, the moments moved by the same gauge."""
  params, x = make_params(4, 4, seed=2), batch()
  logits = logits_of(params, x)
  got = {}
  for name, pair in (("channels", PER_CHANNEL), ("heads", qk_pair(4))):
    tx = saggs.chain(optax.adam(0.05), saggs.qk_clip([pair], TAU, alpha=0.8, num_heads=4))
    state = tx.init(params)
    updates, state = tx.update(jax.grad(loss_fn)(params, x), state, params, max_logits=logits)
    got[name] = optax.apply_updates(params, updates), state[0][0].mu
  np.testing.assert_allclose(
    got["channels"][0]["attn"]["wq"], got["heads"][0]["attn"]["wq"], rtol=1e-6
  )
  np.testing.assert_allclose(
    got["channels"][0]["attn"]["wk"], got["heads"][0]["attn"]["wk"], rtol=1e-6
  )
  for side in ("wq", "wk"):
    np.testing.assert_allclose(
      got["channels"][1]["attn"][side], got["heads"][1]["attn"][side], rtol=1e-6, atol=1e-9
    )


@pytest.mark.parametrize("num_heads", [None, 4, 3])
@pytest.mark.parametrize("measured", [2, 8])
def test_a_per_channel_pair_refuses_a_head_count_it_cannot_verify(num_heads, measured):
  """4 heads, max_logits of 2 or 8 values: without num_heads nothing says which is right (both
  divide the 16 query channels; issue 43, finding 9: accepted, heads ended at 0.69-1.89 τ);
  with num_heads the count must be it (and divide the channels)."""
  params, x = make_params(4, 4, seed=2), batch()
  logits = {"attn/wq": jnp.full((measured,), 2 * TAU)}
  tx = saggs.chain(optax.adam(0.05), saggs.qk_clip([PER_CHANNEL], TAU, num_heads=num_heads))
  match = "declares no heads" if num_heads in (None, 3) else r"max_logits\['attn/wq'\] has shape"
  with pytest.raises(ValueError, match=match):
    tx.update(jax.grad(loss_fn)(params, x), tx.init(params), params, max_logits=logits)


def test_a_non_finite_max_logit_leaves_its_head_alone():
  """γ = 1 for S = +inf or NaN (docs): those heads keep W_q and W_k bit for bit, finite;
  without the guard S = +inf gives γ = 0 (W_q NaN, W_k 0)."""
  params = make_params(4, 4, seed=2)
  tx = saggs.chain(optax.sgd(0.0), saggs.qk_clip([qk_pair(4)], TAU))
  s = jnp.array([jnp.inf, jnp.nan, 4 * TAU, TAU / 2])
  updates, _ = tx.update(params, tx.init(params), params, max_logits={"attn/wq": s})
  new = optax.apply_updates(params, updates)["attn"]
  for side in ("wq", "wk"):
    w, w0 = np.asarray(new[side]), np.asarray(params["attn"][side])
    assert np.all(np.isfinite(w)), side
    np.testing.assert_array_equal(w[:, : 2 * HD], w0[:, : 2 * HD], err_msg=side)  # heads 0, 1
    np.testing.assert_allclose(w[:, 2 * HD : 3 * HD], w0[:, 2 * HD : 3 * HD] / 2, rtol=1e-6)
