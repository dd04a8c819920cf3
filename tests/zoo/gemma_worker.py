"""The zoo's gemma-package model, run in a process of its own: importing ``gemma.gm`` replaces
flax's ``nn.Module.param`` process-wide.

``python gemma_worker.py OUT_JSON SCRATCH_DIR`` builds ``gm.nn.Transformer`` with a tiny config
(random weights, float32), runs discover and every check of ``zoo_oracle.CHECKS``, and writes
``{"seconds": ..., "found": repr, "checks": {name: "ok" or the traceback}}`` to OUT_JSON.
"""

import json
import sys
import traceback
import zlib


def expected():
  """Q/K per KV head: q_einsum (heads, d, hd) against the k part of kv_einsum (2, kv, d, hd);
  V/O per KV head: its v part against attn_vec_einsum (heads, hd, d); gated MLP: the up part of
  gating_einsum (2, d, hidden) against linear (hidden, d). RMSNorms are (1 + w): no gain pair."""
  import saggs_jax as saggs

  kv = dict(axis=0, parts=("k", "v"))
  up = saggs.Block("mlp/gating_einsum", axis=0, parts=("gate", "up"), part="up")
  return [
    saggs.Pair(
      "attn/q_einsum/w", saggs.Block("attn/kv_einsum/w", part="k", **kv), axes=(0, 1), groups=2
    ),
    saggs.Pair(
      saggs.Block("attn/kv_einsum/w", part="v", **kv),
      "attn/attn_vec_einsum/w",
      axes=(1, 0),
      groups=2,
    ),
    saggs.Pair(up, "mlp/linear", axes=(2, 0)),
  ]


def not_symmetries():
  import saggs_jax as saggs

  kv = dict(axis=0, parts=("k", "v"))
  gating = dict(axis=0, parts=("gate", "up"))
  return [
    saggs.Pair(saggs.Block("mlp/gating_einsum", part="gate", **gating), "mlp/linear", axes=(2, 0)),
    saggs.Pair(
      "pre_attention_norm/scale",
      (
        "attn/q_einsum/w",
        saggs.Block("attn/kv_einsum/w", part="k", **kv),
        saggs.Block("attn/kv_einsum/w", part="v", **kv),
      ),
      axes=(0, (1, 2, 2)),
    ),
    saggs.Pair("pre_ffw_norm/scale", "mlp/gating_einsum", axes=(0, 1)),
  ]


def build():
  """The model, with discover run on it (a ``zoo_oracle.Zoo``)."""
  import jax
  import jax.numpy as jnp
  from gemma import gm

  import zoo_models

  jax.config.update("jax_default_matmul_precision", "highest")
  config = gm.nn.config.TransformerConfig(
    num_embed=zoo_models.VOCAB,
    embed_dim=zoo_models.D,
    hidden_dim=zoo_models.HIDDEN,
    num_heads=zoo_models.HEADS,
    head_dim=zoo_models.D // zoo_models.HEADS,
    num_kv_heads=2,
    final_logit_softcap=None,
    use_post_attn_norm=False,
    use_post_ffw_norm=False,
    attention_types=(gm.nn.config.AttentionType.GLOBAL,) * zoo_models.LAYERS,
  )
  model = gm.nn.Transformer(config=config, dtype=jnp.float32)
  ids = zoo_models.tokens()
  params = model.init(jax.random.key(0), ids)["params"]
  # random weights of the transformers models' scale (gemma's own init is too small for a broken
  # symmetry to show), random gains (gemma initialises them to 0, i.e. a gain of 1)
  params = jax.tree_util.tree_map_with_path(
    lambda kp, x: (
      zoo_models.INIT
      * jax.random.normal(jax.random.key(zlib.crc32(str(kp).encode())), x.shape, x.dtype)
    ),
    params,
  )
  return zoo_models.make_zoo(
    "gemma package",
    lambda p, ids: model.apply({"params": p}, ids).logits,
    params,
    (ids,),
    expected,
    not_symmetries,
    ("*norm/scale",),
  )


def main(out_json, scratch):
  import zoo_oracle

  zoo = build()
  result = {"seconds": zoo.seconds, "found": repr(zoo.found), "checks": {}}
  for name, check in zoo_oracle.CHECKS.items():
    try:
      check(zoo, scratch + "/" + name)
      result["checks"][name] = "ok"
    except Exception:  # reported to the test, which fails with it
      result["checks"][name] = traceback.format_exc()
  with open(out_json, "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main(*sys.argv[1:])
