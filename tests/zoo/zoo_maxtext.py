"""The zoo's MaxText models: tiny configs of MaxText 0.2.5's own model files, built on the CPU
with random weights, as ``(params, apply)`` with ``apply(params, tokens) -> logits`` pure.

MaxText stores a scanned layer stack with its layer axis at ``param_scan_axis`` (1 by
default): ``query/kernel`` is (emb, layers, heads, head_dim), ``out/kernel`` (heads, layers,
head_dim, emb), ``wi_0`` (emb, layers, mlp), ``wo`` (mlp, layers, emb), norm scales
(emb, layers); MoE experts (experts, layers, emb, mlp) and the router ``gate/kernel``
(emb, layers, experts). The expected lists below are written from the architectures' math on
those layouts (``stacked=(1,)``: the layer axis is a copy axis; the experts' own axis is one
more, ``stacked=(0, 1)``).
"""

import functools
import os
import zlib

import jax
import jax.numpy as jnp

import saggs_jax as saggs
from zoo_models import make_zoo, tokens

VOCAB, D, MLP, LAYERS, HEADS, KV, HEAD_DIM, EXPERTS = 64, 32, 48, 2, 4, 2, 8, 4
INIT = 0.3  # weights' std, as the other zoo models: a broken symmetry shows in the logits

# MaxText model files -> the tiny overrides each needs beyond the shared ones
MODELS = {
  "llama2": ("llama2-7b", {}),
  "mistral": ("mistral-7b", {}),
  "mixtral": ("mixtral-8x7b", dict(num_experts=EXPERTS, num_experts_per_tok=2)),
  "qwen3": ("qwen3-0.6b", {}),
  "gemma": ("gemma-2b", {}),
  "gemma2": ("gemma2-2b", dict(sliding_window_size=4)),
  "gemma3": ("gemma3-4b", dict(sliding_window_size=4, use_multimodal=False)),
  "deepseek": (
    "deepseek3-tiny",
    dict(
      num_experts=EXPERTS,
      num_experts_per_tok=2,
      first_num_dense_layers=1,
      base_num_kv_heads=HEADS,
      q_lora_rank=16,
      kv_lora_rank=8,
      qk_nope_head_dim=8,
      qk_rope_head_dim=4,
      v_head_dim=8,
      rope_type="default",
    ),
  ),
}


def config(name: str, **overrides):
  """MaxText's pyconfig for the tiny ``name`` (a key of :data:`MODELS`)."""
  import maxtext
  from maxtext.configs import pyconfig

  model_name, extra = MODELS[name]
  base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  settings = dict(
    model_name=model_name,
    override_model_config=True,
    base_emb_dim=D,
    base_num_query_heads=HEADS,
    base_num_kv_heads=KV,
    base_mlp_dim=MLP,
    base_moe_mlp_dim=MLP,
    base_num_decoder_layers=LAYERS,
    head_dim=HEAD_DIM,
    vocab_size=VOCAB,
    max_target_length=8,
    per_device_batch_size=2,
    dtype="float32",
    weight_dtype="float32",
    matmul_precision="highest",
    attention="dot_product",
    sparse_matmul=False,  # the dense MoE path: the CPU has no megablox kernel
    capacity_factor=-1.0,
    run_name="zoo",
    base_output_directory="/tmp/saggs_zoo_maxtext",
    enable_checkpointing=False,
    skip_jax_distributed_system=True,
    scan_layers=True,
  )
  return pyconfig.initialize([None, base], **{**settings, **extra, **overrides})


def randomize(params):
  """Every leaf redrawn: kernels N(0, INIT^2), norm scales exp(N(0, INIT^2)) (unbalanced gains)."""

  def draw(kp, x):
    key = jax.random.key(zlib.crc32(jax.tree_util.keystr(kp).encode()))
    z = jax.random.normal(key, x.shape, x.dtype)
    return jnp.exp(INIT * z) if "scale" in jax.tree_util.keystr(kp) else INIT * z

  return jax.tree_util.tree_map_with_path(draw, params)


def build(name: str, **overrides):
  """``(cfg, params, apply)``: the tiny model's nnx.Param state as a pure dict, randomized,
  and the logits of ``apply(params, tokens)``."""
  from flax import nnx
  from maxtext.utils import model_creation_utils

  cfg = config(name, **overrides)
  create, _ = model_creation_utils.create_nnx_abstract_model(cfg)
  graphdef, state, rest = nnx.split(create(), nnx.Param, ...)
  params = randomize(nnx.to_pure_dict(state))

  def apply(params, ids):
    st = jax.tree.map(lambda v: v, state)
    nnx.replace_by_pure_dict(st, params)
    model = nnx.merge(graphdef, st, rest, copy=True)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return model(ids, positions, decoder_segment_ids=jnp.ones_like(ids), enable_dropout=False)

  return cfg, params, apply


# ---------------------------------------------------------------------------
# The architectures' symmetries on MaxText's layouts (layer axis at 1 unless scan_axis=0).


def _attention(prefix, stacked):
  """Q/K and V/O per KV head (RoPE rotates within a head; query heads h*KV//HEADS share KV head
  h // (HEADS // KV)); the pre-attention gain against the rows of Q, K, V."""
  attn = prefix + "self_attention/"
  return [
    saggs.Pair(attn + "query/kernel", attn + "key/kernel", axes=(1, 1), groups=KV, stacked=stacked),
    saggs.Pair(attn + "value/kernel", attn + "out/kernel", axes=(1, 0), groups=KV, stacked=stacked),
    saggs.Pair(
      prefix + "pre_self_attention_layer_norm/scale",
      tuple(attn + f"{x}/kernel" for x in ("query", "key", "value")),
      axes=(0, 0),
      stacked=stacked,
    ),
  ]


