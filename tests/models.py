"""Models and helpers shared by the tests.

* Flax multi-head attention, Linen and NNX, biases included;
* a tiny LLaMA-style decoder (GQA, RoPE, SwiGLU) as a pure function of a
  params dict, per-layer or stacked, with a learnable counting task;
* a GELU MLP, whose up/down rescaling is *not* a symmetry;
* random values, orbit moves, optimizer steps and output comparisons;
* what JAX's persistent compilation cache served after a restart's in-memory caches are gone.

Weights are drawn with NumPy (no JAX compiles). The forward passes are jitted
once at module level, without LLVM optimisation, so every test reuses the same
executables; ``*_forward`` are the plain functions for ``check_symmetry``, which
jits its argument itself.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import saggs_jax as saggs


def random_like(tree, seed: int, *, scale: float = 1.0, positive: bool = False):
  """Normal values (``|N| + 0.1`` if ``positive``) for every float leaf with at least one axis.

  Leaves may be arrays or ``ShapeDtypeStruct``s; other leaves (counters, scalar
  hyperparameters) are kept. Drawn with NumPy: no JAX compiles.
  """
  rng = np.random.default_rng(seed)

  def draw(x):
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim == 0:
      return x
    v = rng.standard_normal(x.shape)
    v = np.abs(v) + 0.1 if positive else v
    return jnp.asarray(scale * v, x.dtype)

  return jax.tree.map(draw, tree)


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
linen_apply = jax.jit(linen_forward)


def mha_input(seed: int = 0):
  return jnp.asarray(np.random.default_rng(100 + seed).standard_normal((2, 5, MHA_D)), jnp.float32)


def linen_init(seed: int = 0):
  """``{"params": ...}`` of ``LinenAttn`` with random kernels and non-zero biases."""
  shapes = jax.eval_shape(linen_model.init, jax.random.PRNGKey(0), mha_input(0))
  return random_like(shapes, seed, scale=0.5)


class NnxAttn(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.attn = nnx.MultiHeadAttention(
      num_heads=MHA_HEADS, in_features=MHA_D, qkv_features=MHA_QKV, decode=False, rngs=rngs
    )
    self.head = nnx.Linear(MHA_D, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(self.attn(x))


def nnx_model(seed: int = 0) -> NnxAttn:
  """An ``NnxAttn`` with random kernels and non-zero biases."""
  abstract = nnx.eval_shape(lambda: NnxAttn(nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  params = random_like(nnx.to_pure_dict(state), seed, scale=0.5)
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


NNX_GRAPHDEF = nnx.graphdef(nnx.eval_shape(lambda: NnxAttn(nnx.Rngs(0))))


def nnx_forward(state, x):
  """Pure apply of an ``NnxAttn`` from its ``nnx.State`` of params."""
  return nnx.merge(NNX_GRAPHDEF, state)(x)


nnx_apply = jax.jit(nnx_forward)


# ---------------------------------------------------------------------------
# LLaMA-style decoder: pre-norm blocks with RMSNorm, grouped-query attention
# with RoPE, a SwiGLU MLP; Flax (in, out) kernels. Leaf names follow
# ``saggs.presets.llama`` (``layers/0/attn/q_proj/kernel``, ...), so
# ``llama_pairs(c)`` declares every exact symmetry of the model. With
# ``stacked=True`` the layers form one tree with a leading layer axis, run with
# ``lax.scan`` (the scanned-layers layout). ``qk_norm=True`` adds an OLMo-2
# style QK-norm, which breaks the per-KV-head Q/K symmetry.


@dataclasses.dataclass(frozen=True)
class Config:
  """Sizes and layout; a static argument of the jitted forward pass (hashable)."""

  vocab: int = 16
  d_model: int = 16
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 4
  mlp_hidden: int = 24
  stacked: bool = False
  qk_norm: bool = False


CONFIG = Config()
STACKED = dataclasses.replace(CONFIG, stacked=True)


def llama_pairs(c: Config = CONFIG) -> list[saggs.Pair]:
  """Q/K and V/O per KV head, SwiGLU up/down per channel."""
  return saggs.presets.llama(c.num_kv_heads, stacked=int(c.stacked))


def stack_layers(params):
  """Per-layer params (``layers/<i>/...``) -> stacked params (``layers/...``), same values."""
  layers = params["layers"]
  return {
    **params,
    "layers": jax.tree.map(
      lambda *xs: jnp.asarray(np.stack(xs)), *(layers[str(i)] for i in range(len(layers)))
    ),
  }


def _dense(rng, d_in, d_out):
  """A Dense layer's ``{"kernel": (d_in, d_out)}`` with fan-in scaling, in NumPy."""
  return {"kernel": rng.standard_normal((d_in, d_out)) / np.sqrt(d_in)}


