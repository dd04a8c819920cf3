"""The zoo's models: tiny configs with random weights (no downloads), and by hand, per
architecture, the symmetries it has and declarations that look alike but are none.

transformers 4.x Flax (LLaMA with GQA, Mistral, Gemma with MQA, GPT-2 with a fused QKV
kernel) and an equinox LLaMA-style model written here. The gemma package is built in its
own process (``gemma_worker.py``): importing ``gemma.gm`` replaces flax's
``nn.Module.param`` process-wide.
"""

import time
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import saggs_jax as saggs
from zoo_oracle import Zoo

VOCAB, D, HIDDEN, LAYERS, HEADS = 64, 32, 48, 2, 4
INIT = 0.3  # weights' std: large enough that a broken symmetry shows in the logits


def tokens(batch=2, length=8):
  return jnp.asarray(np.random.default_rng(0).integers(1, VOCAB, (batch, length)), jnp.int32)


def make_zoo(
  name, forward, params, inputs, expected, not_symmetries, untouched=(), discover_target=None
) -> Zoo:
  """Runs discover on ``forward`` (or on ``discover_target = (fn, tree)``) and times it."""
  fn, tree = discover_target or (forward, params)
  start = time.perf_counter()
  try:
    found = saggs.discover(fn, tree, *inputs)
  except Exception as e:  # the checks that need it report it; the others still run
    found = e
  seconds = time.perf_counter() - start
  return Zoo(
    name,
    jax.jit(forward),
    params,
    tuple(inputs),
    found,
    seconds,
    expected,
    not_symmetries,
    untouched,
  )


# ---------------------------------------------------------------------------
# transformers 4.x Flax.


def _llama_like(kv_heads: int) -> list:
  """LLaMA, Mistral: Q/K and V/O per KV head (RoPE rotates within a head), SwiGLU up/down per
  channel, each RMSNorm gain against the input rows of the linears that read it."""
  attn = "self_attn/"
  return [
    saggs.Pair(attn + "q_proj/kernel", attn + "k_proj/kernel", axes=(1, 1), groups=kv_heads),
    saggs.Pair(attn + "v_proj/kernel", attn + "o_proj/kernel", axes=(1, 0), groups=kv_heads),
    saggs.Pair("mlp/up_proj/kernel", "mlp/down_proj/kernel", axes=(1, 0)),
    saggs.Pair(
      "input_layernorm/weight", tuple(attn + f"{x}_proj/kernel" for x in "qkv"), axes=(0, 0)
    ),
    saggs.Pair(
      "post_attention_layernorm/weight", ("mlp/gate_proj/kernel", "mlp/up_proj/kernel"), axes=(0, 0)
    ),
    saggs.Pair("model/norm/weight", "lm_head/kernel", axes=(0, 0)),
  ]


GATE_DOWN = saggs.Pair("mlp/gate_proj/kernel", "mlp/down_proj/kernel", axes=(1, 0))


def _gemma_expected() -> list:
  """Gemma with MQA: one K/V head, so Q/K and V/O are one factor per layer; SwiGLU (GELU gate)
  up/down per channel. Its RMSNorms multiply by (1 + w): no gain pair."""
  attn = "self_attn/"
  return [
    saggs.Pair(attn + "q_proj/kernel", attn + "k_proj/kernel", axes=(1, 1), groups=1),
    saggs.Pair(attn + "v_proj/kernel", attn + "o_proj/kernel", axes=(1, 0), groups=1),
    saggs.Pair("mlp/up_proj/kernel", "mlp/down_proj/kernel", axes=(1, 0)),
  ]


def _gemma_not() -> list:
  attn = "self_attn/"
  return [
    GATE_DOWN,
    saggs.Pair(
      "input_layernorm/weight", tuple(attn + f"{x}_proj/kernel" for x in "qkv"), axes=(0, 0)
    ),
    saggs.Pair(
      "post_attention_layernorm/weight", ("mlp/gate_proj/kernel", "mlp/up_proj/kernel"), axes=(0, 0)
    ),
  ]


