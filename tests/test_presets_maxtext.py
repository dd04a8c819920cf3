"""presets.maxtext on MaxText-shaped trees: exact per layer, and never on the wrong axes.

Tiny forwards in plain JAX with MaxText's parameter layouts (see test_copy_axes.py): the
llama2 decoder with its layer axis at 1, at 0 or unscanned (``layers_0``, ``layers_1``), a
mixtral-style MoE block whose router mixes every expert (so each expert's exactness shows),
and DeepSeek's MLA (per-head non-rotary keys and values in one ``wkv_b``, a rotary key
shared by the heads).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import saggs_jax as saggs
from test_copy_axes import KV, E, H, L, M, batch, forward, maxtext_params, rms_norm

X, NOPE, ROPE, V_HD, RANK = 3, 2, 2, 3, 4


def unscanned(params):
  """MaxText's scan_layers=False tree: decoder/layers_<i>/..., no layer axis."""
  layers = params["decoder"]["layers"]
  return {
    "decoder": {
      f"layers_{i}": jax.tree.map(lambda x, i=i: jnp.take(x, i, axis=1), layers) for i in range(L)
    }
  }


def unscanned_forward(params, x):
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *params["decoder"].values())
  return forward({"decoder": {"layers": stacked}}, x)


def random_factors(seed=0):
  rng = np.random.default_rng(seed)
  return lambda path, shape: np.exp(rng.uniform(-1.5, 1.5, shape))


def assert_exact(fn, params, pairs, x):
  ref = fn(params, x)
  moved, _ = saggs.reparameterize(params, None, pairs, random_factors())
  np.testing.assert_allclose(fn(moved, x), ref, atol=2e-4 * float(jnp.abs(ref).max()))
  assert saggs.check_symmetry(lambda p: fn(p, x), params, pairs)


@pytest.mark.parametrize("layout", ["scan axis 1", "scan axis 0", "unscanned"])
def test_llama2_pairs_are_exact_per_layer(layout):
  x = batch()
  if layout == "unscanned":
    params, fn, config = unscanned(maxtext_params()), unscanned_forward, {"scan_layers": False}
  else:
    axis = int(layout[-1])
    params = maxtext_params(scan_axis=axis)
    fn, config = (lambda p, x: forward(p, x, scan_axis=axis)), {"param_scan_axis": axis}
  pairs = saggs.presets.maxtext({"num_kv_heads": KV, "decoder_block": "llama2", **config})
  assert [p.name for p in pairs] == ["attention Q/K", "attention V/O", "MLP wi_1/wo"]
  plan = saggs._src.plan.resolve(pairs, params)
  per_layer = (L,) if layout != "unscanned" else ()
  assert sorted(i.factor_shape for i in plan.instances) == sorted(
    [per_layer + (KV,)] * (2 * (len(per_layer) or L)) + [per_layer + (M,)] * (len(per_layer) or L)
  )
  assert_exact(fn, params, pairs, x)
  balanced, _ = saggs.canonicalize(params, None, pairs)
  for v in saggs.imbalance(balanced, pairs).values():
    np.testing.assert_allclose(v, 0.0, atol=1e-4)


def test_a_layout_the_preset_does_not_describe_is_an_error_naming_the_path():
  """The issue's case: llama(mlp=False) with MaxText's names grouped Q/K along the layer axis
  (2 layers taken for 2 KV heads) and check_symmetry accepted it."""
  params = maxtext_params()
  llama = saggs.presets.llama(
    KV, mlp=False, names=saggs.presets.LlamaNames(q="query", k="key", v="value", o="out")
  )
  unchecked = [dataclasses.replace(p, ndim=None) for p in llama]  # equal, without the check
  assert unchecked == llama and saggs._src.plan.resolve(unchecked, params).instances
  with pytest.raises(
    ValueError, match=r"query/kernel' \(8, 2, 4, 3\) has 4 axes besides the copy axes"
  ):
    saggs._src.plan.resolve(llama, params)  # not the cached plan of the equal pairs
  with pytest.raises(
    ValueError, match=r"query/kernel' \(.*\) has 4 axes besides the copy axes, the declaration 3"
  ):
    saggs.check_symmetry(lambda p: forward(p, batch()), params, saggs.presets.flax_mha(bias=False))
  with pytest.raises(ValueError, match="decoder_block 'llama9' is not covered"):
    saggs.presets.maxtext(num_kv_heads=KV, decoder_block="llama9")
  with pytest.raises(ValueError, match="num_kv_heads"):
    saggs.presets.maxtext()


