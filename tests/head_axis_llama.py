"""A small LLaMA-style model in plain JAX, written independently of the project: GQA
attention with RoPE, SwiGLU MLP, RMSNorm, untied head. Its attention kernels keep a head
axis, (d, heads, head_dim), and its parameter names are unlike Flax's defaults.

``tests/test_multiprocess.py`` trains it over two processes: on this model, SAGGS's
skipped updates once aborted both (a later collective overtook a ``lax.cond``'s)."""

import math

import jax
import jax.numpy as jnp

CFG = dict(layers=2, d=32, hq=4, hkv=2, hd=8, ff=48, vocab=61, seq=16)


def init(key, cfg=CFG):
  d, hq, hkv, hd, ff, v = cfg["d"], cfg["hq"], cfg["hkv"], cfg["hd"], cfg["ff"], cfg["vocab"]
  keys = iter(jax.random.split(key, max(64, 10 * cfg["layers"] + 4)))
  n = lambda *s: jax.random.normal(next(keys), s, jnp.float32) / math.sqrt(s[0])
  layers = {}
  for i in range(cfg["layers"]):
    layers[str(i)] = {
      "attn_norm": {"scale": 1.0 + 0.1 * jax.random.normal(next(keys), (d,))},
      "attn": {
        "wq": n(d, hq, hd),
        "wk": n(d, hkv, hd),
        "wv": n(d, hkv, hd),
        "wo": n(hq, hd, d) / math.sqrt(hd),
      },
      "mlp_norm": {"scale": 1.0 + 0.1 * jax.random.normal(next(keys), (d,))},
      "mlp": {"gate": n(d, ff), "up": n(d, ff), "down": n(ff, d)},
    }
  return {
    "embed": {"table": jax.random.normal(next(keys), (v, d))},
    "layers": layers,
    "final_norm": {"scale": jnp.ones((d,))},
    "head": {"w": n(d, v)},
  }


def _rms(x, g):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def _rope(x):  # x: (b, t, h, k)
  t, k = x.shape[1], x.shape[-1]
  freq = 1.0 / (10000 ** (jnp.arange(0, k, 2) / k))
  ang = jnp.arange(t)[:, None] * freq[None, :]
  cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
  x1, x2 = x[..., ::2], x[..., 1::2]
  return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).reshape(x.shape)


def apply(params, tokens, cfg=CFG):
  hq, hkv = cfg["hq"], cfg["hkv"]
  x = params["embed"]["table"][tokens]
  t = tokens.shape[1]
  mask = jnp.tril(jnp.ones((t, t), bool))
  for i in range(cfg["layers"]):
    p = params["layers"][str(i)]
    y = _rms(x, p["attn_norm"]["scale"])
    q = _rope(jnp.einsum("btd,dhk->bthk", y, p["attn"]["wq"]))
    k = _rope(jnp.einsum("btd,dhk->bthk", y, p["attn"]["wk"]))
    v = jnp.einsum("btd,dhk->bthk", y, p["attn"]["wv"])
    k = jnp.repeat(k, hq // hkv, axis=2)  # q head h uses kv head h // (hq//hkv)
    v = jnp.repeat(v, hq // hkv, axis=2)
    a = jnp.einsum("bthk,bshk->bhts", q, k) / math.sqrt(q.shape[-1])
    a = jax.nn.softmax(jnp.where(mask, a, -1e30), -1)
    x = x + jnp.einsum("bhts,bshk,hkd->btd", a, v, p["attn"]["wo"])
    y = _rms(x, p["mlp_norm"]["scale"])
    x = x + (jax.nn.silu(y @ p["mlp"]["gate"]) * (y @ p["mlp"]["up"])) @ p["mlp"]["down"]
  return _rms(x, params["final_norm"]["scale"]) @ params["head"]["w"]


def loss(params, tokens, cfg=CFG):
  logits = apply(params, tokens[:, :-1], cfg)
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def batch(key, n=8, cfg=CFG):
  """Token sequences with learnable structure (a noisy affine recurrence)."""
  k1, k2 = jax.random.split(key)
  start = jax.random.randint(k1, (n, 1), 0, cfg["vocab"])
  steps = jnp.arange(cfg["seq"])[None, :]
  noise = jax.random.bernoulli(k2, 0.1, (n, cfg["seq"])) * 7
  return (start * 3 + steps * 5 + noise) % cfg["vocab"]


# The exact symmetry pairs of this model, as (pattern_a, pattern_b, axes, groups).
PAIRS = [
  ("layers/*/attn/wq", "layers/*/attn/wk", (1, 1), CFG["hkv"]),  # Q/K per kv-head group
  ("layers/*/attn/wv", "layers/*/attn/wo", (1, 0), CFG["hkv"]),  # V/O per kv-head group
  ("layers/*/mlp/up", "layers/*/mlp/down", (1, 0), None),  # SwiGLU up/down per channel
]