def _mlp(prefix, stacked):
  """SwiGLU up/down per channel; the post-attention gain against the rows of gate and up."""
  return [
    saggs.Pair(prefix + "mlp/wi_1/kernel", prefix + "mlp/wo/kernel", axes=(1, 0), stacked=stacked),
    saggs.Pair(
      prefix + "post_self_attention_layer_norm/scale",
      (prefix + "mlp/wi_0/kernel", prefix + "mlp/wi_1/kernel"),
      axes=(0, 0),
      stacked=stacked,
    ),
  ]


FINAL = saggs.Pair("decoder/decoder_norm/scale", "decoder/logits_dense/kernel", axes=(0, 0))


def llama_like(stacked=(1,), prefix="decoder/layers/") -> list:
  """llama2, mistral: attention, SwiGLU and every RMSNorm gain (see the parts)."""
  return [*_attention(prefix, stacked), *_mlp(prefix, stacked), FINAL]


def llama_not(stacked=(1,), prefix="decoder/layers/") -> list:
  """Gate/down under SiLU is no symmetry; nor is Q/K along the layer axis."""
  return [
    saggs.Pair(prefix + "mlp/wi_0/kernel", prefix + "mlp/wo/kernel", axes=(1, 0), stacked=stacked)
  ]


def mixtral(stacked=(1,)) -> list:
  """Attention as LLaMA; per expert and layer, SwiGLU up/down per channel; the post-attention
  gain against the rows of the router and of every expert's gate and up (the router reads the
  same normalised x)."""
  moe = "decoder/layers/MoeBlock_0/"
  return [
    *_attention("decoder/layers/", stacked),
    saggs.Pair(moe + "wi_1", moe + "wo", axes=(1, 0), stacked=(0, 1)),
    saggs.Pair(
      "decoder/layers/post_self_attention_layer_norm/scale",
      (moe + "gate/kernel", moe + "wi_0", moe + "wi_1"),
      axes=(0, (0, 1, 1)),
      stacked=stacked,
    ),
    FINAL,
  ]


def mixtral_not() -> list:
  moe = "decoder/layers/MoeBlock_0/"
  return [saggs.Pair(moe + "wi_0", moe + "wo", axes=(1, 0), stacked=(0, 1))]


def qwen3(stacked=(1,)) -> list:
  """Qwen3 (QK-norm, tied embedding): V/O, SwiGLU and the two gains per layer as LLaMA; its
  Q/K pair is moot (each side is normalised away), and the final gain reads into the tied
  embedding, which also feeds the first layer: neither is listed."""
  return [_attention("decoder/layers/", stacked)[i] for i in (1, 2)] + _mlp(
    "decoder/layers/", stacked
  )


def deepseek() -> list:
  """DeepSeek-V3 (MLA): SwiGLU up/down per channel in the dense layer, the shared expert and
  every routed expert (MLA's low-rank projections are left to discover: not listed)."""
  moe = "decoder/moe_layers/DeepSeekMoeBlock_0/"
  return [
    *_mlp("decoder/dense_layers/", (1,))[:1],
    saggs.Pair(
      moe + "shared_experts/wi_1/kernel",
      moe + "shared_experts/wo/kernel",
      axes=(1, 0),
      stacked=(1,),
    ),
    saggs.Pair(moe + "MoeBlock_0/wi_1", moe + "MoeBlock_0/wo", axes=(1, 0), stacked=(0, 1)),
  ]


def deepseek_not() -> list:
  moe = "decoder/moe_layers/DeepSeekMoeBlock_0/"
  return [
    saggs.Pair(moe + "MoeBlock_0/wi_0", moe + "MoeBlock_0/wo", axes=(1, 0), stacked=(0, 1)),
    saggs.Pair(
      "decoder/dense_layers/mlp/wi_0/kernel",
      "decoder/dense_layers/mlp/wo/kernel",
      axes=(1, 0),
      stacked=(1,),
    ),
  ]


@functools.cache
def zoo(name: str, **overrides):
  """The :class:`zoo_oracle.Zoo` of a tiny MaxText model, discover run on it."""
  cfg, params, apply = build(name, **overrides)
  stacked = (0,) if overrides.get("param_scan_axis") == 0 else (1,)
  if name in ("llama2", "mistral"):
    expected, not_symmetries = (lambda: llama_like(stacked)), (lambda: llama_not(stacked))
  elif name == "mixtral":
    expected, not_symmetries = (lambda: mixtral(stacked)), mixtral_not
  elif name == "qwen3":
    expected, not_symmetries = (lambda: qwen3(stacked)), (lambda: llama_not(stacked))
  else:
    expected, not_symmetries = deepseek, deepseek_not
  if overrides.get("scan_layers") is False:  # layers_0, layers_1, ...: no copy axis
    expected, not_symmetries = (
      lambda: llama_like(0, "decoder/layers_*/"),
      lambda: llama_not(0, "decoder/layers_*/"),
    )
  suffix = "".join(f" {k}={v}" for k, v in sorted(overrides.items()))
  return make_zoo(f"maxtext {name}{suffix}", apply, params, (tokens(),), expected, not_symmetries)