def _gpt2_expected() -> list:
  """GPT-2: kernels are (out, in); c_attn is q|k|v fused along its out axis. Without RoPE, Q/K
  pair per channel, as do V/O; each LayerNorm gain (with its bias) against the rows of the
  linear that reads it. ln_f reads into the LM head tied to wte: none. No MLP pair (GELU)."""
  qkv = dict(axis=0, parts=("q", "k", "v"))
  kernel, bias = "attn/c_attn/kernel", "attn/c_attn/bias"
  return [
    saggs.Pair(
      saggs.Block(kernel, part="q", **qkv),
      saggs.Block(kernel, part="k", **qkv),
      axes=(0, 0),
      follow_a=saggs.Block(bias, part="q", **qkv),
      follow_b=saggs.Block(bias, part="k", **qkv),
    ),
    saggs.Pair(
      saggs.Block(kernel, part="v", **qkv),
      "attn/c_proj/kernel",
      axes=(0, 1),
      follow_a=saggs.Block(bias, part="v", **qkv),
    ),
    saggs.Pair("ln_1/scale", kernel, axes=(0, 1), follow_a="ln_1/bias"),
    saggs.Pair("ln_2/scale", "mlp/c_fc/kernel", axes=(0, 1), follow_a="ln_2/bias"),
  ]


GPT2_GELU = saggs.Pair(
  "mlp/c_fc/kernel", "mlp/c_proj/kernel", axes=(0, 1), follow_a="mlp/c_fc/bias"
)


def transformers_model(name: str) -> Zoo:
  import transformers as tf

  common = dict(
    vocab_size=VOCAB,
    hidden_size=D,
    intermediate_size=HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    max_position_embeddings=64,
    initializer_range=INIT,
  )
  if name == "llama":
    model = tf.FlaxLlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **common), seed=0)
    expected, not_symmetries, untouched = lambda: _llama_like(2), lambda: [GATE_DOWN], ()
  elif name == "mistral":
    model = tf.FlaxMistralForCausalLM(tf.MistralConfig(num_key_value_heads=2, **common), seed=0)
    expected, not_symmetries, untouched = lambda: _llama_like(2), lambda: [GATE_DOWN], ()
  elif name == "gemma":
    model = tf.FlaxGemmaForCausalLM(
      tf.GemmaConfig(
        num_key_value_heads=1, head_dim=D // HEADS, hidden_activation="gelu_pytorch_tanh", **common
      ),
      seed=0,
    )
    expected, not_symmetries, untouched = _gemma_expected, _gemma_not, ("*norm/weight",)
  elif name == "gpt2":
    model = tf.FlaxGPT2LMHeadModel(
      tf.GPT2Config(
        vocab_size=VOCAB,
        n_embd=D,
        n_layer=LAYERS,
        n_head=HEADS,
        n_positions=64,
        initializer_range=INIT,
      ),
      seed=0,
    )
    expected, not_symmetries = _gpt2_expected, lambda: [GPT2_GELU]
    untouched = ("mlp/c_proj/kernel", "mlp/c_proj/bias")
  else:
    raise ValueError(name)
  forward = lambda params, ids: model(ids, params=params).logits
  return make_zoo(
    f"transformers {name}", forward, model.params, (tokens(),), expected, not_symmetries, untouched
  )


# ---------------------------------------------------------------------------
# equinox: a LLaMA-style model with non-array fields (the activation, dropout, head counts).


