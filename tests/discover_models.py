"""Small models for the tests of ``saggs.discover``, each with the symmetries it has.

* the example LLaMA of ``harness.lm`` (flax.nnx: RMSNorm, GQA with RoPE,
  SwiGLU), per layer and with its blocks stacked and run by ``nnx.scan``;
* a GPT-2-style decoder (LayerNorm, attention with biases, GELU MLP);
* a GeGLU MLP;
* a mixture-of-experts block: a router and ReLU experts stacked on one axis;
* a model whose LM head is its embedding, transposed (tied weights);
* an MLP with a LayerNorm between its two linears.

The LLaMA with QK-norm and the Flax attention models come from ``models``.
Weights are drawn with NumPy; every model is tiny (d <= 32, 2 layers, 8 tokens).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from harness import lm
from models import random_like

# ---------------------------------------------------------------------------
# The example LLaMA (harness.lm), per layer and scanned.

LM_CONFIG = lm.ModelConfig(
  d_model=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, mlp_hidden=24, seq_len=8
)


class ScannedLM(nnx.Module):
  """``lm.LM`` with its blocks stacked on a leading layer axis and run by ``nnx.scan``."""

  def __init__(self, config: lm.ModelConfig, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(lm.VOCAB_SIZE, config.d_model, rngs=rngs)

    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return lm.Block(config, rngs=rngs)

    self.layers = blocks(rngs)
    self.final_norm = nnx.RMSNorm(config.d_model, epsilon=config.norm_eps, rngs=rngs)
    self.lm_head = nnx.Linear(config.d_model, lm.VOCAB_SIZE, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x, block):
      return block(x)

    return self.lm_head(self.final_norm(run(self.embed(tokens), self.layers)))


def nnx_lm(scanned: bool, seed: int = 0):
  """``(forward, params)``: a pure forward of the example LLaMA and random params (nnx.State)."""
  make = (
    (lambda: ScannedLM(LM_CONFIG, rngs=nnx.Rngs(0)))
    if scanned
    else (lambda: lm.LM(LM_CONFIG, rngs=nnx.Rngs(0)))
  )
  graphdef, state = nnx.split(nnx.eval_shape(make), nnx.Param)
  params = random_like(state, seed, scale=0.5)

  def forward(params, tokens):
    return nnx.merge(graphdef, params)(tokens)

  return forward, params


def lm_tokens(seed: int = 0):
  return jnp.asarray(np.random.default_rng(300 + seed).integers(0, 256, (2, 8)), jnp.int32)


# ---------------------------------------------------------------------------
# Pure-function models on params dicts. D model width, H heads of size HD.

D, H, HD, F, V = 16, 2, 8, 32, 16


def _draw(rng, tree):
  """Normal float32 leaves for a tree of shapes; gains around 1."""

  def leaf(path, shape):
    name = jax.tree_util.keystr(path)
    base = 1.0 if "scale" in name else 0.0
    return jnp.asarray(
      base + rng.standard_normal(shape) / np.sqrt(shape[0] if "kernel" in name else 4), jnp.float32
    )

  return jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=lambda x: isinstance(x, tuple))


def _layer_norm(x, p):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def _dense(x, p):
  return x @ p["kernel"] + p["bias"] if "bias" in p else x @ p["kernel"]


def gpt2_init(seed: int = 0, layers: int = 2):
  shapes = {
    "wte": {"embedding": (V, D)},
    "wpe": {"embedding": (8, D)},
    "ln_f": {"scale": (D,), "bias": (D,)},
    "lm_head": {"kernel": (D, V)},
  }
  for i in range(layers):
    dense = lambda a, b: {"kernel": (a, b), "bias": (b,)}  # noqa: E731
    shapes[f"h_{i}"] = {
      "ln_1": {"scale": (D,), "bias": (D,)},
      "ln_2": {"scale": (D,), "bias": (D,)},
      "attn": {
        "q": dense(D, H * HD),
        "k": dense(D, H * HD),
        "v": dense(D, H * HD),
        "proj": dense(H * HD, D),
      },
      "mlp": {"fc": dense(D, F), "proj": dense(F, D)},
    }
  return _draw(np.random.default_rng(seed), shapes)


def _gpt2_attention(x, p):
  b, t, _ = x.shape
  q, k, v = (_dense(x, p[n]).reshape(b, t, H, HD) for n in ("q", "k", "v"))
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HD)
  logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
  out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v)
  return _dense(out.reshape(b, t, H * HD), p["proj"])


def gpt2_forward(params, tokens):
  """GPT-2 layout: LayerNorm, attention with biases, GELU MLP, pre-norm; untied head."""
  x = params["wte"]["embedding"][tokens] + params["wpe"]["embedding"][: tokens.shape[1]]
  for i in range(sum(k.startswith("h_") for k in params)):
    p = params[f"h_{i}"]
    x = x + _gpt2_attention(_layer_norm(x, p["ln_1"]), p["attn"])
    x = x + _dense(jax.nn.gelu(_dense(_layer_norm(x, p["ln_2"]), p["mlp"]["fc"])), p["mlp"]["proj"])
  return _dense(_layer_norm(x, params["ln_f"]), params["lm_head"])


def tokens(seed: int = 0):
  return jnp.asarray(np.random.default_rng(400 + seed).integers(0, V, (2, 8)), jnp.int32)


E = 4  # experts


def moe_init(seed: int = 0):
  return _draw(
    np.random.default_rng(seed),
    {
      "norm": {"scale": (D,)},
      "router": {"kernel": (D, E)},
      "experts": {"w_up": (E, D, F), "w_down": (E, F, D)},
    },
  )


def moe_forward(params, x):
  """A pre-norm MoE block with dense softmax routing: every expert runs, weighted per token."""
  h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * params["norm"]["scale"]
  gates = jax.nn.softmax(h @ params["router"]["kernel"])  # (b, t, E)
  e = params["experts"]
  up = jax.nn.relu(jnp.einsum("btd,edf->ebtf", h, e["w_up"]))
  out = jnp.einsum("ebtf,efd->ebtd", up, e["w_down"])
  return x + jnp.einsum("ebtd,bte->btd", out, gates)


def inputs(seed: int = 0):
  return jnp.asarray(np.random.default_rng(500 + seed).standard_normal((2, 8, D)), jnp.float32)


def tied_init(seed: int = 0):
  return _draw(
    np.random.default_rng(seed),
    {
      "embed": {"embedding": (V, D)},
      "mlp_norm": {"scale": (D,)},
      "mlp": {"up": {"kernel": (D, F)}, "down": {"kernel": (F, D)}},
      "final_norm": {"scale": (D,)},
    },
  )


def _rms_norm(x, p):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["scale"]


def tied_forward(params, tokens):
  """Embedding, one ReLU MLP block, and logits from the embedding matrix transposed."""
  emb = params["embed"]["embedding"]
  x = emb[tokens]
  m = params["mlp"]
  x = x + _dense(jax.nn.relu(_dense(_rms_norm(x, params["mlp_norm"]), m["up"])), m["down"])
  return _rms_norm(x, params["final_norm"]) @ emb.T


def geglu_init(seed: int = 0):
  return _draw(
    np.random.default_rng(seed),
    {"gate": {"kernel": (D, F)}, "up": {"kernel": (D, F)}, "down": {"kernel": (F, D)}},
  )


def geglu_forward(params, x):
  """``down(gelu(gate(x)) * up(x))`` with the exact (erf) GELU."""
  gate = jax.nn.gelu(_dense(x, params["gate"]), approximate=False)
  return _dense(gate * _dense(x, params["up"]), params["down"])


def norm_between_init(seed: int = 0):
  return _draw(
    np.random.default_rng(seed),
    {
      "up": {"kernel": (D, F), "bias": (F,)},
      "norm": {"scale": (F,), "bias": (F,)},
      "down": {"kernel": (F, D)},
    },
  )


def norm_between_forward(params, x):
  """``down(relu(LayerNorm(up(x))))``: up is scale-invariant, its gain pairs with down."""
  return _dense(jax.nn.relu(_layer_norm(_dense(x, params["up"]), params["norm"])), params["down"])


# ---------------------------------------------------------------------------
# Flax attention alone, Linen and NNX, biases included: exactly presets.flax_mha().


def linen_mha():
  """``(forward, params, x)`` of a bare ``nn.MultiHeadDotProductAttention``."""
  model = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
  x = inputs()[..., :8]
  params = random_like(jax.eval_shape(model.init, jax.random.PRNGKey(0), x), 1, scale=0.5)
  return model.apply, params, x


def nnx_mha():
  """``(forward, params, x)`` of a bare ``nnx.MultiHeadAttention``."""
  make = lambda: nnx.MultiHeadAttention(
    num_heads=2,
    in_features=8,
    qkv_features=8,  # noqa: E731
    decode=False,
    rngs=nnx.Rngs(0),
  )
  graphdef, state = nnx.split(nnx.eval_shape(make), nnx.Param)

  def forward(params, x):
    return nnx.merge(graphdef, params)(x)

  return forward, random_like(state, 2, scale=0.5), inputs()[..., :8]


def blind_to_reasons(monkeypatch) -> None:
  """Makes discover's jaxpr reading forget what a factor passed through, so that only the
  numerical confirmation can refute a candidate (the tests of that check)."""
  from saggs_jax._src.discovery import candidates

  follow = candidates.propagation.follow

  def blind(*args):
    trace = follow(*args)
    return trace._replace(reaches=tuple(r._replace(reasons=frozenset()) for r in trace.reaches))

  monkeypatch.setattr(candidates.propagation, "follow", blind)


def rope(x):
  """Rotate-half RoPE on (batch, tokens, heads, head_dim)."""
  half = x.shape[-1] // 2
  angle = np.arange(x.shape[1])[:, None] / 100.0 ** (np.arange(half) / half)
  cos, sin = (jnp.asarray(f(angle)[None, :, None, :], jnp.float32) for f in (np.cos, np.sin))
  a, b = x[..., :half], x[..., half:]
  return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
