"""Pair declarations: what a group is, followers, stacked copies, and malformed pairs (their
resolution on a tree, and every declaration that cannot resolve, is tests/test_plan.py)."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

import models
import saggs_jax as saggs

C = models.CONFIG


def _arr(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


# --- what each factor multiplies ----------------------------------------------


def test_gqa_groups_are_contiguous_blocks():
  """groups=G splits the axis into G contiguous blocks: block g of A times c_g, of B over c_g."""
  rng = np.random.default_rng(0)
  q, k = _arr(rng, 3, 8), _arr(rng, 3, 4)  # 4 query heads of 2, 2 KV heads of 2
  params = {"q": q, "k": k}
  c = np.array([2.0, 5.0], np.float32)
  new, _ = saggs.reparameterize(
    params, None, [saggs.Pair("q", "k", axes=(1, 1), groups=2)], lambda path, shape: c
  )
  np.testing.assert_allclose(new["q"], np.asarray(q) * np.repeat(c, 4)[None], rtol=1e-6)
  np.testing.assert_allclose(new["k"], np.asarray(k) / np.repeat(c, 2)[None], rtol=1e-6)


def test_default_groups_one_per_index_and_negative_axes():
  rng = np.random.default_rng(1)
  up, down = _arr(rng, 3, 5), _arr(rng, 5, 3)
  c = np.arange(1, 6, dtype=np.float32)
  pair = saggs.Pair("up", "down", axes=(-1, -2))
  new, _ = saggs.reparameterize({"up": up, "down": down}, None, [pair], lambda p, s: c)
  np.testing.assert_allclose(new["up"], np.asarray(up) * c[None, :], rtol=1e-6)
  np.testing.assert_allclose(new["down"], np.asarray(down) / c[:, None], rtol=1e-6)


def test_whole_tensor_pair():
  params = {"a": jnp.full((2, 3), 8.0), "b": jnp.ones((4,))}
  plan = saggs._src.plan.resolve([saggs.Pair("a", "b")], params)
  assert [i.factor_shape for i in plan.instances] == [()]
  new, _ = saggs.canonicalize(params, None, [saggs.Pair("a", "b")])
  np.testing.assert_allclose(np.linalg.norm(new["a"]), np.linalg.norm(new["b"]), rtol=1e-6)


def test_followers_move_with_their_kernel_and_are_not_in_the_norms():
  """Query bias scales with the query kernel, key bias with the key kernel, output bias stays."""
  params = models.linen_init(seed=1)
  a = params["params"]["attn"]
  c = np.array([3.0, 0.5], np.float32)
  new, _ = saggs.reparameterize(params, None, saggs.presets.flax_mha(), lambda p, s: c)
  n = new["params"]["attn"]
  np.testing.assert_allclose(
    n["query"]["kernel"], a["query"]["kernel"] * c[None, :, None], rtol=1e-6
  )
  np.testing.assert_allclose(n["query"]["bias"], a["query"]["bias"] * c[:, None], rtol=1e-6)
  np.testing.assert_allclose(n["key"]["kernel"], a["key"]["kernel"] / c[None, :, None], rtol=1e-6)
  np.testing.assert_allclose(n["key"]["bias"], a["key"]["bias"] / c[:, None], rtol=1e-6)
  np.testing.assert_allclose(n["value"]["bias"], a["value"]["bias"] * c[:, None], rtol=1e-6)
  np.testing.assert_allclose(n["out"]["kernel"], a["out"]["kernel"] / c[:, None, None], rtol=1e-6)
  np.testing.assert_array_equal(n["out"]["bias"], a["out"]["bias"])
  np.testing.assert_array_equal(new["params"]["head"]["kernel"], params["params"]["head"]["kernel"])

  # Norms exclude followers: huge biases do not change the balancing factors.
  big = {
    "params": {
      **params["params"],
      "attn": {**a, "query": {**a["query"], "bias": a["query"]["bias"] * 1e3}},
    }
  }
  imb, imb_big = (saggs.imbalance(t, saggs.presets.flax_mha()) for t in (params, big))
  for k in imb:
    np.testing.assert_array_equal(imb[k], imb_big[k])


def test_stacked_factors_have_shape_layers_by_groups():
  params = models.llama_init(2, models.STACKED)
  pairs = saggs.presets.llama(num_kv_heads=C.num_kv_heads, stacked=1)
  state = saggs.saggs(pairs).stage.init(params)
  assert {k: v.shape for k, v in state.factors.items()} == {
    "layers/attn/q_proj/kernel|layers/attn/k_proj/kernel": (C.num_layers, C.num_kv_heads),
    "layers/attn/v_proj/kernel|layers/attn/o_proj/kernel": (C.num_layers, C.num_kv_heads),
    "layers/mlp/up_proj/kernel|layers/mlp/down_proj/kernel": (C.num_layers, C.mlp_hidden),
  }
  np.testing.assert_array_equal(state.step, 0)
  for v in state.factors.values():
    np.testing.assert_array_equal(v, np.ones(v.shape))
  # Layer l of the stack gets its own factors.
  c = np.array([[2.0, 3.0], [0.5, 7.0]], np.float32)
  new, _ = saggs.reparameterize(params, None, pairs[:1], lambda p, s: c)
  q = np.asarray(params["layers"]["attn"]["q_proj"]["kernel"])
  expect = q * np.repeat(c, C.num_heads * C.head_dim // C.num_kv_heads, axis=1)[:, None, :]
  np.testing.assert_allclose(new["layers"]["attn"]["q_proj"]["kernel"], expect, rtol=1e-6)


# --- malformed declarations fail at construction, naming the pair ---------------


@pytest.mark.parametrize(
  "kwargs, msg",
  [
    (dict(a="layers/*/q", b="k"), "different number of wildcards"),
    (dict(a="q", b="k", axes=(1,)), "axes must be None or a pair of ints"),
    (
      dict(a="q", b="k", axes=1),
      r"axes must be None or a pair of ints \(axis_a, axis_b\), got 1\.",
    ),
    (dict(a="q", b="k", axes=(True, 1)), r"axes must be None or a pair of ints .*got \(True, 1\)"),
    (dict(a="q", b="k", axes="11"), "axes must be None or a pair of ints .*got '11'"),
    (dict(a="q", b="k", axes=(1, 1), groups=0), "groups must be a positive int"),
    (dict(a="q", b="k", axes=(1, 1), groups=True), "groups must be a positive int, got True"),
    (dict(a="q", b="k", groups=2), "groups=2 needs a group axis"),
    (dict(a="q", b="k", stacked=-1), "stacked must be an int >= 0"),
    (dict(a="q", b="k", stacked=1.5), "stacked must be an int >= 0 .*got 1.5"),
    (dict(a="q", b="k", stacked="1"), "stacked must be an int >= 0 .*got '1'"),
    (dict(a="q", b="k", stacked=True), "stacked must be an int >= 0 .*got True"),
    (
      dict(a="q", b="k", follow_a="layers/*/b"),
      r"pattern 'layers/\*/b' has a different number of wildcards",
    ),
    (dict(a="q", b="k", follow_b=["kb", 3]), "patterns must be strings or Blocks, got 3"),
    (dict(a="q", b="k", follow_a=3), "patterns must be strings or Blocks, got 3"),
    (dict(a="q", b="k", name=3), "name must be a string or None, got 3"),
    (
      dict(a=("q", 3), b="k"),
      re.escape("Pair(('q', 3), 'k'): patterns must be strings or Blocks, got 3."),
    ),
    (dict(a=1, b="k"), re.escape("Pair(1, 'k'): patterns must be strings or Blocks, got 1.")),
  ],
)
def test_malformed_pair(kwargs, msg):
  with pytest.raises(
    ValueError, match=re.escape("Pair('q', 'k'): ") + msg if kwargs["a"] == "q" else msg
  ):
    saggs.Pair(**kwargs)
