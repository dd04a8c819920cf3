"""The path pattern language: segments, wildcards, implicit prefix, Flax containers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
import saggs_jax as saggs
from saggs_jax._src import paths
from saggs_jax._src.plan import resolve

# --- match -----------------------------------------------------------------


@pytest.mark.parametrize(
  "pattern, path, captures",
  [
    # literal suffix: everything in front is the implicit prefix capture
    ("attn/wq", "attn/wq", ("",)),
    ("attn/wq", "params/layers/0/attn/wq", ("params/layers/0",)),
    ("wq", "a/b/wq", ("a/b",)),
    # '*' within one segment, alone or inside text
    ("layers/*/attn/wq", "layers/3/attn/wq", ("", "3")),
    ("layers/*/attn/wq", "params/layers/12/attn/wq", ("params", "12")),
    ("layers_*/attn/wq", "params/layers_7/attn/wq", ("params", "7")),
    ("*_proj/kernel", "attn/q_proj/kernel", ("attn", "q")),
    ("*/*", "x/y/z", ("x", "y", "z")),
    ("a*b*c", "aXbYc", ("", "X", "Y")),
    ("a*", "a", ("", "")),  # '*' may match the empty string
    # '**' spans any number of segments, zero included (shortest first)
    ("a/**/k", "a/k", ("", "")),
    ("a/**/k", "a/b/k", ("", "b")),
    ("a/**/k", "a/b/c/d/k", ("", "b/c/d")),
    ("**/k", "a/b/k", ("", "a/b")),
    ("decoder/**/wq", "model/decoder/layers/1/attn/wq", ("model", "layers/1/attn")),
    ("**", "a/b", ("", "a/b")),
  ],
)
def test_match_captures(pattern, path, captures):
  assert paths.match(pattern, path) == captures
  assert len(captures) == paths.num_captures(pattern)


@pytest.mark.parametrize(
  "pattern, path",
  [
    ("attn/wq", "attn/wq/extra"),  # anchored at the end of the path
    ("wq", "attn/xwq"),  # whole segments only, no partial match
    ("wq", "attn/wqx"),
    ("q", "attn/wq"),
    ("a/*/k", "a/b/c/k"),  # '*' never crosses '/'
    ("a*b", "a/b"),
    ("a.b", "axb"),  # regex metacharacters are literal
    ("w[q]", "wq"),
    ("layers/*/wq", "wq"),
    ("a/**/k", "a/b/k/c"),
    ("x", ""),
  ],
)
def test_no_match(pattern, path):
  assert paths.match(pattern, path) is None


def test_literal_metacharacters_match_themselves():
  assert paths.match("a.b", "p/a.b") == ("p",)
  assert paths.match("w[q]", "w[q]") == ("",)


@pytest.mark.parametrize("bad", ["", "/a", "a/", "a**", "a/b**c/d"])
def test_bad_patterns(bad):
  with pytest.raises(ValueError, match="Bad path pattern"):
    paths.match(bad, "a/b")


# --- path strings -----------------------------------------------------------


def test_path_components_dict_sequence_attribute():
  tree = {"layers": [{"w": jnp.zeros(1)}, (jnp.zeros(2), jnp.zeros(3))], "top": jnp.zeros(4)}
  got = {p: leaf.shape for p, leaf in paths.leaves_with_paths(tree)}
  assert got == {"layers/0/w": (1,), "layers/1/0": (2,), "layers/1/1": (3,), "top": (4,)}


def test_trailing_value_dropped_but_not_inner_or_lone():
  """A trailing ``value`` (a Flax Variable box) is dropped; elsewhere it is kept."""
  tree = {"attn": {"value": {"kernel": {"value": jnp.zeros(1)}}}, "value": jnp.zeros(2)}
  got = {p for p, _ in paths.leaves_with_paths(tree)}
  # "attn/value/kernel/value" -> the module named "value" stays, the box goes;
  # a lone top-level "value" is a real name and stays.
  assert got == {"attn/value/kernel", "value"}


def _flax_trees():
  """The same weights as a plain dict, a Linen ``{"params": ...}`` tree and an ``nnx.State``."""
  model = models.nnx_model(seed=3)
  state = nnx.state(model, nnx.Param)
  pure = nnx.to_pure_dict(state)
  return pure, {"params": pure}, state


def test_nnx_state_paths_equal_plain_dict_paths():
  pure, linen, state = _flax_trees()
  state_paths = [p for p, _ in paths.leaves_with_paths(state)]
  assert state_paths == [p for p, _ in paths.leaves_with_paths(pure)]
  assert "attn/value/kernel" in state_paths and "attn/query/bias" in state_paths
  assert [p for p, _ in paths.leaves_with_paths(linen)] == ["params/" + p for p in state_paths]


def test_same_patterns_resolve_to_same_leaves_across_containers():
  pure, linen, state = _flax_trees()
  pairs = saggs.presets.flax_mha()
  plans = [resolve(pairs, t) for t in (pure, linen, state)]

  def summary(plan, strip=""):
    return sorted(
      (
        i.pair.name,
        i.a.removeprefix(strip),
        i.b.removeprefix(strip),
        tuple(f.removeprefix(strip) for f in i.followers_a + i.followers_b),
        i.factor_shape,
      )
      for i in plan.instances
    )

  expected = [
    (
      "attention Q/K",
      "attn/query/kernel",
      "attn/key/kernel",
      ("attn/query/bias", "attn/key/bias"),
      (models.MHA_HEADS,),
    ),
    (
      "attention V/O",
      "attn/value/kernel",
      "attn/out/kernel",
      ("attn/value/bias",),
      (models.MHA_HEADS,),
    ),
  ]
  assert summary(plans[0]) == expected
  assert summary(plans[1], "params/") == expected
  assert summary(plans[2]) == expected
  # Same leaves, so same metric values.
  vals = [saggs.imbalance(t, pairs) for t in (pure, linen, state)]
  assert len(vals[0]) == 2
  for k, v in vals[0].items():
    a, b = k.split("|")
    np.testing.assert_array_equal(v, vals[1][f"params/{a}|params/{b}"])
    np.testing.assert_array_equal(v, vals[2][k])


def test_wildcard_captures_pair_layers():
  """``layers/*/...`` pairs layer i's A with layer i's B, never across layers."""
  tree = {
    "layers": {
      str(i): {"q": jnp.full((2, 2), float(i + 1)), "k": jnp.ones((2, 2))} for i in range(3)
    }
  }
  plan = resolve([saggs.Pair("layers/*/q", "layers/*/k")], tree)
  assert sorted((i.a, i.b) for i in plan.instances) == [
    (f"layers/{i}/q", f"layers/{i}/k") for i in range(3)
  ]
  # Implicit prefix capture does the same without a wildcard.
  plan2 = resolve([saggs.Pair("q", "k")], tree)
  assert sorted((i.a, i.b) for i in plan2.instances) == sorted((i.a, i.b) for i in plan.instances)
  # Pairing is by capture: the imbalance of layer i is log(i + 1).
  imb = saggs.imbalance(tree, [saggs.Pair("q", "k")])
  for i in range(3):
    np.testing.assert_allclose(imb[f"layers/{i}/q|layers/{i}/k"], np.log(i + 1), atol=1e-6)


# --- nearest ---------------------------------------------------------------

_LAYERS = [f"layers/{i}/attn/{m}_proj/kernel" for i in range(3) for m in "qkv"] + ["embed"]


@pytest.mark.parametrize(
  "pattern, candidates, n, expected",
  [
    # Scored on the closest suffix, so a missing prefix costs nothing; one path per weight.
    (
      "atn/q_proj/kernel",
      _LAYERS,
      2,
      ["layers/0/attn/q_proj/kernel", "layers/0/attn/k_proj/kernel"],
    ),
    (
      "attn/q_proj/kernl",
      _LAYERS,
      3,
      ["layers/0/attn/q_proj/kernel", "layers/0/attn/k_proj/kernel", "layers/0/attn/v_proj/kernel"],
    ),
    # A suffix that spans the layer index: still one suggestion per weight.
    (
      "layers/*/atn/q_proj",
      _LAYERS,
      2,
      ["layers/0/attn/q_proj/kernel", "layers/0/attn/k_proj/kernel"],
    ),
    # The layer the pattern names wins among copies of one weight.
    ("layers/2/atn/v_proj", _LAYERS, 1, ["layers/2/attn/v_proj/kernel"]),
    # A deep path is not penalised for its length.
    (
      "decoder/atn/wq",
      ["params/model/decoder/layers_11/attn/wq", "params/model/embed"],
      3,
      ["params/model/decoder/layers_11/attn/wq"],
    ),
    # Nothing with a ratio of at least 0.6.
    ("mlp/up", _LAYERS, 3, []),
    ("x", [], 3, []),
  ],
)
def test_nearest(pattern, candidates, n, expected):
  assert paths.nearest(pattern, candidates, n) == expected