def test_qk_norm_blocks_leave_q_k_out():
  for block, scan in (("qwen3", True), ("gemma3", False)):
    pairs = saggs.presets.maxtext(num_kv_heads=KV, decoder_block=block, scan_layers=scan)
    assert [p.name for p in pairs] == ["attention V/O", "MLP wi_1/wo"]


def test_gemma3_scanned_blocks_of_six_and_the_unscanned_remainder():
  """MaxText scans gemma3 in blocks of its 6-layer attention pattern (decoder/layers/layers_<j>,
  layer axis at 1) and leaves the rest unscanned (decoder/layers_remainder/layers_<j>)."""
  config = {"decoder_block": "gemma3", "num_kv_heads": KV}
  got = lambda n: [  # noqa: E731
    (p.a, p.stacked) for p in saggs.presets.maxtext({**config, "num_decoder_layers": n})
  ]
  scanned = [
    ("layers/layers_*/self_attention*/value/kernel", (1,)),
    ("layers/layers_*/mlp*/wi_1/kernel", (1,)),
  ]
  rest = [(f"layers_remainder/{a[len('layers/') :]}", ()) for a, _ in scanned]
  assert got(12) == scanned and got(2) == rest and got(8) == scanned + rest
  with pytest.raises(ValueError, match="gemma3 with scan_layers needs num_decoder_layers"):
    saggs.presets.maxtext(config)


class _Config:  # attributes, as MaxText's pyconfig has them (decoder_block an enum there)
  class decoder_block:  # noqa: N801
    value = "mixtral"

  num_kv_heads, num_experts, scan_layers, param_scan_axis = KV, X, True, 1


def moe_params(seed=0):
  rng = np.random.default_rng(seed)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s) * np.exp(rng.uniform(-1, 1, s)), jnp.float32)
  params = maxtext_params(seed)
  layers = params["decoder"]["layers"]
  del layers["mlp"]
  layers["MoeBlock_0"] = {
    "gate": {"kernel": mk(E, L, X)},
    "wi_0": mk(X, L, E, M),  # MaxText's experts are bare leaves
    "wi_1": mk(X, L, E, M),
    "wo": mk(X, L, M, E),
  }
  return params


def moe_forward(params, x):
  """Attention as in test_copy_axes.forward, then a MoE block whose router softmax weighs
  every expert (a dense mixture: each expert's symmetry shows in the output)."""
  p = params["decoder"]["layers"]
  at, moe = p["self_attention"], p["MoeBlock_0"]
  for i in range(L):
    h = rms_norm(x, p["pre_self_attention_layer_norm"]["scale"][:, i])
    q, k, v = (
      jnp.einsum("bte,ehd->bthd", h, at[n]["kernel"][:, i]) for n in ("query", "key", "value")
    )
    x = x + jnp.einsum(
      "bthd,hde->bte",
      jax.nn.dot_product_attention(q, k, v, is_causal=True),
      at["out"]["kernel"][:, i],
    )
    w = jax.nn.softmax(x @ moe["gate"]["kernel"][:, i], axis=-1)  # (b, t, experts)
    up = jax.nn.silu(jnp.einsum("bte,xem->btxm", x, moe["wi_0"][:, i]))
    up = up * jnp.einsum("bte,xem->btxm", x, moe["wi_1"][:, i])
    x = x + jnp.einsum("btx,btxm,xme->bte", w, up, moe["wo"][:, i])
  return x


