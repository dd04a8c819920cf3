"""LLaMA-shaped parameter trees as abstract values, for compiling at any size without memory.

:func:`llama` gives the ``jax.ShapeDtypeStruct`` tree of a LLaMA-style decoder
(GQA attention, SwiGLU MLP, RMSNorm gains, untied embedding and LM head; Flax
Dense ``(in, out)`` kernels, the names :func:`saggs_jax.presets.llama`
declares), unrolled (``layers/0/...``) or scanned (one leading layer axis).
:data:`SIZES` holds the 1B, 7B and 70B shapes; :func:`fsdp` shards such a tree
over a mesh axis along each leaf's largest axis.

Example:
  >>> import jax, jax.numpy as jnp, optax
  >>> from harness import shapes
  >>> params = shapes.llama(**shapes.SIZES["1b"], scanned=True)
  >>> params["layers"]["attn"]["k_proj"]["kernel"].shape  # 16 layers, 8 KV heads of 128
  (16, 2048, 1024)
  >>> round(shapes.num_params(params) / 1e9, 2)
  1.14
  >>> state = jax.eval_shape(optax.adamw(1e-3).init, params)  # nothing allocated
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# d_model, layers, KV heads, SwiGLU hidden (head_dim 128, vocabulary 32000).
SIZES = {
  "1b": dict(d_model=2048, num_layers=16, num_kv_heads=8, mlp_hidden=8192),
  "7b": dict(d_model=4096, num_layers=32, num_kv_heads=32, mlp_hidden=11008),
  "70b": dict(d_model=8192, num_layers=80, num_kv_heads=8, mlp_hidden=28672),
}


def llama(
  d_model: int,
  num_layers: int,
  num_kv_heads: int,
  mlp_hidden: int,
  *,
  head_dim: int = 128,
  vocab: int = 32000,
  scanned: bool = False,
  dtype: Any = jnp.float32,
) -> dict:
  """The parameter tree of a LLaMA-style decoder as ``jax.ShapeDtypeStruct`` leaves, with
  ``d_model // head_dim`` query heads; ``scanned`` stacks the layers on a leading axis."""
  heads = d_model // head_dim
  stack = (num_layers,) if scanned else ()

  def leaf(*shape):
    return {"kernel": jax.ShapeDtypeStruct(stack + shape, dtype)}

  def gain():
    return {"scale": jax.ShapeDtypeStruct(stack + (d_model,), dtype)}

  layer = {
    "attn": {
      "q_proj": leaf(d_model, heads * head_dim),
      "k_proj": leaf(d_model, num_kv_heads * head_dim),
      "v_proj": leaf(d_model, num_kv_heads * head_dim),
      "o_proj": leaf(heads * head_dim, d_model),
    },
    "mlp": {
      "gate_proj": leaf(d_model, mlp_hidden),
      "up_proj": leaf(d_model, mlp_hidden),
      "down_proj": leaf(mlp_hidden, d_model),
    },
    "input_norm": gain(),
    "post_attn_norm": gain(),
  }
  return {
    "embed": {"embedding": jax.ShapeDtypeStruct((vocab, d_model), dtype)},
    "layers": layer if scanned else {str(i): layer for i in range(num_layers)},
    "norm": {"scale": jax.ShapeDtypeStruct((d_model,), dtype)},
    "lm_head": {"kernel": jax.ShapeDtypeStruct((d_model, vocab), dtype)},
  }


def num_params(tree: Any) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def num_bytes(tree: Any) -> int:
  return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def fsdp(tree: Any, mesh: Mesh, axis: str) -> Any:
  """``tree``'s leaves typed with a sharding over mesh axis ``axis`` along their largest
  axis (the first of equals) where it divides, replicated otherwise (scalars)."""

  def shard(x):
    spec: list[str | None] = [None] * len(x.shape)
    if x.shape:
      i = int(np.argmax(x.shape))
      if x.shape[i] % mesh.shape[axis] == 0:
        spec[i] = axis
    return jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec))
    )

  return jax.tree.map(shard, tree)
