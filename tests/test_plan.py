"""Resolving pairs on a tree (saggs_jax._src.plan): describe, every accepted form, and every
declaration that fails at init or would be silently wrong."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import equinox_mlp
import models
import saggs_jax as saggs

C = models.CONFIG


def _arr(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


# --- what declarations resolve to ------------------------------------------------


def test_describe_lists_every_resolved_leaf():
  params = models.llama_init(0)
  text = saggs.describe(params, saggs.presets.llama(num_kv_heads=C.num_kv_heads))
  for layer in range(C.num_layers):
    for m in (
      "attn/q_proj",
      "attn/k_proj",
      "attn/v_proj",
      "attn/o_proj",
      "mlp/up_proj",
      "mlp/down_proj",
    ):
      assert f"layers/{layer}/{m}/kernel" in text
  assert "gate_proj" not in text and "norm" not in text
  factors = C.num_layers * (2 * C.num_kv_heads + C.mlp_hidden)
  assert text.splitlines()[-1] == f"6 pair instances, {factors} factors in all."


def test_describe_counts_one_instance_in_the_singular():
  params = {"q": jnp.ones((2, 4)), "k": jnp.ones((2, 4))}
  assert saggs.describe(params, [saggs.Pair("q", "k")]).splitlines()[-1] == (
    "1 pair instance, 1 factor in all."
  )
  assert saggs.describe(params, [saggs.Pair("q", "k", axes=(1, 1))]).splitlines()[-1] == (
    "1 pair instance, 4 factors in all."
  )


def test_valid_declarations_resolve():
  """Every accepted form: followers on both sides, groups, numpy ints, list axes, low precision."""
  rng = np.random.default_rng(8)
  params = {
    "q": _arr(rng, 3, 8),
    "k": _arr(rng, 3, 8),
    "qb": _arr(rng, 8),
    "kb": _arr(rng, 8),
    "v": jnp.ones((2, 5, 4), jnp.bfloat16),
    "o": jnp.ones((2, 4, 5), jnp.float16),
    "step": jnp.zeros((), jnp.int32),
    "mask": jnp.ones((3,), bool),
  }  # not in any pair
  pairs = [
    saggs.Pair("q", "k", axes=[1, -1], groups=np.int64(2), follow_a="qb", follow_b=("kb",)),
    saggs.Pair("v", "o", axes=(1, 0), stacked=np.int32(1)),
  ]
  plan = saggs._src.plan.resolve(pairs, params)
  assert [(i.a, i.b, i.followers_a, i.followers_b, i.factor_shape) for i in plan.instances] == [
    ("q", "k", ("qb",), ("kb",), (2,)),
    ("v", "o", (), (), (2, 4)),
  ]
  assert pairs[0].axes == (1, -1) and type(pairs[0].groups) is int
  assert {path: [(s.sign, s.axis) for s in slots] for path, slots in plan.slots.items()} == {
    "q": [(1, 1)],
    "qb": [(1, 0)],
    "k": [(-1, 1)],
    "kb": [(-1, 0)],
    "v": [(1, 2)],
    "o": [(-1, 1)],
  }
  _init(pairs, params)


# --- bad declarations fail at init, naming the pattern or path -------------------


def _init(pairs, params):
  return saggs.chain(optax.adam(1e-3), saggs.saggs(pairs)).init(params)


def _layers():
  rng = np.random.default_rng(3)
  return {
    "layers": {
      str(i): {"q": _arr(rng, 4, 6), "k": _arr(rng, 4, 6), "b": _arr(rng, 6)} for i in range(2)
    }
  }


def test_pattern_matching_nothing():
  with pytest.raises(ValueError, match=re.escape("'layers/*/wq'") + ".*matches no parameter"):
    _init([saggs.Pair("layers/*/wq", "layers/*/k")], _layers())
  with pytest.raises(ValueError, match=re.escape("'nope' matches no parameter path.")):
    _init([saggs.Pair("q", "k", follow_a="nope")], _layers())


def test_misspelled_pattern_suggests_nearest_paths():
  """Up to three suggestions, one per weight rather than one per layer."""
  pairs = [saggs.Pair("atn/q_proj/kernel", "attn/k_proj/kernel", axes=(1, 1), groups=2)]
  expect = (
    "pattern 'atn/q_proj/kernel' matches no parameter path; did you mean"
    " 'layers/0/attn/q_proj/kernel', 'layers/0/attn/k_proj/kernel',"
    " 'layers/0/attn/o_proj/kernel'?"
  )
  with pytest.raises(ValueError, match=re.escape(expect)):
    _init(pairs, models.llama_init(0))
  # Nothing close: no guess.
  with pytest.raises(
    ValueError, match=re.escape("Pair('wq', 'wk'): pattern 'wq' matches no parameter path.") + "$"
  ):
    saggs.describe({"embed": jnp.ones(2), "head": jnp.ones(2)}, [saggs.Pair("wq", "wk")])


def test_unpaired_matches():
  params = _layers()
  del params["layers"]["1"]["k"]
  with pytest.raises(ValueError, match=re.escape("'layers/1/q'") + ".*no partner"):
    _init([saggs.Pair("layers/*/q", "layers/*/k")], params)


def test_follower_without_partner():
  params = _layers()
  del params["layers"]["0"]["b"]
  with pytest.raises(
    ValueError,
    match=re.escape("'b'") + ".*no match with the captures of " + re.escape("'layers/0/q'"),
  ):
    _init([saggs.Pair("q", "k", axes=(1, 1), follow_a="b")], params)


def test_groups_that_do_not_divide():
  with pytest.raises(
    ValueError, match="4 groups do not divide axis of size 6 of " + re.escape("'layers/0/q'")
  ):
    _init([saggs.Pair("q", "k", axes=(1, 1), groups=4)], _layers())


def test_group_axes_of_different_size_need_groups():
  rng = np.random.default_rng(4)
  params = {"q": _arr(rng, 4, 8), "k": _arr(rng, 4, 4)}
  for pair in (saggs.Pair("q", "k", axes=(1, 1)), saggs.Pair("k", "q", axes=(1, 1))):
    with pytest.raises(ValueError, match=re.escape("'q' (4, 8)") + ".*pass groups="):
      _init([pair], params)
  _init([saggs.Pair("q", "k", axes=(1, 1), groups=2)], params)  # fine with groups


@pytest.mark.parametrize("axes, path", [((2, 1), "layers/0/q"), ((1, -3), "layers/0/k")])
def test_axis_out_of_range(axes, path):
  with pytest.raises(
    ValueError,
    match=f"group axis {axes[0] if path.endswith('q') else axes[1]}"
    f" is out of range for {re.escape(repr(path))}",
  ):
    _init([saggs.Pair("q", "k", axes=axes)], _layers())


def test_axis_out_of_range_counts_after_stacked():
  params = models.llama_init(0, models.STACKED)
  with pytest.raises(ValueError, match="out of range for 'layers/mlp/down_proj/kernel'"):
    _init([saggs.Pair("up_proj/kernel", "down_proj/kernel", axes=(1, 2), stacked=1)], params)


def test_stacked_axes_must_agree():
  rng = np.random.default_rng(5)
  params = {"q": _arr(rng, 2, 4, 6), "k": _arr(rng, 3, 4, 6)}
  with pytest.raises(ValueError, match="stacked axes differ between 'q'"):
    _init([saggs.Pair("q", "k", axes=(1, 1), stacked=1)], params)


def test_follower_without_matching_axis():
  rng = np.random.default_rng(6)
  params = {"q": _arr(rng, 4, 6), "k": _arr(rng, 4, 6), "qb": _arr(rng, 5)}
  with pytest.raises(ValueError, match="follower 'qb'"):
    _init([saggs.Pair("q", "k", axes=(1, 1), follow_a="qb")], params)


def test_a_bias_of_an_out_in_kernel_follows_its_leading_group_axis():
  """An (out, in) kernel (transformers' FlaxConv1D, eqx.nn.Linear) grouped on axis 0: its
  bias (out,) moves along its one axis, per group, in stacked copies too; scores q.k and the
  value path through o are unchanged. A multi-axis follower keeps the trailing rule."""
  rng = np.random.default_rng(11)
  L, H, HD, D = 2, 2, 3, 4  # 2 stacked layers, 2 heads of 3
  params = {
    "q": _arr(rng, L, H * HD, D),
    "qb": _arr(rng, L, H * HD),
    "k": _arr(rng, L, H * HD, D),
    "kb": _arr(rng, L, H * HD),
    "v": _arr(rng, L, H * HD, D),
    "vb": _arr(rng, L, H * HD),
    "o": _arr(rng, L, D, H * HD),
  }
  pairs = [
    saggs.Pair("q", "k", axes=(0, 0), groups=H, stacked=1, follow_a="qb", follow_b="kb"),
    saggs.Pair("v", "o", axes=(0, 1), groups=H, stacked=1, follow_a="vb"),
  ]
  c = {"q": np.array([[2.0, 0.5], [3.0, 0.25]]), "v": np.array([[4.0, 0.2], [0.3, 5.0]])}
  new, _ = saggs.reparameterize(params, None, pairs, lambda a, shape: c[a[0]].astype(np.float32))
  per = {k: np.repeat(f, HD, axis=-1) for k, f in c.items()}  # (L, H*HD)
  want = {
    "q": params["q"] * per["q"][..., None],
    "qb": params["qb"] * per["q"],
    "k": params["k"] / per["q"][..., None],
    "kb": params["kb"] / per["q"],
    "v": params["v"] * per["v"][..., None],
    "vb": params["vb"] * per["v"],
    "o": params["o"] / per["v"][:, None, :],
  }
  for name, w in want.items():
    np.testing.assert_allclose(new[name], w, rtol=1e-6, err_msg=name)

  def heads(p, x):  # per layer and head: q.k scores, and o applied to v
    q, k, v = (jnp.einsum("lod,d->lo", p[n], x) + p[n + "b"] for n in "qkv")
    qk = (q * k).reshape(L, H, HD).sum(-1)
    return qk, jnp.einsum("ldo,lo->ld", p["o"], v)

  x = _arr(rng, D)
  for got, ref in zip(heads(new, x), heads(params, x)):
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  # The bias of another size is refused, naming follower, shapes and kernel.
  bad = {**params, "qb": _arr(rng, L, H * HD + 1)}
  with pytest.raises(
    ValueError,
    match=re.escape(
      "follower 'qb' with shape (2, 7) has no axis matching group axis 1 of 'q' (2, 6, 4)"
    ),
  ):
    _init(pairs[:1], bad)
  # A follower of two axes per copy still shares the kernel's trailing axes: (out, in)'s
  # axis 0 is not among them, so a (6, 4) follower of axis 0 is refused ...
  with pytest.raises(ValueError, match="follower 'f' with shape"):
    _init(
      [saggs.Pair("q", "k", axes=(0, 0), groups=H, stacked=1, follow_a="f")],
      {**params, "f": _arr(rng, L, 5, H * HD)},
    )
  # ... and a (heads, hd) bias of a (d, heads, hd) kernel follows axis 1 as before.
  plan = saggs._src.plan.resolve(
    [saggs.Pair("w", "u", axes=(1, 1), follow_a="b")],
    {"w": _arr(rng, D, H, HD), "u": _arr(rng, D, H, HD), "b": _arr(rng, H, HD)},
  )
  assert [s.axis for s in plan.slots["b"]] == [0]


def test_duplicate_paths():
  rng = np.random.default_rng(7)
  params = {"a/q": _arr(rng, 2), "a": {"q": _arr(rng, 2)}, "k": _arr(rng, 2)}
  with pytest.raises(ValueError, match="Two leaves share the path 'a/q'"):
    _init([saggs.Pair("k", "a/q")], params)


# --- declarations that resolve but would be silently wrong ------------------------


def _qkvo():
  rng = np.random.default_rng(9)
  return {name: _arr(rng, 4, 6) for name in ("q", "k", "v", "o")} | {"b": _arr(rng, 6)}


@pytest.mark.parametrize(
  "pairs, params, msg",
  [
    # A preset, then one of its pairs again.
    (
      saggs.presets.llama(C.num_kv_heads) + saggs.presets.llama(C.num_kv_heads)[:1],
      models.llama_init(0),
      "'attention Q/K' = Pair('q_proj/kernel', 'k_proj/kernel') and 'attention Q/K' ="
      " Pair('q_proj/kernel', 'k_proj/kernel') both pair 'layers/0/attn/q_proj/kernel' with"
      " 'layers/0/attn/k_proj/kernel'",
    ),
    # Two patterns reaching the same leaves, in either orientation.
    (
      [saggs.Pair("layers/*/q", "layers/*/k"), saggs.Pair("q", "k")],
      _layers(),
      "Pair('layers/*/q', 'layers/*/k') and Pair('q', 'k') both pair 'layers/0/q' with"
      " 'layers/0/k'",
    ),
    (
      [saggs.Pair("q", "k", axes=(1, 1)), saggs.Pair("k", "q")],
      _qkvo(),
      "Pair('q', 'k') and Pair('k', 'q') both pair 'k' with 'q'",
    ),
  ],
)
def test_instance_declared_twice(pairs, params, msg):
  with pytest.raises(ValueError, match=re.escape(msg) + ", so its factors would be applied twice"):
    _init(pairs, params)


_CLASH = "Group another axis in one."


@pytest.mark.parametrize(
  "pairs, msg",
  [
    # Primary in two instances grouped along the same axis: q/k and q/v.
    (
      [saggs.Pair("q", "k", axes=(1, 1)), saggs.Pair("q", "v", axes=(1, 1))],
      "'q' is side a of Pair('q', 'k') and side a of Pair('q', 'v')"
      ", both grouping or stacking its axis 1",
    ),
    # A follower of one pair that is a primary of another, in both orders.
    (
      [saggs.Pair("q", "k", axes=(1, 1), follow_a="v"), saggs.Pair("v", "o", axes=(1, 1))],
      "'v' is a follower of side a (pattern 'v') of Pair('q', 'k') and side a of Pair('v', 'o')",
    ),
    (
      [saggs.Pair("v", "o", axes=(1, 1)), saggs.Pair("q", "k", axes=(1, 1), follow_b="o")],
      "'o' is side b of Pair('v', 'o') and a follower of side b (pattern 'o') of Pair('q', 'k')",
    ),
    # A follower of two pairs.
    (
      [
        saggs.Pair("q", "k", axes=(1, 1), follow_a="b"),
        saggs.Pair("v", "o", axes=(1, 1), follow_b="b", name="V/O"),
      ],
      "'b' is a follower of side a (pattern 'b') of Pair('q', 'k') and a"
      " follower of side b (pattern 'b') of 'V/O' = Pair('v', 'o')",
    ),
    # A group axis of one instance that is a copy axis of another.
    (
      [saggs.Pair("q", "k", axes=(0, 0)), saggs.Pair("q", "v", axes=(0, 0), stacked=1)],
      "'q' is side a of Pair('q', 'k') and side a of Pair('q', 'v')"
      ", both grouping or stacking its axis 0",
    ),
  ],
)
def test_leaf_grouped_twice_along_one_axis(pairs, msg):
  with pytest.raises(ValueError, match=re.escape(msg) + ".*" + re.escape(_CLASH)):
    _init(pairs, _qkvo())


@pytest.mark.parametrize(
  "pair, msg",
  [
    (
      saggs.Pair("q", "k", follow_a="k"),
      "'k' is both side b and a follower of side a (pattern 'k')",
    ),
    (
      saggs.Pair("q", "k", axes=(1, 1), follow_b="q"),
      "'q' is both side a and a follower of side b (pattern 'q')",
    ),
    (
      saggs.Pair("q", "k", axes=(1, 1), follow_a="b", follow_b="b"),
      "'b' is both a follower of side a (pattern 'b') and a follower of side b (pattern 'b')",
    ),
    (saggs.Pair("q", "q"), "'q' is both side a and side b"),
  ],
)
def test_leaf_on_both_sides_of_one_pair(pair, msg):
  with pytest.raises(ValueError, match=re.escape(f"{pair.label}: {msg}") + ".*one side of a pair"):
    _init([pair], _qkvo())


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, bool])
@pytest.mark.parametrize(
  "leaf, pair",
  [
    ("k", saggs.Pair("q", "k", axes=(1, 1))),
    ("b", saggs.Pair("q", "k", axes=(1, 1), follow_a="b")),
  ],
)
def test_non_float_leaf_in_a_pair(dtype, leaf, pair):
  params = _qkvo()
  plan = saggs._src.plan.resolve([pair], params)  # floats resolve and are cached...
  assert plan.instances[0].a == "q"
  params[leaf] = params[leaf].astype(dtype)  # ...the same shapes with integers do not
  msg = f"{pair.label}: pattern '{leaf}' matches '{leaf}' of dtype {jnp.dtype(dtype).name}; only"
  with pytest.raises(ValueError, match=re.escape(msg) + ".*integer would be truncated"):
    saggs.canonicalize(params, None, [pair])


# --- Equinox modules: leaves that are not arrays are static -----------------------


def test_equinox_module_static_fields_are_not_parameters():
  """describe, imbalance, canonicalize and reparameterize take a whole Equinox module: its
  function, flags and numbers are left alone (as eqx.filter leaves them), its arrays move,
  the function is the same; a pattern naming a static field matches no parameter."""
  model = equinox_mlp.imbalanced()
  up, down = (np.asarray(w, np.float64) for w in (model.up.weight, model.down.weight))
  text = saggs.describe(model, equinox_mlp.PAIRS)
  assert "ReLU channels  a     up/weight    (4, 3)  0           (4,)" in text
  assert "dropout" not in text and "activation" not in text

  log_ratio = 0.5 * np.log((up**2).sum(1) / (down**2).sum(0))
  np.testing.assert_allclose(
    saggs.imbalance(model, equinox_mlp.PAIRS)["up/weight|down/weight"], log_ratio, rtol=1e-5
  )
  c = np.exp(-0.5 * log_ratio)  # sqrt(||down_j|| / ||up_j||)
  for moved in (
    saggs.canonicalize(model, None, equinox_mlp.PAIRS)[0],
    eqx.filter_jit(lambda m: saggs.canonicalize(m, None, equinox_mlp.PAIRS)[0])(model),
  ):
    assert type(moved) is equinox_mlp.MLP
    assert (moved.activation, moved.dropout, moved.hidden) == (jax.nn.relu, model.dropout, 4)
    np.testing.assert_allclose(moved.up.weight, up * c[:, None], rtol=1e-5)
    np.testing.assert_allclose(moved.down.weight, down / c[None, :], rtol=1e-5)
    np.testing.assert_allclose(
      equinox_mlp.apply(moved, equinox_mlp.X),
      equinox_mlp.apply(model, equinox_mlp.X),
      rtol=1e-5,
      atol=1e-6,
    )
  doubled, _ = saggs.reparameterize(model, None, equinox_mlp.PAIRS, 2.0)
  np.testing.assert_allclose(doubled.up.weight, 2 * up, rtol=1e-6)
  assert doubled.dropout == model.dropout and doubled.activation is model.activation

  for pattern in ("dropout/p", "hidden"):
    with pytest.raises(
      ValueError, match=re.escape(f"pattern {pattern!r} matches no parameter path")
    ):
      saggs.describe(model, [saggs.Pair(pattern, "down/weight")])


def test_describe_takes_params_first_and_refuses_the_other_order():
  params = {"q": jnp.ones((8, 4)), "k": jnp.ones((8, 4))}
  pairs = [saggs.Pair("q", "k", axes=(1, 1), groups=2)]
  new = saggs.describe(params, pairs)
  assert new.splitlines()[2].split() == ["Pair('q',", "'k')", "a", "q", "(8,", "4)", "1", "(2,)"]
  for old_order in (pairs, pairs[0]):  # a list of pairs, or one
    with pytest.raises(TypeError, match=r"Write saggs_jax\.describe\(params, pairs\)"):
      saggs.describe(old_order, params)