def llama_init(seed: int = 0, c: Config = CONFIG) -> dict:
  """Random float32 params, drawn with NumPy (eager JAX ops would compile per shape).

  Norm gains are 1 + 0.1 N(0, 1), so that none of them is trivially one.
  """
  rng = np.random.default_rng(seed)
  dense = functools.partial(_dense, rng)

  def norm(n):
    return {"scale": 1.0 + 0.1 * rng.standard_normal(n)}

  def layer():
    d, q_dim, kv_dim = c.d_model, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    attn = {
      "q_proj": dense(d, q_dim),
      "k_proj": dense(d, kv_dim),
      "v_proj": dense(d, kv_dim),
      "o_proj": dense(q_dim, d),
    }
    if c.qk_norm:
      attn.update(q_norm=norm(q_dim), k_norm=norm(kv_dim))
    return {
      "attn_norm": norm(d),
      "attn": attn,
      "mlp_norm": norm(d),
      "mlp": {
        "gate_proj": dense(d, c.mlp_hidden),
        "up_proj": dense(d, c.mlp_hidden),
        "down_proj": dense(c.mlp_hidden, d),
      },
    }

  params = {
    "embed": {"embedding": rng.standard_normal((c.vocab, c.d_model))},
    "layers": {str(i): layer() for i in range(c.num_layers)},
    "final_norm": norm(c.d_model),
    "lm_head": dense(c.d_model, c.vocab),
  }
  params = stack_layers(params) if c.stacked else params
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
  q, k = x @ p["q_proj"]["kernel"], x @ p["k_proj"]["kernel"]
  if c.qk_norm:  # one RMSNorm over the whole projection, across heads
    q, k = _rms_norm(q, p["q_norm"]), _rms_norm(k, p["k_norm"])
  q = _rope(q.reshape(b, t, c.num_heads, c.head_dim))
  k = _rope(k.reshape(b, t, c.num_kv_heads, c.head_dim))
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


def llama_forward(params: dict, tokens: jax.Array, c: Config = CONFIG) -> jax.Array:
  """Logits (batch, seq, vocab) for int tokens (batch, seq); plain, for ``check_symmetry``."""
  x = params["embed"]["embedding"][tokens]
  if c.stacked:
    x, _ = jax.lax.scan(lambda h, p: (_block(h, p, c), None), x, params["layers"])
  else:
    for i in range(c.num_layers):
      x = _block(x, params["layers"][str(i)], c)
  return _rms_norm(x, params["final_norm"]) @ params["lm_head"]["kernel"]


llama_apply = jax.jit(llama_forward, static_argnames="c")


def llama_loss(params: dict, batch: jax.Array, c: Config = CONFIG) -> jax.Array:
  """Mean next-token cross-entropy over windows (batch, seq + 1)."""
  logits = llama_forward(params, batch[:, :-1], c)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def tokens(seed: int = 0, batch: int = 2, seq_len: int = 8, c: Config = CONFIG) -> jax.Array:
  """Random int32 tokens (batch, seq_len)."""
  return jnp.asarray(
    np.random.default_rng(200 + seed).integers(0, c.vocab, (batch, seq_len)), jnp.int32
  )


def batches(
  seed: int, num: int, c: Config = CONFIG, batch_size: int = 8, seq_len: int = 8
) -> jax.Array:
  """(num, batch_size, seq_len + 1) int32 windows of strided counting modulo vocab.

  A learnable, deterministic task: each sequence counts up from a random start
  with a random stride, so attention has to read the stride from the context.
  """
  rng = np.random.default_rng(seed)
  start = rng.integers(0, c.vocab, (num, batch_size, 1))
  stride = rng.integers(1, 4, (num, batch_size, 1))
  return jnp.asarray((start + stride * np.arange(seq_len + 1)) % c.vocab, jnp.int32)


# ---------------------------------------------------------------------------
# A GELU MLP: up/down is *not* an exact symmetry.


def gelu_mlp_init(seed: int = 0, c: Config = CONFIG):
  rng = np.random.default_rng(seed)
  mlp = {"up": _dense(rng, c.d_model, c.mlp_hidden), "down": _dense(rng, c.mlp_hidden, c.d_model)}
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), {"mlp": mlp})


def gelu_mlp_forward(params, x):
  m = params["mlp"]
  return jax.nn.gelu(x @ m["up"]["kernel"]) @ m["down"]["kernel"]


# ---------------------------------------------------------------------------
# Paths, norms and output comparisons, computed independently of the library
# where they check it.


