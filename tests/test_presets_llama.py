"""presets.llama's QK-norm and stacked-experts declarations on hand-written decoders: a Qwen3-
style layer (each head normalised over head_dim, one gain shared by the heads) and an OLMoE-
style one (one norm over the whole projection), both with RoPE and a top-k MoE of stacked
SwiGLU experts. Oracles: the model's logits (function invariance), and the rescaling each
declaration must apply, written by hand in NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import saggs_jax as saggs

D, HEADS, KV, HD, E, F, TOP_K, VOCAB = 16, 4, 2, 4, 3, 8, 2, 11


def _rms(x, w):
  return x * jax.lax.rsqrt(jnp.mean(x**2, -1, keepdims=True) + 1e-6) * w


def _ln(x, scale, bias):
  x = x - jnp.mean(x, -1, keepdims=True)
  return x * jax.lax.rsqrt(jnp.mean(x**2, -1, keepdims=True) + 1e-6) * scale + bias


def _rope(x):  # (T, heads, hd): halves rotated together
  t, hd = x.shape[0], x.shape[-1]
  angle = jnp.arange(t)[:, None, None] * 10000.0 ** (-jnp.arange(hd // 2) / (hd // 2))
  x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
  return jnp.concatenate([x1 * jnp.cos(angle) - x2 * jnp.sin(angle),
                          x2 * jnp.cos(angle) + x1 * jnp.sin(angle)], -1)  # fmt: skip


def _layer(p, x, qk_norm):
  t = x.shape[0]
  a = p["self_attn"]
  if "bias" in a["q_norm"]:  # Persimmon, StableLM: a LayerNorm with a bias, per head
    q = _ln((x @ a["q_proj"]["kernel"]).reshape(t, HEADS, HD), **a["q_norm"])
    k = _ln((x @ a["k_proj"]["kernel"]).reshape(t, KV, HD), **a["k_norm"])
  elif qk_norm == "head":  # Qwen3: per head over head_dim
    q = _rms((x @ a["q_proj"]["kernel"]).reshape(t, HEADS, HD), a["q_norm"]["scale"])
    k = _rms((x @ a["k_proj"]["kernel"]).reshape(t, KV, HD), a["k_norm"]["scale"])
  else:  # OLMoE: over the whole projection
    q = _rms(x @ a["q_proj"]["kernel"], a["q_norm"]["scale"]).reshape(t, HEADS, HD)
    k = _rms(x @ a["k_proj"]["kernel"], a["k_norm"]["scale"]).reshape(t, KV, HD)
  v = (x @ a["v_proj"]["kernel"]).reshape(t, KV, HD)
  q, k = _rope(q).reshape(t, KV, HEADS // KV, HD), _rope(k)
  s = jnp.einsum("tkgd,skd->kgts", q, k) + jnp.where(jnp.tri(t, dtype=bool), 0.0, -1e9)
  out = jnp.einsum("kgts,skd->tkgd", jax.nn.softmax(s, -1), v).reshape(t, -1)
  x = x + out @ a["o_proj"]["kernel"]
  m = p["mlp"]
  top, idx = jax.lax.top_k(jax.nn.softmax(x @ m["gate"]["kernel"], -1), TOP_K)
  weights = jnp.sum(jax.nn.one_hot(idx, E) * top[..., None], -2)
  e = m["experts"]
  h = jax.nn.silu(jnp.einsum("td,edf->tef", x, e["gate_proj"]["kernel"]))
  h = h * jnp.einsum("td,edf->tef", x, e["up_proj"]["kernel"])
  return x + jnp.einsum("te,tef,efd->td", weights, h, e["down_proj"]["kernel"])


def _model(qk_norm, layers=2, seed=0, norm_bias=False):
  rng = np.random.default_rng(seed)
  w = lambda *s: jnp.asarray(0.5 * rng.standard_normal(s), jnp.float32)  # noqa: E731
  g = lambda n: jnp.asarray(np.exp(0.3 * rng.standard_normal(n)), jnp.float32)  # noqa: E731
  width = HD if qk_norm == "head" else None
  params = {
    "embed": w(VOCAB, D),
    "layers": {
      str(i): {
        "self_attn": {
          "q_proj": {"kernel": w(D, HEADS * HD)},
          "k_proj": {"kernel": w(D, KV * HD)},
          "v_proj": {"kernel": w(D, KV * HD)},
          "o_proj": {"kernel": w(HEADS * HD, D)},
          "q_norm": {"scale": g(width or HEADS * HD)},
          "k_norm": {"scale": g(width or KV * HD)},
        },
        "mlp": {
          "gate": {"kernel": w(D, E)},
          "experts": {
            n: {"kernel": w(E, *s)}
            for n, s in (("gate_proj", (D, F)), ("up_proj", (D, F)), ("down_proj", (F, D)))
          },
        },
      }
      for i in range(layers)
    },
  }
  if norm_bias:
    for layer in params["layers"].values():
      for n in ("q_norm", "k_norm"):
        layer["self_attn"][n]["bias"] = w(width or HEADS * HD)

  def logits(p):
    x = p["embed"][jnp.arange(7) % VOCAB]
    for i in range(layers):
      x = _layer(p["layers"][str(i)], x, qk_norm)
    return x @ p["embed"].T

  return params, logits


def _pairs(qk_norm):
  return saggs.presets.llama(KV, qk_norm=qk_norm, mlp=False, experts="mlp/experts")


def _by_hand(params, qk_norm, cs):
  """The rescaling the declarations stand for, in NumPy: per layer, V/O per KV head, the
  QK-norm gains by one scalar ("head") or one factor per KV head's block ("all"), and each
  expert's up/down per channel."""
  out = jax.tree.map(np.array, params)
  for i, layer in out["layers"].items():
    c_vo, c_qk, c_e = cs[i]
    a, e = layer["self_attn"], layer["mlp"]["experts"]
    a["v_proj"]["kernel"] *= np.repeat(c_vo, HD)
    a["o_proj"]["kernel"] /= np.repeat(np.repeat(c_vo, HEADS // KV), HD)[:, None]
    if qk_norm == "head":
      a["q_norm"]["scale"] *= c_qk[0]
      a["k_norm"]["scale"] /= c_qk[0]
    else:
      a["q_norm"]["scale"] *= np.repeat(c_qk, HEADS // KV * HD)
      a["k_norm"]["scale"] /= np.repeat(c_qk, HD)
    e["up_proj"]["kernel"] *= c_e[:, None, :]
    e["down_proj"]["kernel"] /= c_e[:, :, None]
  return out


@pytest.mark.parametrize("qk_norm", ["head", "all"])
def test_llama_qk_norm_and_experts_are_exact(qk_norm):
  params, logits = _model(qk_norm)
  rng = np.random.default_rng(1)
  shapes = {"attention V/O": (KV,), "QK-norm gains": (1 if qk_norm == "head" else KV,),
            "expert up/down": (E, F)}  # fmt: skip
  cs = {i: [np.exp(rng.uniform(-1, 1, s)).astype(np.float32) for s in shapes.values()]
        for i in params["layers"]}  # fmt: skip
  names = [p.name for p in _pairs(qk_norm)]
  assert names == ["attention V/O", "QK-norm gains", "expert up/down"]

  def factor(path_a, shape):
    layer, kind = path_a.split("/")[1], names.index(_name(path_a))
    assert shape == shapes[_name(path_a)], (path_a, shape)
    return jnp.asarray(cs[layer][kind])

  moved, _ = saggs.reparameterize(params, None, _pairs(qk_norm), factor)
  want = _by_hand(params, qk_norm, cs)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), moved, want)
  with jax.default_matmul_precision("highest"):
    y0, y1 = np.asarray(logits(params)), np.asarray(logits(moved))
  assert np.max(np.abs(y1 - y0)) < 1e-5 * np.max(np.abs(y0))


def _name(path_a):
  return {"v_proj": "attention V/O", "q_norm": "QK-norm gains", "up_proj": "expert up/down"}[
    path_a.split("/")[-2]
  ]


def test_llama_qk_norm_per_channel_gains_are_not_exact():
  """Why "head" is one scalar: RoPE rotates channel j with j + hd/2, so a factor per gain
  channel changes the logits (the oracle above is not vacuous)."""
  params, logits = _model("head")
  bent = jax.tree.map(np.array, params)
  a = bent["layers"]["0"]["self_attn"]
  c = np.linspace(0.5, 2.0, HD).astype(np.float32)
  a["q_norm"]["scale"] *= c
  a["k_norm"]["scale"] /= c
  assert np.max(np.abs(logits(bent) - logits(params))) > 1e-2


def test_llama_qk_layernorm_with_a_bias_moves_the_bias_with_its_gain():
  """Persimmon/StableLM (issue 43, finding 11): q = γ n(x) + β. 'q_norm/*' also matched the
  bias as a pair of its own (two factors per layer: no symmetry), and is now refused;
  LlamaNames(qk_norm_bias="bias") makes it follow the gain. Oracle: one hard balancing keeps
  the logits, and moves gain and bias of each norm by the one scalar
  c = sqrt(||γ_k|| / ||γ_q||) computed here."""
  import optax

  params, logits = _model("head", norm_bias=True)
  for layer in params["layers"].values():  # k's norm 3x q's: something to balance
    layer["self_attn"]["k_norm"]["scale"] = 3.0 * layer["self_attn"]["k_norm"]["scale"]
  pairs = saggs.presets.llama(
    KV,
    qk_norm="head",
    names=saggs.presets.LlamaNames(qk_norm_bias="bias"),
    mlp=False,
    experts="mlp/experts",
  )
  tx = saggs.chain(optax.sgd(0.0), saggs.saggs(pairs))
  grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  balanced = jax.tree.map(np.asarray, optax.apply_updates(params, updates))
  for layer in params["layers"]:
    a, b = params["layers"][layer]["self_attn"], balanced["layers"][layer]["self_attn"]
    c = np.sqrt(np.linalg.norm(a["k_norm"]["scale"]) / np.linalg.norm(a["q_norm"]["scale"]))
    assert abs(np.log(c)) > 0.3  # there was something to balance
    for n, m in (("q_norm", c), ("k_norm", 1 / c)):
      for leaf in ("scale", "bias"):
        np.testing.assert_allclose(b[n][leaf], a[n][leaf] * m, rtol=1e-5, err_msg=f"{n}/{leaf}")
  with jax.default_matmul_precision("highest"):
    y0, y1 = np.asarray(logits(params)), np.asarray(logits(balanced))
  assert np.max(np.abs(y1 - y0)) < 1e-5 * np.max(np.abs(y0))
  toks = None  # logits reads no input: check_symmetry's apply_fn takes one
  assert max(saggs.check_symmetry(lambda p, _: logits(p), params, pairs, toks).values()) < 1e-5
  # The default gain pattern also catches the bias, which no factor of its own may move: it
  # is refused wherever the pairs meet the parameters, naming the bias and the fix.
  plain = saggs.presets.llama(KV, qk_norm="head", mlp=False, experts="mlp/experts")
  for meet in (
    lambda: saggs.chain(optax.sgd(0.0), saggs.saggs(plain)).init(params),
    lambda: saggs.check_symmetry(lambda p, _: logits(p), params, plain, toks),
  ):
    with pytest.raises(ValueError, match=r"q_norm/\*'.*matches the bias 'layers/0/.*qk_norm_bias"):
      meet()
  with pytest.raises(ValueError, match="would also match the bias"):
    saggs.presets.llama(
      KV, qk_norm="head", names=saggs.presets.LlamaNames(qk_norm_bias="bias", qk_norm_gain="*")
    )


def test_llama_experts_of_scanned_layers():
  """Scanned layers (L, E, d, F): the expert axis follows the layer axis; with MaxText's
  layer axis at 1, (E, L, d, F), it leads."""
  for stacked, shape in ((1, (2, E, D, F)), ((1,), (E, 2, D, F))):
    params = {"mlp": {"experts": {
      "up_proj": {"kernel": jnp.ones(shape)},
      "down_proj": {"kernel": jnp.ones(shape[:2] + (F, D))},
    }}}  # fmt: skip
    (pair,) = saggs.presets.llama(KV, mlp=False, experts="mlp/experts", stacked=stacked)[2:]
    assert pair.stacked == (0, 1)
    seen = []

    def factor(_, s, seen=seen):
      seen.append(s)
      return jnp.ones(s)

    saggs.reparameterize(params, None, [pair], factor)
    assert seen == [shape[:2] + (F,)]


def test_llama_bare_expert_leaves_and_bad_qk_norm():
  (pair,) = saggs.presets.llama(KV, mlp=False, experts="mlp/experts", expert_leaf=None)[2:]
  assert (pair.a, pair.b) == ("mlp/experts/up_proj", "mlp/experts/down_proj")
  with pytest.raises(ValueError, match="qk_norm must be None, 'head' or 'all', got 'per_head'"):
    saggs.presets.llama(KV, qk_norm="per_head")
