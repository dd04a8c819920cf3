"""Tiny plain-JAX models of the layouts ``saggs.discover`` got wrong on third-party models
(issue 44), each one layer, a few heads, width 8-16, with its exact symmetries stated:

* ``bloom``: a fused QKV kernel whose columns interleave per head, ``[q_0 k_0 v_0 q_1 ...]``
  (BLOOM's ``query_key_value``): Q/K per channel and V/O per head are exact on the q, k and
  v columns of each head;
* ``dead``: an untied LM head in a model that also computes, and discards, a product with
  the embedding (a logit never returned): the final norm's gain pairs with the head;
* ``partial_rope``: rotary embedding on the first ``r`` dims of each head, the rest passed
  through (GPT-J's ``rotary_dim``): Q/K is exact with a factor per head and part (the
  rotated and the passed dims apart) when ``r`` divides the head size;
* ``mla``: DeepSeek's multi-head latent attention: each head's non-rotary query dims pair
  with its non-rotary key dims in ``wkv_b``; the rotary parts stay (the key's is shared).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

D, V, T = 16, 16, 6  # width, vocabulary, tokens


def tokens(seed: int = 0):
  return jnp.asarray(np.random.default_rng(700 + seed).integers(0, V, (2, T)), jnp.int32)


def _dense(rng, *shape):
  return rng.standard_normal(shape) / np.sqrt(shape[0])


def _rms_norm(x, scale):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def _causal_softmax(logits):
  t = logits.shape[-1]
  return jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9))


def _float32(tree):
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def _rotate_half(x, dims):
  """Rotary embedding of pairs ``(i, i + dims/2)`` on the first ``dims`` of the last axis of
  ``x`` (batch, tokens, heads, dims)."""
  half = dims // 2
  angle = np.arange(x.shape[1])[:, None] / 100.0 ** (np.arange(half) / half)
  cos, sin = (jnp.asarray(f(angle)[None, :, None, :], jnp.float32) for f in (np.cos, np.sin))
  a, b = x[..., :half], x[..., half:dims]
  return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


# ---------------------------------------------------------------------------
# BLOOM: fused QKV interleaved per head.

BLOOM_H, BLOOM_HD = 2, 4


def bloom_init(seed: int = 0):
  rng = np.random.default_rng(seed)
  h, hd = BLOOM_H, BLOOM_HD
  return _float32(
    {
      "embed": rng.standard_normal((V, D)),
      "ln": {"scale": 1 + 0.1 * rng.standard_normal(D)},
      "attn": {
        "qkv": {
          "kernel": _dense(rng, D, 3 * h * hd),
          "bias": 0.1 * rng.standard_normal(3 * h * hd),
        },
        "o": {"kernel": _dense(rng, h * hd, D)},
      },
      "ln_f": {"scale": 1 + 0.1 * rng.standard_normal(D)},
      "head": {"kernel": _dense(rng, D, V)},
    }
  )


def bloom_forward(params, tokens):
  """One BLOOM-style layer: the fused output axis read as (heads, 3, head_dim)."""
  x = params["embed"][tokens]
  b, t, _ = x.shape
  a = params["attn"]
  qkv = _rms_norm(x, params["ln"]["scale"]) @ a["qkv"]["kernel"] + a["qkv"]["bias"]
  qkv = qkv.reshape(b, t, BLOOM_H, 3, BLOOM_HD)
  q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
  w = _causal_softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(BLOOM_HD))
  x = x + jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, -1) @ a["o"]["kernel"]
  return _rms_norm(x, params["ln_f"]["scale"]) @ params["head"]["kernel"]


def bloom_columns(part: int) -> np.ndarray:
  """The fused axis's columns of ``part`` (0 q, 1 k, 2 v), head by head."""
  h, hd = BLOOM_H, BLOOM_HD
  return np.arange(3 * h * hd).reshape(h, 3, hd)[:, part].ravel()


# ---------------------------------------------------------------------------
# An untied head beside a discarded product with the embedding.

DEAD_F = 24


def dead_init(seed: int = 0):
  rng = np.random.default_rng(seed)
  return _float32(
    {
      "embed": rng.standard_normal((V, D)),
      "mlp": {"up": _dense(rng, D, DEAD_F), "down": _dense(rng, DEAD_F, D)},
      "final_norm": {"scale": 1 + 0.1 * rng.standard_normal(D)},
      "head": _dense(rng, D, V),
    }
  )