def leaf_dict(tree):
  """``{path: leaf}`` with the library's path convention (MaskedNode leaves vanish)."""
  return dict(saggs._src.paths.leaves_with_paths(tree))


def norms(x, axes):
  """Frobenius norms over ``axes``, in NumPy float64."""
  x = np.asarray(x, np.float64)
  return np.sqrt(np.sum(x * x, axis=axes))


def assert_balanced(pair_norms, rtol=1e-5):
  """``pair_norms``: ``{name: (||A_g||, ||B_g||)}``, equal per group."""
  for name, (a, b) in pair_norms.items():
    np.testing.assert_allclose(a, b, rtol=rtol, err_msg=name)


def assert_imbalanced(pair_norms, at_least=0.5):
  """Some group's ``|log(||A_g|| / ||B_g||)|`` exceeds ``at_least``: the test has work to do."""
  worst = max(np.max(np.abs(np.log(a / b))) for a, b in pair_norms.values())
  assert worst > at_least, f"test setup: params are not imbalanced ({worst})"


def assert_same_output(y1, y0):
  """Equal outputs up to float32 rounding, relative to the largest output."""
  np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(y0))))


def assert_same_function(apply_fn, p0, p1, *inputs):
  """``p0`` and ``p1`` compute the same function on ``inputs``."""
  assert_same_output(apply_fn(p1, *inputs), apply_fn(p0, *inputs))


# ---------------------------------------------------------------------------
# Orbit moves and optimizer steps. Library calls run eagerly on purpose: eager
# JAX compiles each primitive once per shape and dtype and shares it across
# every test, while a jitted program would compile again for each new optimizer.


def random_factors(seed: int = 0, low: float = 0.1, high: float = 10.0):
  """A ``factor`` callable for ``saggs.reparameterize``: log-uniform factors in
  [low, high], a pure function of (seed, A path)."""

  def fn(path, shape):
    rng = np.random.default_rng([seed, zlib.crc32(path.encode())])
    return np.exp(rng.uniform(np.log(low), np.log(high), shape)).astype(np.float32)

  return fn


def inverse(fn):
  """The factor callable that undoes ``fn``."""
  return lambda path, shape: 1 / fn(path, shape)


def orbit_factors(params, pairs, seed: int = 0, low: float = 0.1, high: float = 10.0):
  """``random_factors`` of every pair instance, keyed by A path."""
  fn = random_factors(seed, low, high)
  return {i.a: fn(i.a, i.factor_shape) for i in saggs._src.plan.resolve(pairs, params).instances}


def reparam(params, opt_state, pairs, factors):
  """``saggs.reparameterize`` with ``factors`` keyed by each instance's A path."""
  return saggs.reparameterize(params, opt_state, pairs, lambda path_a, shape: factors[path_a])


def perturb(params, pairs, seed: int = 0, low: float = 0.1, high: float = 10.0):
  """``params`` moved along its symmetry orbit by random factors (the same function)."""
  return saggs.reparameterize(params, None, pairs, random_factors(seed, low, high))[0]


def step(tx, params, state, grads):
  """One optimizer step: ``(new_params, updates, new_state)``."""
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), updates, state


@functools.partial(jax.jit, static_argnums=0)
def jit_step(tx, params, state, grads):
  """``step`` as one compiled program (one compile per ``tx``): cheaper than eager for a
  one-off dtype or shape, and for many steps of one optimizer."""
  return step(tx, params, state, grads)


@functools.partial(jax.jit, static_argnums=0)
def train_scan(tx, params, batches):
  """``params`` after one ``tx`` step on ``llama_loss`` per batch of ``batches`` (num, b, t + 1),
  from ``tx.init(params)``, as one ``lax.scan`` program: one compile per ``tx`` (and shapes)."""

  def body(carry, batch):
    p, s = carry
    p, _, s = step(tx, p, s, jax.grad(llama_loss)(p, batch))
    return (p, s), None

  return jax.lax.scan(body, (params, tx.init(params)), batches)[0][0]


@contextlib.contextmanager
def as_after_a_restart():
  """JAX's in-memory caches emptied, as in a new process, then a count of the persistent
  compilation cache's events inside: ``"compile_requests_use_cache"`` per compile, of those
  ``"cache_hits"``, and ``"cache_misses"`` per entry written (JAX writes no program with a
  host callback, so it is neither; conftest gives each test process a cache that keeps every
  other program)."""
  jax.clear_caches()
  events = collections.Counter()

  def count(event, **_):
    events[event.rsplit("/", 1)[-1]] += 1

  jax.monitoring.register_event_listener(count)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_listener(count)
