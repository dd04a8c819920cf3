"""Tiny decoders written the way MaxText and EasyDeL write theirs, for ``saggs.discover``.

Each construct is reproduced as those trainers emit it, in plain JAX on params dicts named
like MaxText's tree (``query/kernel`` (d, heads, head_dim), ``out/kernel`` (heads, head_dim,
d), ``mlp/wi_0``/``wi_1``/``wo``, ``MoeBlock_0/gate`` and stacked ``wi_0``/``wi_1``/``wo``):

* every projection wrapped in ``jax.ad_checkpoint.checkpoint_name`` (remat policies), each
  layer's input behind ``lax.optimization_barrier``;
* MaxText's RMSNorm: the gain as ``scale + 0.0`` (its ``scale_offset``), applied by an einsum
  ``"...k,k->...k"`` (a ``dot_general`` with batch dimensions only); Gemma's ``(1 + w)``;
* Qwen3's QK-norm (an RMSNorm per head on q and k, its own gains), RoPE (rotate-half), GQA;
* gpt-oss: q/k/v/o biases, attention sinks (one logit per head concatenated to the scores,
  dropped after the softmax), an MoE with a router bias and expert biases;
* an OLMoE/mixtral-style MoE: ``softmax(x @ gate)``, ``lax.top_k``, the experts run densely
  and combined by one-hot weights (``moe="dense"``; ``"combined"``: weighted and summed by
  the down projection's own product, as Hugging Face's OLMoE einsum does), gathered by
  ``jnp.take`` on the chosen indices (``"take"``), or run on the tokens sorted by expert by
  ``lax.ragged_dot`` (``"ragged"``, as EasyDeL's gpt-oss);
* Gemma 3's GeGLU MLP.

Weights are drawn with NumPy; d = 16, 4 heads of 4 (2 KV heads), 2 layers, 8 tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

D, H, KV, HD, F, V, E, K = 16, 4, 2, 4, 24, 32, 4, 2


class Arch(NamedTuple):
  qk_norm: bool = False  # Qwen3 / Gemma 3 / OLMoE
  gemma: bool = False  # (1 + w) norm gains and a GeGLU MLP
  biases: bool = False  # gpt-oss: q/k/v/o biases, attention sinks, router and expert biases
  moe: str | None = None  # "dense", "combined", "take" or "ragged": an MoE block for the MLP
  deepseek: bool = False  # with moe: layer 0 a dense MLP, the others add a shared expert of F/2
  layers: int = 2
  scan_axis: int | None = None  # layers stacked on this axis of every leaf and run by lax.scan


def init(arch: Arch, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)

  def w(*shape, fan_in=None, base=0.0):
    scale = 1 / np.sqrt(fan_in or shape[0])
    return jnp.asarray(base + rng.standard_normal(shape) * scale, jnp.float32)

  gain = 0.0 if arch.gemma else 1.0  # Gemma's gains are stored as w in (1 + w)

  def dense(width):
    return {
      "wi_0": {"kernel": w(D, width)},
      "wi_1": {"kernel": w(D, width)},
      "wo": {"kernel": w(width, D)},
    }

  def layer(i):
    p = {
      "pre_self_attention_norm": {"scale": w(D, fan_in=16, base=gain)},
      "post_self_attention_norm": {"scale": w(D, fan_in=16, base=gain)},
      "self_attention": {
        "query": {"kernel": w(D, H, HD)},
        "key": {"kernel": w(D, KV, HD)},
        "value": {"kernel": w(D, KV, HD)},
        "out": {"kernel": w(H, HD, D, fan_in=H * HD)},
      },
    }
    att = p["self_attention"]
    if arch.qk_norm:
      att["query_norm"] = {"scale": w(HD, fan_in=16, base=gain)}
      att["key_norm"] = {"scale": w(HD, fan_in=16, base=gain)}
    if arch.biases:
      for name, heads in (("query", H), ("key", KV), ("value", KV)):
        att[name]["bias"] = w(heads, HD, fan_in=16)
      att["out"]["bias"] = w(D, fan_in=16)
      att["sinks"] = w(H, fan_in=1)
    if arch.moe and not (arch.deepseek and i == 0):
      moe = {
        "gate": {"kernel": w(D, E)},
        "wi_0": w(E, D, F, fan_in=D),
        "wi_1": w(E, D, F, fan_in=D),
        "wo": w(E, F, D, fan_in=F),
      }
      if arch.biases:
        moe["gate"]["bias"] = w(E, fan_in=16)
        moe["wi_0_bias"], moe["wi_1_bias"] = w(E, F, fan_in=16), w(E, F, fan_in=16)
        moe["wo_bias"] = w(E, D, fan_in=16)
      if arch.deepseek:
        moe["shared_experts"] = dense(F // 2)
      p["MoeBlock_0"] = moe
    else:
      p["mlp"] = dense(F)
    return p

  layers = {str(i): layer(i) for i in range(arch.layers)}
  if arch.scan_axis is not None:  # MaxText's scan_layers, param_scan_axis
    layers = jax.tree.map(lambda *x: jnp.stack(x, arch.scan_axis), *layers.values())
  return {
    "token_embedder": {"embedding": w(V, D, fan_in=1)},
    "decoder": {
      "layers": layers,
      "decoder_norm": {"scale": w(D, fan_in=16, base=gain)},
      "logits_dense": {"kernel": w(D, V)},
    },
  }


def rms_norm(x, scale, arch: Arch):
  """MaxText's RMSNorm: ``einsum("...k,k->...k", y, scale + scale_offset)``; Gemma's adds 1."""
  y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)
  return jnp.einsum("...k,k->...k", y, scale + (1.0 if arch.gemma else 0.0))


def rope(x):
  """Rotate-half RoPE on (b, s, heads, hd)."""
  s, half = x.shape[1], x.shape[-1] // 2
  freq = 1.0 / (10000 ** (np.arange(half) / half))
  angle = np.arange(s)[:, None] * freq[None]
  cos, sin = (
    jnp.asarray(np.concatenate([f(angle)] * 2, -1))[None, :, None] for f in (np.cos, np.sin)
  )
  x1, x2 = x[..., :half], x[..., half:]
  return x * cos + jnp.concatenate([-x2, x1], -1) * sin


def _proj(x, p, spec, name):
  y = jnp.einsum(spec, x, p["kernel"])
  if "bias" in p:
    y = y + p["bias"]
  return checkpoint_name(y, name)


def attention(x, p, arch: Arch):
  b, s, _ = x.shape
  q = _proj(x, p["query"], "bsd,dhk->bshk", "query_proj")
  k = _proj(x, p["key"], "bsd,dhk->bshk", "key_proj")
  v = _proj(x, p["value"], "bsd,dhk->bshk", "value_proj")
  q, k, v = jax.lax.optimization_barrier((q, k, v))  # output k is input k
  if arch.qk_norm:
    q, k = rms_norm(q, p["query_norm"]["scale"], arch), rms_norm(k, p["key_norm"]["scale"], arch)
  q, k = rope(q) * HD**-0.5, rope(k)
  q = q.reshape(b, s, KV, H // KV, HD)
  logits = jnp.einsum("bsngk,btnk->bngst", q, k)
  logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -1e9)
  if arch.biases:  # gpt-oss: a sink logit per head, dropped after the softmax
    sinks = jnp.broadcast_to(p["sinks"].reshape(KV, H // KV, 1, 1), (b, KV, H // KV, s, 1))
    logits = jnp.concatenate([logits, sinks], -1)
  probs = jax.nn.softmax(logits, axis=-1)[..., :s]
  ctx = checkpoint_name(jnp.einsum("bngst,btnk->bsngk", probs, v).reshape(b, s, H, HD), "context")
  return _proj(ctx, p["out"], "bshk,hkd->bsd", "out_proj")


def mlp(x, p, arch: Arch):
  act = jax.nn.gelu if arch.gemma else jax.nn.silu
  gate = checkpoint_name(x @ p["wi_0"]["kernel"], "mlpwi_0")
  up = checkpoint_name(x @ p["wi_1"]["kernel"], "mlpwi_1")
  return checkpoint_name((act(gate) * up) @ p["wo"]["kernel"], "mlpwo")


def moe(x, p, arch: Arch):
  """A top-k MoE: softmax router, ``lax.top_k``, SwiGLU experts (E, in, out)."""
  b, s, _ = x.shape
  t = x.reshape(b * s, D)
  logits = t @ p["gate"]["kernel"] + (p["gate"]["bias"] if arch.biases else 0.0)
  weights, idx = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), K)
  weights = weights / weights.sum(-1, keepdims=True)
  bias = (lambda name: p[name]) if arch.biases else (lambda name: 0.0)
  if arch.moe == "ragged":  # the tokens sorted by expert, each run through its expert's matrices
    order = jnp.argsort(idx.reshape(-1))
    rows, sizes = order // K, jnp.bincount(idx.reshape(-1), length=E)
    xs = t[rows]
    gate = jax.lax.ragged_dot(xs, p["wi_0"], sizes)
    up = jax.lax.ragged_dot(xs, p["wi_1"], sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, p["wo"], sizes)
    y = jnp.zeros_like(t).at[rows].add(out * weights.reshape(-1)[order][:, None])
  elif arch.moe == "combined":  # the down projection weighted and summed in one product (HF)
    combine = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(idx, E))
    h = jax.nn.silu(jnp.einsum("td,edf->tef", t, p["wi_0"])) * jnp.einsum(
      "td,edf->tef", t, p["wi_1"]
    )
    y = jnp.einsum("te,tef,efd->td", combine, h, p["wo"])
  elif arch.moe == "dense":  # every expert runs, combined by one-hot weights
    combine = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(idx, E))
    gate = checkpoint_name(jnp.einsum("td,edf->tef", t, p["wi_0"]) + bias("wi_0_bias"), "mlpwi_0")
    up = checkpoint_name(jnp.einsum("td,edf->tef", t, p["wi_1"]) + bias("wi_1_bias"), "mlpwi_1")
    out = jnp.einsum("tef,efd->ted", jax.nn.silu(gate) * up, p["wo"]) + bias("wo_bias")
    y = jnp.einsum("ted,te->td", out, combine)
  else:  # the chosen experts gathered per token by jnp.take

    def take(name):
      return jnp.take(p[name], idx, axis=0)

    wb = take if arch.biases else bias
    gate = jnp.einsum("td,tkdf->tkf", t, take("wi_0")) + wb("wi_0_bias")
    up = jnp.einsum("td,tkdf->tkf", t, take("wi_1")) + wb("wi_1_bias")
    out = jnp.einsum("tkf,tkfd->tkd", jax.nn.silu(gate) * up, take("wo")) + wb("wo_bias")
    y = jnp.einsum("tkd,tk->td", out, weights)
  y = y.reshape(b, s, D)
  return y + mlp(x, p["shared_experts"], arch) if "shared_experts" in p else y


def forward(params, tokens, arch: Arch):
  x = params["token_embedder"]["embedding"][tokens]
  dec = params["decoder"]
  if arch.scan_axis is not None:  # as flax's scan moves the scanned axis to the front
    stacked = jax.tree.map(lambda w: jnp.moveaxis(w, arch.scan_axis, 0), dec["layers"])
    x = jax.lax.scan(lambda x, p: (block(x, p, arch), None), x, stacked)[0]
  else:
    for i in range(arch.layers):
      x = block(x, dec["layers"][str(i)], arch)
  x = rms_norm(x, dec["decoder_norm"]["scale"], arch)
  return checkpoint_name(x @ dec["logits_dense"]["kernel"], "logits")


def block(x, p, arch: Arch):
  """One decoder layer, its input behind a barrier."""
  (x,) = jax.lax.optimization_barrier((x,))
  x = x + attention(
    rms_norm(x, p["pre_self_attention_norm"]["scale"], arch), p["self_attention"], arch
  )
  h = rms_norm(x, p["post_self_attention_norm"]["scale"], arch)
  return x + (moe(h, p["MoeBlock_0"], arch) if "MoeBlock_0" in p else mlp(h, p["mlp"], arch))


def tokens(seed: int = 0):
  return jnp.asarray(np.random.default_rng(700 + seed).integers(0, V, (1, 8)), jnp.int32)
