"""The zoo's EasyDeL 0.3.0 models (Flax nnx): Qwen3 (QK-norm), Gemma 3 (QK-norm, sandwich
``(1 + w)`` norms, GeGLU) and gpt-oss (attention sinks, q/k/v/o biases, clamped SwiGLU experts,
a router with a bias), tiny configs with random weights, as ``apply(params, tokens) -> logits``
on the pure nnx.Param dict. Kernels are Flax (in, out); norm gains are named ``kernel``.

EasyDeL rewrites XLA_FLAGS with GPU-only flags at import unless ``EASYDEL_AUTO=0``, which the
CPU's XLA rejects: it is set here, before easydel is imported.
"""

import functools
import os
import warnings
import zlib

os.environ.setdefault("EASYDEL_AUTO", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import saggs_jax as saggs  # noqa: E402
from zoo_models import make_zoo, tokens  # noqa: E402

VOCAB, D, F, LAYERS, HEADS, KV, HD, EXPERTS = 64, 32, 48, 2, 4, 2, 8, 4
INIT = 0.3


def build(name: str):
  """``(params, apply)`` of the tiny ``name`` ("qwen3", "gemma3" or "gpt_oss")."""
  import easydel as ed
  from flax import nnx

  common = dict(
    vocab_size=VOCAB,
    hidden_size=D,
    intermediate_size=F,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV,
    head_dim=HD,
    max_position_embeddings=64,
    tie_word_embeddings=False,
  )
  if name == "qwen3":
    config, cls = ed.Qwen3Config(**common), ed.Qwen3ForCausalLM
  elif name == "gemma3":
    config, cls = ed.Gemma3TextConfig(**common), ed.Gemma3ForCausalLM
  elif name == "gpt_oss":
    config = ed.GptOssConfig(**common, num_local_experts=EXPERTS, num_experts_per_tok=2)
    cls = ed.GptOssForCausalLM
  else:
    raise ValueError(name)
  # vanilla attention, in float32 (its dtype and softmax default to bfloat16: 1e-2 of noise)
  config.attn_mechanism = "vanilla"
  config.attn_dtype = config.attn_softmax_dtype = jnp.float32
  model = cls(
    config, dtype=jnp.float32, param_dtype=jnp.float32, precision="highest", rngs=nnx.Rngs(0)
  )
  graphdef, state, rest = nnx.split(model, nnx.Param, ...)
  mesh = model.mesh

  def draw(kp, x):  # gains exp(N(0, INIT^2)) ((1 + w) gains too), the rest N(0, INIT^2)
    path = jax.tree_util.keystr(kp)
    z = jax.random.normal(jax.random.key(zlib.crc32(path.encode())), x.shape, x.dtype)
    return jnp.exp(INIT * z) if "norm" in path else INIT * z

  params = jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state))

  def apply(params, ids):
    st = jax.tree.map(lambda v: v, state)
    nnx.replace_by_pure_dict(st, params)
    # EasyDeL's sharding constraints look the mesh up from `with mesh:` (jax.set_mesh cannot be
    # entered under jit), which jax 0.11 deprecates
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      with mesh:
        return nnx.merge(graphdef, st, rest, copy=True)(input_ids=ids).logits

  return params, apply


# ---------------------------------------------------------------------------
# The architectures' symmetries and roles (HF names; q/k/v (d, heads*hd), o (heads*hd, d)).

ATTN = "self_attn/"


def _vo(bias=False):
  """V/O per KV head (query heads 2g, 2g+1 read KV head g); V's bias follows its columns."""
  follow = dict(follow_a=ATTN + "v_proj/bias") if bias else {}
  return saggs.Pair(
    ATTN + "v_proj/kernel", ATTN + "o_proj/kernel", axes=(1, 0), groups=KV, **follow
  )


def _input_gain():
  return saggs.Pair(
    "input_layernorm/kernel", tuple(ATTN + f"{x}_proj/kernel" for x in "qkv"), axes=(0, 0)
  )


