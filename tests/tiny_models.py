"""A tiny LLaMA-style Transformer as a pure function of a params dict, for tests.

Pre-norm blocks with RMSNorm, grouped-query attention with RoPE and a SwiGLU
MLP; Dense kernels are (in, out). Leaf names follow ``saggs.presets.llama``
(``layers/0/attn/q_proj/kernel``, ``layers/0/mlp/up_proj/kernel``, ...), so
``pairs(config)`` declares every exact symmetry of the model. With
``stacked=True`` the layers form one tree with a leading layer axis, run with
``lax.scan`` (the scanned-layers layout).

The task is learnable and deterministic: each sequence counts up from a
random start with a random stride modulo the vocabulary, so attention has to
read the stride from the context.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

import saggs_jax as saggs


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 16
  d_model: int = 16
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 4
  mlp_hidden: int = 24
  stacked: bool = False


def pairs(config: Config) -> list[saggs.Pair]:
  """Q/K and V/O per KV head, SwiGLU up/down per channel."""
  return saggs.presets.llama(config.num_kv_heads, stacked=int(config.stacked))


def init(seed: int, c: Config) -> dict:
  """Random float32 parameters, drawn with NumPy: eager JAX ops would compile per shape."""
  rng = np.random.default_rng(seed)

  def dense(d_in, d_out):
    return rng.normal(size=(d_in, d_out)) / np.sqrt(d_in)

  def layer():
    d, q_dim, kv_dim = c.d_model, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "attn_norm": {"scale": np.ones(d)},
        "attn": {"q_proj": {"kernel": dense(d, q_dim)}, "k_proj": {"kernel": dense(d, kv_dim)},
                 "v_proj": {"kernel": dense(d, kv_dim)}, "o_proj": {"kernel": dense(q_dim, d)}},
        "mlp_norm": {"scale": np.ones(d)},
        "mlp": {"gate_proj": {"kernel": dense(d, c.mlp_hidden)},
                "up_proj": {"kernel": dense(d, c.mlp_hidden)},
                "down_proj": {"kernel": dense(c.mlp_hidden, d)}},
    }

  layers = [layer() for _ in range(c.num_layers)]
  if c.stacked:
    layers = jax.tree.map(lambda *xs: np.stack(xs), *layers)
  else:
    layers = {str(i): x for i, x in enumerate(layers)}
  params = {"embed": rng.normal(size=(c.vocab, c.d_model)),
            "layers": layers,
            "final_norm": {"scale": np.ones(c.d_model)},
            "lm_head": {"kernel": dense(c.d_model, c.vocab)}}
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)


def _rms_norm(x, p):
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6) * p["scale"]


def _rope(x):
  """Rotates pairs (i, i + hd/2) of x (batch, seq, heads, hd) by position-dependent angles."""
  seq_len, hd = x.shape[1], x.shape[-1]
  angles = jnp.arange(seq_len)[:, None] * 100.0 ** (-jnp.arange(hd // 2) * 2 / hd)
  cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _attention(x, p, c: Config):
  b, t, _ = x.shape
  q = _rope((x @ p["q_proj"]["kernel"]).reshape(b, t, c.num_heads, c.head_dim))
  k = _rope((x @ p["k_proj"]["kernel"]).reshape(b, t, c.num_kv_heads, c.head_dim))
  v = (x @ p["v_proj"]["kernel"]).reshape(b, t, c.num_kv_heads, c.head_dim)
  # Query head h reads KV head h // (heads / kv_heads): contiguous blocks, as the pairs assume.
  rep = c.num_heads // c.num_kv_heads
  k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(c.head_dim)
  logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf)
  out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v)
  return out.reshape(b, t, -1) @ p["o_proj"]["kernel"]


def _mlp(x, p):
  gate = jax.nn.silu(x @ p["gate_proj"]["kernel"])
  return (gate * (x @ p["up_proj"]["kernel"])) @ p["down_proj"]["kernel"]


def _block(x, p, c: Config):
  x = x + _attention(_rms_norm(x, p["attn_norm"]), p["attn"], c)
  return x + _mlp(_rms_norm(x, p["mlp_norm"]), p["mlp"])


def apply(params: dict, tokens: jax.Array, c: Config) -> jax.Array:
  """Logits (batch, seq, vocab) for int tokens (batch, seq)."""
  x = params["embed"][tokens]
  if c.stacked:
    x, _ = jax.lax.scan(lambda h, p: (_block(h, p, c), None), x, params["layers"])
  else:
    for i in range(c.num_layers):
      x = _block(x, params["layers"][str(i)], c)
  return _rms_norm(x, params["final_norm"]) @ params["lm_head"]["kernel"]


def loss(params: dict, batch: jax.Array, c: Config) -> jax.Array:
  """Mean next-token cross-entropy over windows (batch, seq + 1)."""
  logits = apply(params, batch[:, :-1], c)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def jit(fn, **kwargs):
  """``jax.jit`` without LLVM optimisation: for models this small, compiling costs more
  than running (several seconds per function on a busy CPU otherwise)."""
  return jax.jit(fn, compiler_options={"xla_backend_optimization_level": 0}, **kwargs)


def batches(seed: int, num: int, c: Config, batch_size: int = 8, seq_len: int = 8
            ) -> jax.Array:
  """(num, batch_size, seq_len + 1) int32 windows of strided counting modulo vocab."""
  rng = np.random.default_rng(seed)
  start = rng.integers(0, c.vocab, (num, batch_size, 1))
  stride = rng.integers(1, 4, (num, batch_size, 1))
  return jnp.asarray((start + stride * np.arange(seq_len + 1)) % c.vocab, jnp.int32)