def test_arrays_are_jax_numpy_or_abstract_and_everything_else_is_static():
  """As eqx.filter(tree, eqx.is_array) keeps them: JAX arrays (tracers under jit included),
  NumPy arrays and scalars, and ShapeDtypeStructs; functions and Python numbers are static."""
  arrays = [
    jnp.ones(2),
    np.ones(2),
    np.float32(1),
    jax.ShapeDtypeStruct((2,), jnp.float32),
    jax.random.key(0),
  ]
  static = [jax.nn.relu, 1.0, 3, True, "text"]
  assert all(map(paths.is_array, arrays)) and not any(map(paths.is_array, static))
  assert jax.jit(lambda x: jnp.asarray(paths.is_array(x)))(jnp.ones(2))
  tree = {"w": jnp.ones(2), "act": jax.nn.relu, "drop": {"p": 0.1, "inference": True}, "n": 3}
  assert [p for p, _ in paths.arrays_with_paths(tree)] == ["w"]


def test_is_parameter_is_an_inexact_array_concrete_or_abstract():
  """The one "is a parameter" predicate of discover, transport and the degree probe."""
  yes = [
    jnp.ones(2),
    np.ones(2, np.float16),
    np.float32(1.0),
    jax.ShapeDtypeStruct((2,), jnp.bfloat16),
    jnp.ones(2, jnp.complex64),
  ]
  no = [jnp.arange(2), np.ones(2, bool), jax.ShapeDtypeStruct((2,), jnp.int32), 1.0, None, "x"]
  no.append(jax.nn.relu)
  assert [paths.is_parameter(x) for x in yes] == [True] * len(yes)
  assert [paths.is_parameter(x) for x in no] == [False] * len(no)
  traced = []
  jax.jit(lambda x, i: traced.extend([paths.is_parameter(x), paths.is_parameter(i)]))(
    jnp.ones(2), jnp.arange(2)
  )
  assert traced == [True, False]