def test_mixtral_experts_pair_per_expert_and_layer():
  params, pairs = moe_params(), saggs.presets.maxtext(_Config())
  assert [p.name for p in pairs][-1] == "MoE wi_1/wo" and pairs[-1].stacked == (0, 1)
  shapes = {k: v.shape for k, v in saggs.imbalance(params, pairs).items()}
  assert shapes[f"{'decoder/layers/MoeBlock_0/wi_1'}|decoder/layers/MoeBlock_0/wo"] == (X, L, M)
  assert_exact(moe_forward, params, pairs, batch())


def mla_params(seed=0):
  rng = np.random.default_rng(seed)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s) * np.exp(rng.uniform(-1, 1, s)), jnp.float32)
  return {
    "decoder": {
      "layers": {
        "self_attention": {
          "query": {"kernel": mk(E, L, H, NOPE + ROPE)},
          "wkv_a": {"kernel": mk(E, L, RANK + ROPE)},
          "kv_norm": {"scale": mk(RANK, L)},
          "wkv_b": {"kernel": mk(RANK, L, H, NOPE + V_HD)},
          "out": {"kernel": mk(H, L, V_HD, E)},
        }
      }
    }
  }


def mla(at, x, i):
  """Layer ``i``'s MLA without q_lora (rotary embeddings left out: they act on the rotary
  part, which no pair moves)."""
  q = jnp.einsum("bte,ehd->bthd", x, at["query"]["kernel"][:, i])
  kv_a = x @ at["wkv_a"]["kernel"][:, i]
  latent, k_rope = rms_norm(kv_a[..., :RANK], at["kv_norm"]["scale"][:, i]), kv_a[..., RANK:]
  kv = jnp.einsum("btr,rhd->bthd", latent, at["wkv_b"]["kernel"][:, i])
  k = jnp.concatenate(
    [kv[..., :NOPE], jnp.broadcast_to(k_rope[:, :, None], kv.shape[:3] + (ROPE,))], -1
  )
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(NOPE + ROPE)
  causal = jnp.tril(jnp.ones((x.shape[1],) * 2, bool))
  weights = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
  a = jnp.einsum("bhqk,bkhd->bqhd", weights, kv[..., NOPE:])  # v_head_dim != qk's
  return jnp.einsum("bthd,hde->bte", a, at["out"]["kernel"][:, i])


def mla_forward(params, x):
  at = params["decoder"]["layers"]["self_attention"]
  for i in range(L):
    x = x + mla(at, x, i)
  return x


def deepseek_params(seed=0):
  """DeepSeek's two scanned stacks: ``dense_layers`` (MLA, a gated MLP), then ``moe_layers``
  (MLA, shared experts and routed experts under ``DeepSeekMoeBlock_0``), L layers each."""
  rng = np.random.default_rng(seed)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s) * np.exp(rng.uniform(-1, 1, s)), jnp.float32)
  attention = lambda: mla_params(int(rng.integers(1 << 30)))["decoder"]["layers"]  # noqa: E731
  mlp = lambda: {  # noqa: E731
    "wi_0": {"kernel": mk(E, L, M)},
    "wi_1": {"kernel": mk(E, L, M)},
    "wo": {"kernel": mk(M, L, E)},
  }
  routed = {"gate": {"kernel": mk(E, L, X)}, "wi_0": mk(X, L, E, M), "wi_1": mk(X, L, E, M)}
  routed["wo"] = mk(X, L, M, E)
  return {
    "decoder": {
      "dense_layers": {**attention(), "mlp": mlp()},
      "moe_layers": {
        **attention(),
        "DeepSeekMoeBlock_0": {"shared_experts": mlp(), "MoeBlock_0": routed},
      },
    }
  }


