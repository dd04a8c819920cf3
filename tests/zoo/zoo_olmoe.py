"""An OLMoE-style MoE decoder in plain JAX, from Hugging Face's ``OlmoeForCausalLM`` semantics
(EasyDeL 0.3.0 has no OLMoE): RMSNorm gains, q/k/v/o without biases, QK-norm over the whole
q (and k) projection, RoPE (halves rotated together), GQA, and a top-k MoE block: a router
``mlp/gate`` (d, E) whose softmax feeds ``lax.top_k``, experts stacked (E, d, F) with SwiGLU,
combined by the top-k probabilities (``norm_topk_prob=False``).
"""

import jax
import jax.numpy as jnp
import numpy as np

import saggs_jax as saggs
from zoo_models import make_zoo, tokens

VOCAB, D, F, LAYERS, HEADS, KV, EXPERTS, TOP_K = 64, 32, 24, 2, 4, 2, 4, 2
HD = D // HEADS
INIT = 0.3


def _rms(x, w, eps=1e-6):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32**2, -1, keepdims=True) + eps)).astype(x.dtype) * w


def _rope(x):  # (B, T, heads, hd)
  t, hd = x.shape[1], x.shape[-1]
  freq = 10000.0 ** (-jnp.arange(hd // 2) / (hd // 2))
  angle = (jnp.arange(t)[:, None] * freq)[None, :, None, :]
  x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def init(seed=0):
  rng = np.random.default_rng(seed)
  normal = lambda *s: jnp.asarray(INIT * rng.standard_normal(s), jnp.float32)
  gain = lambda n: jnp.asarray(np.exp(0.3 * rng.standard_normal(n)), jnp.float32)
  layers = {}
  for i in range(LAYERS):
    layers[str(i)] = {
      "input_layernorm": {"weight": gain(D)},
      "self_attn": {
        "q_proj": {"kernel": normal(D, HEADS * HD)},
        "k_proj": {"kernel": normal(D, KV * HD)},
        "v_proj": {"kernel": normal(D, KV * HD)},
        "o_proj": {"kernel": normal(HEADS * HD, D)},
        "q_norm": {"weight": gain(HEADS * HD)},
        "k_norm": {"weight": gain(KV * HD)},
      },
      "post_attention_layernorm": {"weight": gain(D)},
      "mlp": {
        "gate": {"kernel": normal(D, EXPERTS)},
        "experts": {
          "gate_proj": normal(EXPERTS, D, F),
          "up_proj": normal(EXPERTS, D, F),
          "down_proj": normal(EXPERTS, F, D),
        },
      },
    }
  return {
    "model": {
      "embed_tokens": {"embedding": normal(VOCAB, D)},
      "layers": layers,
      "norm": {"weight": gain(D)},
    },
    "lm_head": {"kernel": normal(D, VOCAB)},
  }


def _attention(p, x):
  b, t, _ = x.shape
  q = _rms(x @ p["q_proj"]["kernel"], p["q_norm"]["weight"]).reshape(b, t, HEADS, HD)
  k = _rms(x @ p["k_proj"]["kernel"], p["k_norm"]["weight"]).reshape(b, t, KV, HD)
  v = (x @ p["v_proj"]["kernel"]).reshape(b, t, KV, HD)
  q, k = _rope(q), _rope(k)
  q = q.reshape(b, t, KV, HEADS // KV, HD)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k) / jnp.sqrt(HD)
  scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
  out = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(scores, -1), v).reshape(b, t, -1)
  return out @ p["o_proj"]["kernel"]


def _moe(p, x):
  probs = jax.nn.softmax(x @ p["gate"]["kernel"], axis=-1)  # (B, T, E)
  top, idx = jax.lax.top_k(probs, TOP_K)
  weights = jnp.sum(jax.nn.one_hot(idx, EXPERTS, dtype=x.dtype) * top[..., None], -2)
  e = p["experts"]
  h = jax.nn.silu(jnp.einsum("btd,edf->btef", x, e["gate_proj"])) * jnp.einsum(
    "btd,edf->btef", x, e["up_proj"]
  )
  return jnp.einsum("bte,btef,efd->btd", weights, h, e["down_proj"])


def apply(params, ids):
  m = params["model"]
  x = m["embed_tokens"]["embedding"][ids]
  for i in range(LAYERS):
    p = m["layers"][str(i)]
    x = x + _attention(p["self_attn"], _rms(x, p["input_layernorm"]["weight"]))
    x = x + _moe(p["mlp"], _rms(x, p["post_attention_layernorm"]["weight"]))
  return _rms(x, m["norm"]["weight"]) @ params["lm_head"]["kernel"]


def expected() -> list:
  """V/O per KV head; the q_norm/k_norm gains per KV head (a scalar per head commutes with
  RoPE; q's heads 2g, 2g+1 read KV head g); per expert, SwiGLU up/down per channel; each gain
  against the rows of the linears that read it (the router among them); the final gain against
  the LM head. Q/K kernels are moot under QK-norm (not listed)."""
  attn, e = "self_attn/", "mlp/experts/"
  return [
    saggs.Pair(attn + "v_proj/kernel", attn + "o_proj/kernel", axes=(1, 0), groups=KV),
    saggs.Pair(attn + "q_norm/weight", attn + "k_norm/weight", axes=(0, 0), groups=KV),
    saggs.Pair(e + "up_proj", e + "down_proj", axes=(1, 0), stacked=1),
    saggs.Pair(
      "input_layernorm/weight", tuple(attn + f"{x}_proj/kernel" for x in "qkv"), axes=(0, 0)
    ),
    saggs.Pair(
      "post_attention_layernorm/weight",
      ("mlp/gate/kernel", e + "gate_proj", e + "up_proj"),
      axes=(0, (0, 1, 1)),
    ),
    saggs.Pair("model/norm/weight", "lm_head/kernel", axes=(0, 0)),
  ]


def not_symmetries() -> list:
  e = "mlp/experts/"
  return [saggs.Pair(e + "gate_proj", e + "down_proj", axes=(1, 0), stacked=1)]


# role -> the leaves it names, from the architecture
ROLES = {
  "embedding": ("model/embed_tokens/embedding",),
  "lm_head": ("lm_head/kernel",),
  "query": ("self_attn/q_proj/kernel",),
  "key_value": ("self_attn/k_proj/kernel", "self_attn/v_proj/kernel"),
  "output": ("self_attn/o_proj/kernel",),
  "router": ("mlp/gate/kernel",),
  "experts": ("mlp/experts/gate_proj", "mlp/experts/up_proj", "mlp/experts/down_proj"),
}


def zoo():
  params = init()
  return make_zoo("plain JAX OLMoE-style", apply, params, (tokens(),), expected, not_symmetries)