UP_DOWN = saggs.Pair("mlp/up_proj/kernel", "mlp/down_proj/kernel", axes=(1, 0))
GATE_DOWN = saggs.Pair("mlp/gate_proj/kernel", "mlp/down_proj/kernel", axes=(1, 0))
FINAL = saggs.Pair("model/norm/kernel", "lm_head/kernel", axes=(0, 0))


def qwen3() -> list:
  """Qwen3: V/O; the q_norm/k_norm gains, one factor per layer (the gain is shared by the heads
  and a scalar commutes with RoPE); SwiGLU up/down per channel; each RMSNorm gain against the
  rows it feeds. Q/K kernels are moot under QK-norm (not listed)."""
  return [
    _vo(),
    saggs.Pair(ATTN + "q_norm/kernel", ATTN + "k_norm/kernel", axes=(0, 0), groups=1),
    UP_DOWN,
    _input_gain(),
    saggs.Pair(
      "post_attention_layernorm/kernel", ("mlp/gate_proj/kernel", "mlp/up_proj/kernel"), axes=(0, 0)
    ),
    FINAL,
  ]


def gemma3() -> list:
  """Gemma 3: V/O and GeGLU up/down. Its norms multiply by (1 + w): no gain pair; Q/K is moot
  under QK-norm."""
  return [_vo(), UP_DOWN]


def gemma3_not() -> list:
  return [GATE_DOWN, _input_gain()]


def gpt_oss() -> list:
  """gpt-oss: Q/K per KV head with their biases (the sinks add to the logits, which Q/K keeps),
  V/O with V's bias; the input gain against Q, K, V rows; the final gain. Its experts compute
  clamp(gate)·(clamp(up) + 1): no up/down pair. (The post-attention gain against the router's
  and the experts' rows moves EasyDeL's logits by 1e-2: its MoE block reads the normalised x
  elsewhere too; not listed.)"""
  return [
    saggs.Pair(
      ATTN + "q_proj/kernel",
      ATTN + "k_proj/kernel",
      axes=(1, 1),
      groups=KV,
      follow_a=ATTN + "q_proj/bias",
      follow_b=ATTN + "k_proj/bias",
    ),
    _vo(bias=True),
    _input_gain(),
    FINAL,
  ]


def gpt_oss_not() -> list:
  e = "mlp/experts/"
  return [
    saggs.Pair(
      e + "up_proj/kernel",
      e + "down_proj/kernel",
      axes=(1, 0),
      stacked=1,
      follow_a=e + "up_proj/bias",
    )
  ]


DENSE_ROLES = {
  "embedding": ("model/embed_tokens/embedding",),
  "lm_head": ("lm_head/kernel",),
  "query": (ATTN + "q_proj/kernel",),
  "key_value": (ATTN + "k_proj/kernel", ATTN + "v_proj/kernel"),
  "output": (ATTN + "o_proj/kernel",),
  "gate_up": ("mlp/gate_proj/kernel", "mlp/up_proj/kernel"),
  "down": ("mlp/down_proj/kernel",),
}
ROLES = {
  "qwen3": DENSE_ROLES,
  "gemma3": DENSE_ROLES,
  "gpt_oss": {
    **{r: DENSE_ROLES[r] for r in ("embedding", "lm_head", "query", "key_value", "output")},
    "router": ("mlp/router/kernel",),
    "experts": tuple(f"mlp/experts/{x}_proj/kernel" for x in ("gate", "up", "down")),
  },
}
LISTS = {
  "qwen3": (qwen3, lambda: [GATE_DOWN], ()),
  "gemma3": (gemma3, gemma3_not, ("*norm/kernel",)),
  "gpt_oss": (gpt_oss, gpt_oss_not, ()),
}


@functools.cache
def zoo(name: str):
  params, apply = build(name)
  expected, not_symmetries, untouched = LISTS[name]
  return make_zoo(
    f"easydel {name}", apply, params, (tokens(),), expected, not_symmetries, untouched
  )
