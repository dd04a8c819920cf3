"""Tiny models shared by the tests: Flax attention (Linen and NNX) and a LLaMA-style stack.

Weights are drawn with NumPy (no JAX compiles). The forward passes are jitted
once at module level, without LLVM optimisation, so every test reuses the same
executables; ``*_forward`` are the plain functions for ``check_symmetry``, which
jits its argument itself.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import saggs_jax as saggs

# Test programs are tiny and run once or twice: spend as little compile time as
# possible on them. The LLVM optimisation level changes compile time only, not
# what is computed.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
jit = functools.partial(jax.jit, compiler_options=FAST_COMPILE)

# ---------------------------------------------------------------------------
# Flax multi-head attention (Linen and NNX), biases included.

MHA_D, MHA_HEADS, MHA_QKV = 8, 2, 8


class LinenAttn(nn.Module):
  """Self-attention followed by an untouched read-out layer."""

  @nn.compact
  def __call__(self, x):
    y = nn.MultiHeadDotProductAttention(num_heads=MHA_HEADS, qkv_features=MHA_QKV, name="attn")(x)
    return nn.Dense(3, name="head")(y)


linen_model = LinenAttn()
linen_forward = linen_model.apply  # plain: check_symmetry jits it itself
linen_apply = jit(linen_forward)


def fill(shapes, seed: int, scale: float = 0.5):
  """Random values for a tree of ``ShapeDtypeStruct``s, drawn with NumPy (no JAX compiles)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda s: jnp.asarray(scale * rng.standard_normal(s.shape), s.dtype), shapes)


def mha_input(seed: int = 0):
  return jnp.asarray(np.random.default_rng(100 + seed).standard_normal((2, 5, MHA_D)), jnp.float32)


def linen_init(seed: int = 0):
  """``{"params": ...}`` of ``LinenAttn`` with random kernels and non-zero biases."""
  shapes = jax.eval_shape(linen_model.init, jax.random.PRNGKey(0), mha_input(0))
  return fill(shapes, seed)