def deepseek_forward(params, x):
  """Each layer: MLA, then a SwiGLU MLP; in MoE layers the shared experts' plus the routed
  experts' (a dense softmax mixture, so that each expert's exactness shows). Pre-norms without
  gains keep the four layers' activations finite."""

  def glu(m, x, i):
    up = jax.nn.silu(x @ m["wi_0"]["kernel"][:, i]) * (x @ m["wi_1"]["kernel"][:, i])
    return up @ m["wo"]["kernel"][:, i]

  norm = lambda x: rms_norm(x, 1.0)  # noqa: E731
  dense, moe = params["decoder"]["dense_layers"], params["decoder"]["moe_layers"]
  for i in range(L):
    x = x + mla(dense["self_attention"], norm(x), i)
    x = x + glu(dense["mlp"], norm(x), i)
  block = moe["DeepSeekMoeBlock_0"]
  routed = block["MoeBlock_0"]
  for i in range(L):
    x = x + mla(moe["self_attention"], norm(x), i)
    h = norm(x)
    w = jax.nn.softmax(h @ routed["gate"]["kernel"][:, i], axis=-1)
    up = jax.nn.silu(jnp.einsum("bte,xem->btxm", h, routed["wi_0"][:, i]))
    up = up * jnp.einsum("bte,xem->btxm", h, routed["wi_1"][:, i])
    x = x + glu(block["shared_experts"], h, i)
    x = x + jnp.einsum("btx,btxm,xme->bte", w, up, routed["wo"][:, i])
  return x


def test_deepseek_mla_pairs_the_non_rotary_keys_and_the_values_per_head():
  config = dict(
    decoder_block="deepseek", qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_HD
  )
  pairs = saggs.presets.maxtext(config)
  params = mla_params()
  assert (
    sorted(i.factor_shape for i in saggs._src.plan.resolve(pairs, params).instances) == [(L, H)] * 2
  )
  assert_exact(mla_forward, params, pairs, batch())
  with pytest.raises(ValueError, match="qk_nope_head_dim"):
    saggs.presets.maxtext(decoder_block="deepseek")


def test_deepseek_pairs_its_dense_mlps_shared_and_routed_experts_per_layer():
  mla_dims = dict(qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_HD)
  config = dict(decoder_block="deepseek", num_experts=X, first_num_dense_layers=L, **mla_dims)
  pairs = saggs.presets.maxtext({**config, "num_decoder_layers": 2 * L})
  assert [p.name for p in pairs] == [
    "MLA Q/K (non-rotary)",
    "MLA V/O",
    "MLP wi_1/wo",
    "shared experts wi_1/wo",
    "MoE wi_1/wo",
  ]
  params = deepseek_params()
  shapes = sorted(i.factor_shape for i in saggs._src.plan.resolve(pairs, params).instances)
  assert shapes == sorted([(L, H)] * 4 + [(L, M)] * 2 + [(X, L, M)])
  assert_exact(deepseek_forward, params, pairs, batch())
  # No dense layers, or only dense layers: those pairs are left out, not unmatched.
  names = lambda **c: [p.name for p in saggs.presets.maxtext({**config, **c})][2:]  # noqa: E731
  assert names(first_num_dense_layers=0) == ["shared experts wi_1/wo", "MoE wi_1/wo"]
  assert names(num_decoder_layers=L) == ["MLP wi_1/wo"]


# ---- Muon dimension numbers against MaxText's own (utils/muon_utils, written out by hand) ----

mdn = optax.contrib.MuonDimensionNumbers
D_E, D_L, D_H, D_KV, D_HD, D_M, D_V, D_X = 16, 2, 4, 2, 8, 32, 64, 4


def maxtext_shapes(scan_axis=1, moe=False):
  """MaxText's llama2 (or mixtral) tree as abstract shapes, the layer axis at ``scan_axis``
  (None: scan_layers=False, two layers_<i>)."""
  sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)

  def layer(*shape):  # one layer's shape, the layer axis inserted
    if scan_axis is None:
      return sds(*shape)
    return sds(*shape[:scan_axis], D_L, *shape[scan_axis:])

  def experts(*shape):  # (experts, layers, ...) whatever the scan axis
    return sds(D_X, *((D_L,) if scan_axis is not None else ()), *shape)

  block = {
    "self_attention": {
      "query": {"kernel": layer(D_E, D_H, D_HD)},
      "key": {"kernel": layer(D_E, D_KV, D_HD)},
      "value": {"kernel": layer(D_E, D_KV, D_HD)},
      "out": {"kernel": layer(D_H, D_HD, D_E)},
    },
    "pre_self_attention_layer_norm": {"scale": layer(D_E)},
    "post_self_attention_layer_norm": {"scale": layer(D_E)},
  }
  if moe:
    block["MoeBlock_0"] = {
      "gate": {"kernel": layer(D_E, D_X)},
      "wi_0": experts(D_E, D_M),
      "wi_1": experts(D_E, D_M),
      "wo": experts(D_M, D_E),
    }
  else:
    block["mlp"] = {n: {"kernel": layer(D_E, D_M)} for n in ("wi_0", "wi_1")}
    block["mlp"]["wo"] = {"kernel": layer(D_M, D_E)}
  layers = {"layers": block} if scan_axis is not None else {"layers_0": block, "layers_1": block}
  return {
    "decoder": {
      **layers,
      "decoder_norm": {"scale": sds(D_E)},
      "logits_dense": {"kernel": sds(D_E, D_V)},
    },
    "token_embedder": {"embedding": sds(D_V, D_E)},
  }


