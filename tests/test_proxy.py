"""The proxy the degree probe runs on: the parameters' layout (paths, ranks, pairs, slots,
fused blocks) with a few entries per group whatever the width, at every proxy the measure may
fall back to."""

import jax
import jax.numpy as jnp
import pytest

import saggs_jax as saggs
from saggs_jax._src import proxy
from saggs_jax._src.plan import resolve
from test_degrees import PARAMS, PER_TENSOR
from test_degrees_scale import llama_block


@pytest.mark.parametrize("whole, most", proxy.PROXIES)
def test_every_proxy_keeps_a_pair_per_tensor_one_factor(whole, most):
  """A pair with one group per tensor (axes=None) has factors of shape stacked_shape at every
  proxy the measure may fall back to."""
  plan = saggs._src.plan.resolve(PER_TENSOR, PARAMS)
  small = proxy.proxy(plan, whole, most)
  assert small.instances[0].factor_shape == ()
  assert all(s.groups == 1 for found in small.slots.values() for s in found)


def test_the_proxy_is_a_few_entries_per_group_whatever_the_width():
  params = llama_block(8192, 64, 8, 128, 28672, layers=80)
  plan = resolve(saggs.presets.llama(num_kv_heads=8, stacked=1), params)
  small = proxy.proxy(plan)
  assert set(small.shapes) == set(plan.shapes)
  for path, shape in small.shapes.items():
    assert len(shape) == len(plan.shapes[path])
    assert max(shape) <= proxy.KEEP * proxy.GROUPS, (path, shape)
  for inst in small.instances:  # two layers, three of the KV heads (or MLP channels)
    assert inst.factor_shape == (proxy.KEEP, proxy.GROUPS)
  for path, slots in small.slots.items():
    for cut, whole in zip(slots, plan.slots[path]):
      assert (cut.key, cut.sign, cut.axis, cut.stacked) == (
        whole.key,
        whole.sign,
        whole.axis,
        whole.stacked,
      )


def test_a_fused_leaf_keeps_its_blocks_in_the_proxy():
  """GPT-2's q|k|v rows: each block cut to its first groups, the blocks still disjoint and
  each group's entries together."""
  qkv = dict(axis=1, parts=("q", "k", "v"))
  pair = saggs.Pair(
    saggs.Block("c_attn", part="q", **qkv),
    saggs.Block("c_attn", part="k", **qkv),
    axes=(1, 1),
    groups=12,
  )
  params = {"c_attn": jax.ShapeDtypeStruct((768, 3 * 768), jnp.float32)}
  small = proxy.proxy(resolve(pair, params))
  assert small.shapes["c_attn"] == (2, 2 * 3 * 2 + 2)  # q, k: 3 groups of 2; v: 2 entries
  assert sorted(s.block for s in small.slots["c_attn"]) == [(1, 0, 6), (1, 6, 12)]