def equinox_model() -> Zoo:
  import equinox as eqx

  def rope(x):  # (T, heads, hd), halves rotated together
    t, _, hd = x.shape
    freq = 10000.0 ** (-jnp.arange(hd // 2) / (hd // 2))
    angle = jnp.arange(t)[:, None, None] * freq
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return jnp.concatenate(
      [x1 * jnp.cos(angle) - x2 * jnp.sin(angle), x2 * jnp.cos(angle) + x1 * jnp.sin(angle)],
      axis=-1,
    )

  class Layer(eqx.Module):
    attn_norm: eqx.nn.RMSNorm
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    mlp_norm: eqx.nn.RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    act: Callable  # a function leaf
    dropout: eqx.nn.Dropout  # float and bool leaves
    heads: int  # int leaves
    kv_heads: int

    def __init__(self, key, heads=HEADS, kv_heads=2):
      hd = D // heads
      keys = jax.random.split(key, 7)
      lin = lambda i, o, k: eqx.nn.Linear(i, o, use_bias=False, key=k)
      self.attn_norm = eqx.nn.RMSNorm(D, use_bias=False)
      self.q, self.k = lin(D, heads * hd, keys[0]), lin(D, kv_heads * hd, keys[1])
      self.v, self.o = lin(D, kv_heads * hd, keys[2]), lin(heads * hd, D, keys[3])
      self.mlp_norm = eqx.nn.RMSNorm(D, use_bias=False)
      self.gate, self.up = lin(D, HIDDEN, keys[4]), lin(D, HIDDEN, keys[5])
      self.down = lin(HIDDEN, D, keys[6])
      self.act, self.dropout = jax.nn.silu, eqx.nn.Dropout(0.1, inference=True)
      self.heads, self.kv_heads = heads, kv_heads

    def __call__(self, x):  # (T, D)
      t, hd = x.shape[0], D // self.heads
      h = jax.vmap(self.attn_norm)(x)
      q = rope(jax.vmap(self.q)(h).reshape(t, self.heads, hd))
      k = rope(jax.vmap(self.k)(h).reshape(t, self.kv_heads, hd))
      v = jax.vmap(self.v)(h).reshape(t, self.kv_heads, hd)
      q = q.reshape(t, self.kv_heads, self.heads // self.kv_heads, hd)
      scores = jnp.einsum("tkgd,skd->kgts", q, k) / jnp.sqrt(hd)
      scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
      out = jnp.einsum("kgts,skd->tkgd", jax.nn.softmax(scores, -1), v).reshape(t, -1)
      x = x + self.dropout(jax.vmap(self.o)(out))
      h = jax.vmap(self.mlp_norm)(x)
      return x + self.dropout(
        jax.vmap(self.down)(self.act(jax.vmap(self.gate)(h)) * jax.vmap(self.up)(h))
      )

  class LM(eqx.Module):
    embed: eqx.nn.Embedding
    layers: list
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, key):
      keys = jax.random.split(key, LAYERS + 2)
      self.embed = eqx.nn.Embedding(VOCAB, D, key=keys[0])
      self.layers = [Layer(k) for k in keys[1:-1]]
      self.norm = eqx.nn.RMSNorm(D, use_bias=False)
      self.head = eqx.nn.Linear(D, VOCAB, use_bias=False, key=keys[-1])

    def __call__(self, ids):  # (B, T) -> (B, T, VOCAB)
      def one(seq):
        x = jax.vmap(self.embed)(seq)
        for layer in self.layers:
          x = layer(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))

      return jax.vmap(one)(ids)

  model = LM(jax.random.key(0))
  # random gains, so that the gain pairs start unbalanced like the rest
  model = jax.tree_util.tree_map_with_path(
    lambda kp, x: (
      x * jnp.exp(0.3 * jax.random.normal(jax.random.key(zlib.crc32(str(kp).encode())), x.shape))
      if "norm" in str(kp) and eqx.is_array(x)
      else x
    ),
    model,
  )
  params, static = eqx.partition(model, eqx.is_inexact_array)
  forward = lambda p, ids: eqx.combine(p, static)(ids)
  expected = lambda: [
    saggs.Pair("q/weight", "k/weight", axes=(0, 0), groups=2),
    saggs.Pair("v/weight", "o/weight", axes=(0, 1), groups=2),
    saggs.Pair("up/weight", "down/weight", axes=(0, 1)),
    saggs.Pair("attn_norm/weight", ("q/weight", "k/weight", "v/weight"), axes=(0, 1)),
    saggs.Pair("mlp_norm/weight", ("gate/weight", "up/weight"), axes=(0, 1)),
    saggs.Pair("norm/weight", "head/weight", axes=(0, 1)),
  ]
  not_symmetries = lambda: [saggs.Pair("gate/weight", "down/weight", axes=(0, 1))]
  # discover gets the whole module, non-array leaves included
  return make_zoo(
    "equinox LLaMA-style",
    forward,
    params,
    (tokens(),),
    expected,
    not_symmetries,
    discover_target=(lambda m, ids: m(ids), model),
  )