# What MaxText's muon_utils.transform_logic returns, by leaf (scanned or not: it is written
# for the layer axis at 1, and its negative axes serve an unscanned tree too).
MAXTEXT_MUON = {
  "self_attention/query/kernel": mdn((0,), (-2, -1)),
  "self_attention/key/kernel": mdn((0,), (-2, -1)),
  "self_attention/value/kernel": mdn((0,), (-2, -1)),
  "self_attention/out/kernel": mdn((0, -2), (-1,)),
  "pre_self_attention_layer_norm/scale": None,
  "post_self_attention_layer_norm/scale": None,
  "mlp/wi_0/kernel": mdn((0,), (-1,)),
  "mlp/wi_1/kernel": mdn((0,), (-1,)),
  "mlp/wo/kernel": mdn((0,), (-1,)),
  "MoeBlock_0/gate/kernel": mdn((0,), (-1,)),
  "MoeBlock_0/wi_0": mdn((-2,), (-1,)),
  "MoeBlock_0/wi_1": mdn((-2,), (-1,)),
  "MoeBlock_0/wo": mdn((-2,), (-1,)),
  "decoder_norm/scale": None,
  "logits_dense/kernel": None,
  "embedding": None,
}


def maxtext_expected(path):
  return next(dims for suffix, dims in MAXTEXT_MUON.items() if path.endswith(suffix))


def flat(tree):
  return {
    saggs._src.paths.path_str(k): v
    for k, v in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: x is None or isinstance(x, mdn)
    )[0]
  }


def absolute(dims, ndim):
  """``(reduction, output)`` as sorted non-negative axes (an int is one axis)."""
  as_tuple = lambda axes: axes if isinstance(axes, tuple) else (axes,)  # noqa: E731
  return tuple(tuple(sorted(a % ndim for a in as_tuple(axes))) for axes in dims)


@pytest.mark.parametrize("scan_axis, moe", [(1, False), (1, True), (None, False), (None, True)])
def test_muon_dimension_numbers_equal_maxtext_where_it_is_right(scan_axis, moe):
  params = maxtext_shapes(scan_axis, moe)
  got = flat(saggs.equivariant.muon_dimension_numbers(params, "maxtext", param_scan_axis=scan_axis))
  assert set(got) == set(flat(params))
  for path, dims in got.items():
    assert dims == maxtext_expected(path), path