class NnxAttn(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.attn = nnx.MultiHeadAttention(num_heads=MHA_HEADS, in_features=MHA_D,
                                       qkv_features=MHA_QKV, decode=False, rngs=rngs)
    self.head = nnx.Linear(MHA_D, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(self.attn(x))


def nnx_model(seed: int = 0) -> NnxAttn:
  """An ``NnxAttn`` with random kernels and non-zero biases."""
  abstract = nnx.eval_shape(lambda: NnxAttn(nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  params = fill(nnx.to_pure_dict(state), seed)
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


NNX_GRAPHDEF = nnx.graphdef(nnx.eval_shape(lambda: NnxAttn(nnx.Rngs(0))))


def nnx_forward(state, x):
  """Pure apply of an ``NnxAttn`` from its ``nnx.State`` of params."""
  return nnx.merge(NNX_GRAPHDEF, state)(x)


nnx_apply = jit(nnx_forward)


# ---------------------------------------------------------------------------
# LLaMA-style decoder: GQA, RoPE, SwiGLU, RMSNorm; Flax (in, out) kernels.

D, H, KVH, HD, F, L, V = 16, 4, 2, 4, 32, 2, 11
SEQ = 6


def _layer_init(rng, dtype, qk_norm=False):
  def normal(shape, scale):
    return jnp.asarray(scale * rng.standard_normal(shape), dtype)

  def gain(n):
    return jnp.asarray(1.0 + 0.1 * rng.standard_normal((n,)), dtype)

  s = D**-0.5
  layer = {
      "input_norm": {"scale": gain(D)},
      "attn": {
          "q_proj": {"kernel": normal((D, H * HD), s)},
          "k_proj": {"kernel": normal((D, KVH * HD), s)},
          "v_proj": {"kernel": normal((D, KVH * HD), s)},
          "o_proj": {"kernel": normal((H * HD, D), (H * HD)**-0.5)},
      },
      "post_norm": {"scale": gain(D)},
      "mlp": {
          "gate_proj": {"kernel": normal((D, F), s)},
          "up_proj": {"kernel": normal((D, F), s)},
          "down_proj": {"kernel": normal((F, D), F**-0.5)},
      },
  }
  if qk_norm:
    layer["attn"]["q_norm"] = {"scale": gain(H * HD)}
    layer["attn"]["k_norm"] = {"scale": gain(KVH * HD)}
  return layer


def _np_stack(*xs):
  return jnp.asarray(np.stack([np.asarray(x) for x in xs]))


def llama_init(seed: int = 0, *, stacked: bool = False, dtype=jnp.float32, qk_norm=False):
  """Params of a 2-layer model; ``stacked`` puts the layers on a leading axis."""
  rng = np.random.default_rng(seed)
  params = {
      "embed": {"embedding": jnp.asarray(rng.standard_normal((V, D)), dtype)},
      "final_norm": {"scale": jnp.ones((D,), dtype)},
      "lm_head": {"kernel": jnp.asarray(D**-0.5 * rng.standard_normal((D, V)), dtype)},
  }
  layers = [_layer_init(rng, dtype, qk_norm) for _ in range(L)]
  if stacked:
    params["layers"] = jax.tree.map(_np_stack, *layers)
  else:
    params["layers"] = {str(i): layer for i, layer in enumerate(layers)}
  return params


def stack_layers(params):
  """Unstacked params -> stacked params (same values)."""
  out = dict(params)
  layers = [params["layers"][str(i)] for i in range(L)]
  out["layers"] = jax.tree.map(_np_stack, *layers)
  return out


def tokens(seed: int = 0, batch: int = 2):
  return jnp.asarray(np.random.default_rng(200 + seed).integers(0, V, (batch, SEQ)), jnp.int32)


def _rms_norm(x, scale, eps=1e-6):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _rope(x):
  """Rotate-half RoPE over the last axis of (B, T, heads, HD)."""
  t = jnp.arange(x.shape[1], dtype=jnp.float32)
  inv = 1.0 / (10000.0**(jnp.arange(0, HD, 2, dtype=jnp.float32) / HD))
  ang = t[:, None] * inv[None, :]
  sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[None, :, None, :]
  cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rot = jnp.concatenate([-x2, x1], axis=-1)
  return (x.astype(jnp.float32) * cos + rot * sin).astype(x.dtype)


def _layer(layer, h, qk_norm=False):
  b, t, _ = h.shape
  a = layer["attn"]
  x = _rms_norm(h, layer["input_norm"]["scale"])
  q = x @ a["q_proj"]["kernel"]
  k = x @ a["k_proj"]["kernel"]
  if qk_norm:  # OLMo-2 style: one RMSNorm over the whole projection, across heads
    q = _rms_norm(q, a["q_norm"]["scale"])
    k = _rms_norm(k, a["k_norm"]["scale"])
  q = _rope(q.reshape(b, t, H, HD))
  k = _rope(k.reshape(b, t, KVH, HD))
  v = (x @ a["v_proj"]["kernel"]).reshape(b, t, KVH, HD)
  # GQA: query head h reads KV head h // (H // KVH).
  k = jnp.repeat(k, H // KVH, axis=2)
  v = jnp.repeat(v, H // KVH, axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(HD)
  mask = jnp.tril(jnp.ones((t, t), bool))
  probs = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1).astype(v.dtype)
  o = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, H * HD)
  h = h + o @ a["o_proj"]["kernel"]
  m = layer["mlp"]
  x = _rms_norm(h, layer["post_norm"]["scale"])
  y = jax.nn.silu(x @ m["gate_proj"]["kernel"]) * (x @ m["up_proj"]["kernel"])
  return h + y @ m["down_proj"]["kernel"]


def _llama_apply(params, toks, *, qk_norm=False):
  h = params["embed"]["embedding"][toks]
  layers = params["layers"]
  if "attn" in layers:  # stacked: scan over the leading layer axis
    h, _ = jax.lax.scan(lambda c, lp: (_layer(lp, c, qk_norm), None), h, layers)
  else:
    for i in range(len(layers)):
      h = _layer(layers[str(i)], h, qk_norm)
  h = _rms_norm(h, params["final_norm"]["scale"])
  return h @ params["lm_head"]["kernel"]


llama_forward = _llama_apply  # plain functions for check_symmetry, which jits them itself
llama_qknorm_forward = functools.partial(_llama_apply, qk_norm=True)
llama_apply = jit(_llama_apply)


# ---------------------------------------------------------------------------
# A GELU MLP: up/down is *not* an exact symmetry.

def gelu_mlp_init(seed: int = 0):
  rng = np.random.default_rng(seed)
  return {"mlp": {"up": {"kernel": jnp.asarray(rng.standard_normal((D, F)) * D**-0.5, jnp.float32)},
                  "down": {"kernel": jnp.asarray(rng.standard_normal((F, D)) * F**-0.5, jnp.float32)}}}


def gelu_mlp_forward(params, x):
  m = params["mlp"]
  return jax.nn.gelu(x @ m["up"]["kernel"]) @ m["down"]["kernel"]


# ---------------------------------------------------------------------------
# Helpers.

def leaf_dict(tree):
  """``{path: leaf}`` with the library's path convention (MaskedNode leaves vanish)."""
  return dict(saggs.paths.leaves_with_paths(tree))


def random_factors(seed: int = 0, low: float = 0.2, high: float = 5.0):
  """A ``factor`` callable for ``saggs.reparameterize``: per-group random factors, log-uniform."""
  rng = np.random.default_rng(seed)

  def fn(path, shape):
    del path
    return np.exp(rng.uniform(np.log(low), np.log(high), shape)).astype(np.float32)

  return fn


# ---------------------------------------------------------------------------
# Library calls used by many tests. They run eagerly on purpose: eager JAX
# compiles each primitive once per shape and dtype and shares it across every
# test, while a jitted program would compile again for each new optimizer.

def orbit_factors(params, pairs, seed: int = 0, low: float = 0.1, high: float = 10.0):
  """Random log-uniform factors for every pair instance, keyed by A path."""
  fn = random_factors(seed, low, high)
  return {i.a: fn(i.a, i.factor_shape) for i in saggs.pairs.resolve(pairs, params).instances}


def reparam(params, opt_state, pairs, factors):
  """``saggs.reparameterize`` with ``factors`` keyed by each instance's A path."""
  return saggs.reparameterize(params, opt_state, pairs, lambda path_a, shape: factors[path_a])


def perturb(params, pairs, seed: int = 0, low: float = 0.1, high: float = 10.0):
  """``params`` moved along its symmetry orbit by random factors (the same function)."""
  return reparam(params, None, pairs, orbit_factors(params, pairs, seed, low, high))[0]


def step(tx, params, state, grads):
  """One optimizer step: ``(new_params, updates, new_state)``."""
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), updates, state


@functools.partial(jit, static_argnums=0)
def jit_step(tx, params, state, grads):
  """``step`` as one compiled program: cheaper than eager for a one-off dtype or shape."""
  return step(tx, params, state, grads)
