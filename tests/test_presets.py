"""saggs_jax.presets: the pairs each preset declares, spelt out by hand, its naming options,
and the Muon dimension numbers of a layout. That the pairs are exact symmetries of their models
is checked on the models themselves (tests/test_models.py, test_discover.py); MaxText's
preset: tests/test_presets_maxtext.py."""

import jax
import jax.numpy as jnp
import pytest
from optax.contrib import MuonDimensionNumbers as MDN

from saggs_jax import Block, Pair, presets
from saggs_jax.equivariant import muon_dimension_numbers


def by_path(tree):
  flat = jax.tree_util.tree_flatten_with_path(
    tree, is_leaf=lambda x: x is None or isinstance(x, MDN)
  )[0]
  return {jax.tree_util.keystr(k, simple=True, separator="/"): v for k, v in flat}


def test_llama_declares_qk_vo_and_the_mlp_per_kv_head_with_its_options():
  assert presets.llama(2, stacked=1, prefix="model") == [
    Pair("model/q_proj/kernel", "model/k_proj/kernel", (1, 1), 2, 1, name="attention Q/K"),
    Pair("model/v_proj/kernel", "model/o_proj/kernel", (1, 0), 2, 1, name="attention V/O"),
    Pair("model/up_proj/kernel", "model/down_proj/kernel", (1, 0), None, 1, name="SwiGLU up/down"),
  ]
  qk, vo = presets.llama(4, mlp=False, bias=True, names=presets.LlamaNames(q="wq", o="wo"))
  assert (qk.a, qk.follow_a, qk.follow_b, qk.groups) == (
    "wq/kernel",
    ("wq/bias",),
    ("k_proj/bias",),
    4,
  )
  assert (vo.b, vo.follow_a, vo.follow_b) == ("wo/kernel", ("v_proj/bias",), ())  # o's bias stays


def test_flax_attention_presets_are_one_layout():
  qk, vo = presets.flax_mha(bias=False, stacked=(1,))
  assert (qk.a, qk.b, qk.axes, qk.groups, qk.stacked) == (
    "query/kernel",
    "key/kernel",
    (1, 1),
    None,
    (1,),
  )
  assert (vo.a, vo.b, vo.axes, vo.follow_a) == ("value/kernel", "out/kernel", (1, 0), ())


def test_gpt2_cuts_the_fused_qkv_kernel_into_blocks_and_pairs_its_layernorms():
  qk, vo, ln_1, ln_2 = presets.gpt2(4)
  q, k, v = (Block("attn/c_attn/kernel", axis=0, parts=("q", "k", "v"), part=n) for n in "qkv")
  assert (qk.a, qk.b, qk.groups, vo.a, vo.b) == (q, k, 4, v, "attn/c_proj/kernel")
  assert (ln_1.a, ln_1.b, ln_1.follow_a) == ("ln_1/scale", "attn/c_attn/kernel", ("ln_1/bias",))
  assert (ln_2.a, ln_2.b) == ("ln_2/scale", "mlp/c_fc/kernel")
  assert presets.gpt2(4, norms=False) == [qk, vo]


def test_gpt2_preset_reads_conv1d_kernels_as_out_by_in_and_honours_prefix():
  d = 4
  block = {
    "attn": {
      "c_attn": {"kernel": jnp.ones((3 * d, d)), "bias": jnp.ones(3 * d)},
      "c_proj": {"kernel": jnp.ones((d, d))},
    },
    "mlp": {"c_fc": {"kernel": jnp.ones((4 * d, d))}, "c_proj": {"kernel": jnp.ones((d, 4 * d))}},
    "ln_1": {"scale": jnp.ones(d)},
  }
  params = {"h": {"0": block, "1": block}, "wte": {"embedding": jnp.ones((16, d))}}
  tree = by_path(muon_dimension_numbers(params, "gpt2", prefix="h/1"))
  kernels = ("attn/c_attn", "attn/c_proj", "mlp/c_fc", "mlp/c_proj")
  assert {p: v for p, v in tree.items() if v is not None} == {
    f"h/1/{k}/kernel": MDN(reduction_axis=-1, output_axis=-2) for k in kernels
  }
  with pytest.raises(ValueError, match="Unknown layout 'gpt3'"):
    muon_dimension_numbers(params, "gpt3")