@pytest.mark.parametrize("moe", [False, True])
def test_muon_dimension_numbers_with_the_layer_axis_at_0_never_reduce_over_it(moe):
  """The same matrices as with the layer axis at 1, per layer; MaxText's own numbers on this
  tree reduce the MLP, the router and the attention kernels over the layer axis."""
  at0, at1 = maxtext_shapes(0, moe), maxtext_shapes(1, moe)
  got0 = flat(saggs.equivariant.muon_dimension_numbers(at0, "maxtext", param_scan_axis=0))
  got1 = flat(saggs.equivariant.muon_dimension_numbers(at1, "maxtext", param_scan_axis=1))
  shapes0, shapes1 = ({p: x.shape for p, x in flat(t).items()} for t in (at0, at1))
  wrong = set()
  for path, dims in got0.items():
    if dims is None:
      assert got1[path] is None
      continue
    layer0 = 1 if "MoeBlock_0/w" in path else 0  # the experts' layer axis is at 1 either way
    n = len(shapes0[path])
    assert layer0 not in absolute(dims, n)[0] + absolute(dims, n)[1], path

    def per_layer(dims, layer, n):  # the axes of one layer's matrix, the layer axis removed
      return tuple(tuple(a - (a > layer) for a in axes) for axes in absolute(dims, n))

    assert per_layer(dims, layer0, n) == per_layer(got1[path], 1, len(shapes1[path])), path
    theirs = absolute(maxtext_expected(path), n)
    if layer0 in theirs[0] + theirs[1]:
      wrong.add(path.split("decoder/layers/")[1])
  mlp = {"MoeBlock_0/gate/kernel"} if moe else {f"mlp/{n}/kernel" for n in ("wi_0", "wi_1", "wo")}
  attention = {f"self_attention/{n}/kernel" for n in ("query", "key", "value", "out")}
  assert wrong == mlp | attention


def test_maxtext_muon_dimension_numbers_drive_optax_muon():
  params = maxtext_params()  # test_copy_axes's concrete llama2 tree, layer axis at 1
  dims = saggs.equivariant.muon_dimension_numbers(params, "maxtext")
  tx = optax.contrib.muon(0.02, muon_weight_dimension_numbers=dims)
  updates, _ = tx.update(params, tx.init(params), params)
  q = params["decoder"]["layers"]["self_attention"]["query"]["kernel"]
  got = updates["decoder"]["layers"]["self_attention"]["query"]["kernel"]
  plain = optax.contrib.muon(0.02)  # one (emb, heads * head_dim) matrix per layer, on its own
  for i in range(L):
    matrix = q[:, i].reshape(E, -1)
    want, _ = plain.update(matrix, plain.init(matrix), matrix)
    np.testing.assert_allclose(got[:, i].reshape(E, -1), want, rtol=1e-5, atol=1e-7)
  with pytest.raises(
    ValueError, match=r"layers_0/self_attention/key/kernel' has shape \(8, 2, 3\), 2 axes"
  ):
    saggs.equivariant.muon_dimension_numbers(unscanned(params), "maxtext")  # scanned by default


MAXTEXT_ROLES = {
  "query": "self_attention/query/kernel",
  "key_value": ("self_attention/key/kernel", "self_attention/value/kernel"),
  "output": "self_attention/out/kernel",
  "gate_up": ("mlp/wi_0/kernel", "mlp/wi_1/kernel"),
  "down": "mlp/wo/kernel",
  "embedding": "token_embedder/embedding",
}


@pytest.mark.parametrize("scan_axis", [1, 0])
def test_role_dimension_numbers_with_copy_axes_take_maxtexts_kernels(scan_axis):
  """Roles on MaxText's kernels (several head axes, the layer axis anywhere): the matrices of
  MaxText's own numbers at scan axis 1, the layer axis batched."""
  params = maxtext_shapes(scan_axis)
  shapes = {p: x.shape for p, x in flat(params).items()}
  got = flat(
    saggs.equivariant.role_dimension_numbers(params, MAXTEXT_ROLES, copy_axes=(scan_axis,))
  )
  want = flat(
    saggs.equivariant.muon_dimension_numbers(params, "maxtext", param_scan_axis=scan_axis)
  )
  for path, dims in got.items():
    if dims is None:
      assert "token_embedder" in path or want[path] is None, path
      continue
    assert absolute(dims, len(shapes[path])) == absolute(want[path], len(shapes[path])), path
  # Without copy axes, Dense (in, out) kernels as before: the trailing two axes.
  two_d = {"q_proj": {"kernel": jax.ShapeDtypeStruct((2, 8, 8), jnp.float32)}}
  assert saggs.equivariant.role_dimension_numbers(two_d)["q_proj"]["kernel"] == mdn(-2, -1)
  with pytest.raises(
    ValueError, match=r"'decoder/layers/mlp/wi_0/kernel' of shape .* has no matrix"
  ):
    saggs.equivariant.role_dimension_numbers(params, MAXTEXT_ROLES, copy_axes=(0, 1, 2))