def dead_forward(params, tokens):
  """Embedding, a ReLU MLP, an untied head; the embedding's own logits of the normed output
  (tied-head logits a port kept for comparison) are computed and thrown away."""
  emb = params["embed"]
  x = emb[tokens]
  x = x + jax.nn.relu(x @ params["mlp"]["up"]) @ params["mlp"]["down"]
  h = _rms_norm(x, params["final_norm"]["scale"])
  _ = h @ emb.T  # dead: never returned
  return h @ params["head"]


# ---------------------------------------------------------------------------
# Partial rotary embedding (GPT-J's rotary_dim).

PR_H, PR_HD = 2, 8


def partial_rope_init(seed: int = 0):
  rng = np.random.default_rng(seed)
  h, hd = PR_H, PR_HD
  return _float32(
    {
      "embed": rng.standard_normal((V, D)),
      "attn": {
        "q": _dense(rng, D, h * hd),
        "k": _dense(rng, D, h * hd),
        "v": _dense(rng, D, h * hd),
        "o": _dense(rng, h * hd, D),
      },
      "head": _dense(rng, D, V),
    }
  )


def partial_rope_forward(params, tokens, rotary=4):
  """One attention layer whose first ``rotary`` dims of each head are rotated."""
  x = params["embed"][tokens]
  b, t, _ = x.shape
  a = params["attn"]

  def heads(w, rotated):
    y = (x @ w).reshape(b, t, PR_H, PR_HD)
    return jnp.concatenate([_rotate_half(y, rotary), y[..., rotary:]], -1) if rotated else y

  q, k, v = heads(a["q"], True), heads(a["k"], True), heads(a["v"], False)
  w = _causal_softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(PR_HD))
  x = x + jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, -1) @ a["o"]
  return x @ params["head"]


# ---------------------------------------------------------------------------
# DeepSeek's multi-head latent attention (MaxText's layout: query (d, heads, nope + rope),
# wkv_a (d, rank + rope), wkv_b (rank, heads, nope + v), out (heads, v, d)).

MLA_H, MLA_NOPE, MLA_ROPE, MLA_V, MLA_RANK = 2, 4, 4, 4, 8


def mla_init(seed: int = 0):
  rng = np.random.default_rng(seed)
  h, nope, rope, v, rank = MLA_H, MLA_NOPE, MLA_ROPE, MLA_V, MLA_RANK
  return _float32(
    {
      "embed": rng.standard_normal((V, D)),
      "attn": {
        "query": _dense(rng, D, h, nope + rope),
        "wkv_a": _dense(rng, D, rank + rope),
        "kv_norm": {"scale": 1 + 0.1 * rng.standard_normal(rank)},
        "wkv_b": _dense(rng, rank, h, nope + v),
        "out": _dense(rng, h, v, D) / np.sqrt(h),
      },
      "head": _dense(rng, D, V),
    }
  )


def mla_forward(params, tokens):
  """One MLA layer: each head's query is its non-rotary dims then its rotary ones; its key is
  the latent's non-rotary dims for that head then one rotary key shared by every head."""
  x = params["embed"][tokens]
  b, t, _ = x.shape
  a, nope, rank = params["attn"], MLA_NOPE, MLA_RANK
  q = jnp.einsum("btd,dhk->bthk", x, a["query"])
  query = jnp.concatenate([q[..., :nope], _rotate_half(q[..., nope:], MLA_ROPE)], -1)
  kv_a = x @ a["wkv_a"]
  latent = _rms_norm(kv_a[..., :rank], a["kv_norm"]["scale"])
  k_pe = _rotate_half(kv_a[:, :, None, rank:], MLA_ROPE)
  kv = jnp.einsum("btr,rhk->bthk", latent, a["wkv_b"])
  key = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_pe, (b, t, MLA_H, MLA_ROPE))], -1)
  w = _causal_softmax(jnp.einsum("bqhd,bkhd->bhqk", query, key) / np.sqrt(nope + MLA_ROPE))
  out = jnp.einsum("bhqk,bkhd->bqhd", w, kv[..., nope:])
  x = x + jnp.einsum("bqhd,hde->bqe", out, a["out"])
  return x @ params["head"]
