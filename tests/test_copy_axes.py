"""Copy axes at any position (``Pair(stacked=(positions...))``): MaxText's scanned layout.

The model is a tiny MaxText-style decoder in plain JAX whose scanned parameters keep the
layer axis at position 1 (``param_scan_axis=1``): query (emb, layers, heads, head_dim),
key/value (emb, layers, kv_heads, head_dim), out (heads, layers, head_dim, emb), wi_0/wi_1
(emb, layers, mlp), wo (mlp, layers, emb), norm scales (emb, layers); query head h reads KV
head h // (heads // kv_heads). Oracles are written here in NumPy: the copy axes moved to the
front, each copy's groups balanced by ``c = (||B_g||**2 / ||A_g||**2)**(1/4)``, moved back; the
equivalent-history oracle (Adam fed the transported gradients from the start); the per-layer
logits recomputed from the clipped kernels.
"""

import pathlib
import re
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import saggs_jax as saggs
from saggs_jax._src import paths
from saggs_jax._src.pairs import COPY_AXES_MSG
from xla_env import cpu_env

E, L, H, KV, HD, M, B, T = 8, 2, 4, 2, 3, 6, 2, 5
ROOT = pathlib.Path(__file__).resolve().parent.parent
ATTN, MLP = "decoder/layers/self_attention", "decoder/layers/mlp"


def maxtext_params(seed=0, scan_axis=1):
  """MaxText's llama2 tree with its layer axis at ``scan_axis``, entries ~N(0, 1) times a
  per-leaf spread that leaves every pair off balance."""
  rng = np.random.default_rng(seed)

  def mk(*per_layer):  # per_layer: the shape of one layer; the layer axis goes to scan_axis
    x = rng.standard_normal(per_layer + (L,)) * np.exp(rng.uniform(-1, 1, per_layer[-1:] + (L,)))
    return jnp.asarray(np.moveaxis(x, -1, scan_axis), jnp.float32)

  return {
    "decoder": {
      "layers": {
        "self_attention": {
          "query": {"kernel": mk(E, H, HD)},
          "key": {"kernel": mk(E, KV, HD)},
          "value": {"kernel": mk(E, KV, HD)},
          "out": {"kernel": mk(H, HD, E)},
        },
        "mlp": {
          "wi_0": {"kernel": mk(E, M)},
          "wi_1": {"kernel": mk(E, M)},
          "wo": {"kernel": mk(M, E)},
        },
        "pre_self_attention_layer_norm": {"scale": mk(E) + 2.0},
      }
    }
  }


def per_layer_pairs(stacked=(1,)):
  return [
    saggs.Pair(f"{ATTN}/query/kernel", f"{ATTN}/key/kernel", (1, 1), KV, stacked, name="Q/K"),
    saggs.Pair(f"{ATTN}/value/kernel", f"{ATTN}/out/kernel", (1, 0), KV, stacked, name="V/O"),
    saggs.Pair(f"{MLP}/wi_1/kernel", f"{MLP}/wo/kernel", (1, 0), None, stacked, name="up/down"),
  ]


GAIN = saggs.Pair(
  "pre_self_attention_layer_norm/scale",
  tuple(f"self_attention/{n}/kernel" for n in ("query", "key", "value")),
  axes=(0, 0),
  stacked=(1,),
  name="attention norm gain",
)


def rms_norm(x, scale):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def forward(params, x, scan_axis=1):
  """The decoder on x (B, T, E), each layer's weights sliced off the layer axis."""
  p = params["decoder"]["layers"]
  at, mlp = p["self_attention"], p["mlp"]
  layer = lambda w, i: jnp.take(w, i, axis=scan_axis)
  for i in range(L):
    h = rms_norm(x, layer(p["pre_self_attention_layer_norm"]["scale"], i))
    q, k, v = (
      jnp.einsum("bte,ehd->bthd", h, layer(at[n]["kernel"], i)) for n in ("query", "key", "value")
    )
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + jnp.einsum("bthd,hde->bte", a, layer(at["out"]["kernel"], i))
    up = jax.nn.silu(x @ layer(mlp["wi_0"]["kernel"], i)) * (x @ layer(mlp["wi_1"]["kernel"], i))
    x = x + up @ layer(mlp["wo"]["kernel"], i)
  return x


def batch(seed=1):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, E)), jnp.float32)


def get(tree, path):
  for k in path.split("/"):
    tree = tree[k]
  return tree


def put(tree, path, value):
  tree = jax.tree.map(lambda x: x, tree)  # a copy of the containers
  node = tree
  *head, last = path.split("/")
  for k in head:
    node = node[k]
  node[last] = value
  return tree


# ---- the NumPy oracle: copy axes to the front, the group axis last, balance, move back ----


def to_front(x, copy, axis):
  """``x`` with its copy axes first and its group ``axis`` (counted among the others) last."""
  y = np.moveaxis(np.asarray(x, np.float64), copy, range(len(copy)))
  return np.moveaxis(y, len(copy) + axis, -1)


def from_front(y, copy, axis):
  return np.moveaxis(np.moveaxis(y, -1, len(copy) + axis), range(len(copy)), copy)


def np_group_sq(x, copy, axis, groups):
  """Per copy and group, the sum of squares: shape (copies..., groups)."""
  y = to_front(x, copy, axis)
  y = y.reshape(y.shape[: len(copy)] + (-1, groups, y.shape[-1] // groups))
  return (y**2).sum(axis=(len(copy), len(copy) + 2))


def np_scale(x, copy, axis, groups, c):
  """``x`` with group g of copy i multiplied by ``c[i + (g,)]``."""
  y = to_front(x, copy, axis)
  shape = y.shape
  y = y.reshape(shape[: len(copy)] + (-1, groups, shape[-1] // groups)) * c[..., None, :, None]
  return from_front(y.reshape(shape), copy, axis)


def np_balance(a, b, copy, axes, groups):
  """Hard SAGGS of one pair instance by hand: ``(a * c, b / c, c)``."""
  c = (np_group_sq(b, copy, axes[1], groups) / np_group_sq(a, copy, axes[0], groups)) ** 0.25
  return np_scale(a, copy, axes[0], groups, c), np_scale(b, copy, axes[1], groups, 1 / c), c


# ---- layouts beyond MaxText's: experts and layers, non-contiguous copy axes ----

LAYOUTS = {  # name: (shape a, shape b, stacked, axes, groups)
  "layers at 1": ((E, L, H * HD), (H * HD, L, E), (1,), (1, 0), H),
  "experts, layers": ((3, L, E, M), (3, L, M, E), (0, 1), (1, 0), None),
  "copies at 0 and 2": ((3, E, L, M), (3, M, L, E), (0, 2), (1, 0), M // 2),
  "layers last": ((E, M, L), (M, E, L), (2,), (1, 0), None),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hard_balance_equals_the_numpy_oracle(layout):
  shape_a, shape_b, stacked, axes, groups = LAYOUTS[layout]
  rng = np.random.default_rng(3)
  a = rng.standard_normal(shape_a) * np.exp(rng.uniform(-2, 2, shape_a))
  b = rng.standard_normal(shape_b)
  params = {"a": jnp.asarray(a, jnp.float32), "b": jnp.asarray(b, jnp.float32)}
  pair = saggs.Pair("a", "b", axes=axes, groups=groups, stacked=stacked)
  got, _ = saggs.canonicalize(params, None, [pair])
  size = [n for i, n in enumerate(shape_b) if i not in stacked][axes[1]]
  want_a, want_b, c = np_balance(a, b, stacked, axes, groups or size)
  np.testing.assert_allclose(got["a"], want_a, rtol=2e-6)
  np.testing.assert_allclose(got["b"], want_b, rtol=2e-6)
  (inst,) = saggs._src.plan.resolve([pair], params).instances
  assert inst.factor_shape == c.shape  # the copy axes' sizes in order, then the groups
  tx = saggs.chain(optax.sgd(0.0), saggs.saggs([pair]))
  _, state = tx.update(params, tx.init(params), params)
  np.testing.assert_allclose(state[1].factors["a|b"], c, rtol=2e-6)


def test_joint_balance_equals_the_leading_layer_layout():
  """Overlapping pairs (the norm gain against Q, K, V rows) solve jointly per layer: the same
  factors as the same tree with its layer axis leading (declared with stacked=1)."""
  params = maxtext_params()
  pairs = per_layer_pairs() + [GAIN]
  lead = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), params)
  lead_pairs = [saggs.Pair(**{**vars(p), "stacked": 1}) for p in pairs]
  got, _ = saggs.canonicalize(params, None, pairs)
  want, _ = saggs.canonicalize(lead, None, lead_pairs)
  chex.assert_trees_all_close(jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), got), want, rtol=1e-5)
  for v in saggs.imbalance(got, pairs).values():
    assert v.shape[0] == L
    np.testing.assert_allclose(v, 0.0, atol=1e-4)


def test_function_invariance_of_the_maxtext_model():
  params, x = maxtext_params(), batch()
  pairs = per_layer_pairs() + [GAIN]
  rng = np.random.default_rng(5)
  factor = lambda path, shape: np.exp(rng.uniform(-2, 2, shape))
  moved, _ = saggs.reparameterize(params, None, pairs, factor)
  ref = forward(params, x)
  np.testing.assert_allclose(
    forward(moved, x), ref, rtol=1e-4, atol=1e-4 * float(jnp.abs(ref).max())
  )
  assert not np.allclose(
    moved[  # the factors did move the weights, per layer
      "decoder"
    ]["layers"]["mlp"]["wo"]["kernel"],
    params["decoder"]["layers"]["mlp"]["wo"]["kernel"],
  )
  balanced, _ = saggs.canonicalize(params, None, pairs)
  np.testing.assert_allclose(
    forward(balanced, x), ref, rtol=1e-4, atol=1e-4 * float(jnp.abs(ref).max())
  )
  assert saggs.check_symmetry(lambda p: forward(p, x), params, pairs)


def test_a_per_layer_imbalance_needs_per_layer_factors():
  """Q x8 and K /8 in layer 0 only: factors shared by the layers leave the imbalance (as
  +log 8 in one layer and -log 8 in the other), the per-layer ones balance it."""
  params, _ = saggs.canonicalize(maxtext_params(), None, per_layer_pairs())
  q, k = f"{ATTN}/query/kernel", f"{ATTN}/key/kernel"
  params = put(params, q, get(params, q).at[:, 0].multiply(8.0))
  params = put(params, k, get(params, k).at[:, 0].divide(8.0))
  per_layer = per_layer_pairs()[:1]
  (before,) = saggs.imbalance(params, per_layer).values()
  np.testing.assert_allclose(before, [[np.log(64.0)] * KV, [0.0] * KV], atol=1e-5)
  shared = [saggs.Pair(q, k, axes=(2, 2), groups=KV)]  # the heads axis, across both layers
  (after_shared,) = saggs.imbalance(saggs.canonicalize(params, None, shared)[0], per_layer).values()
  assert np.all(np.abs(after_shared) > 1.5), after_shared  # half of log 64 each way
  (after,) = saggs.imbalance(saggs.canonicalize(params, None, per_layer)[0], per_layer).values()
  np.testing.assert_allclose(after, 0.0, atol=1e-5)


def test_adam_moments_transport_like_the_equivalent_history():
  """reparameterize(state after 3 Adam steps on g) equals Adam run on the transported
  gradients (g_A / c, g_B * c) from the start: the equivalent-history oracle, in NumPy."""
  params, pairs = maxtext_params(), per_layer_pairs()
  rng = np.random.default_rng(7)
  grads = [
    jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
    for _ in range(3)
  ]
  tx = optax.adam(1e-2)
  state = tx.init(params)
  for g in grads:
    _, state = tx.update(g, state, params)
  plan = saggs._src.plan.resolve(pairs, params)
  factors = {i.a: np.exp(rng.uniform(-1.5, 1.5, i.factor_shape)) for i in plan.instances}
  _, moved = saggs.reparameterize(params, state, pairs, lambda path, shape: factors[path])

  def transported(g):
    for pair in pairs:
      c = factors[pair.a]
      groups = c.shape[-1]
      a, b = get(g, pair.a), get(g, pair.b)
      g = put(g, pair.a, jnp.asarray(np_scale(a, (1,), pair.axes[0], groups, 1 / c), jnp.float32))
      g = put(g, pair.b, jnp.asarray(np_scale(b, (1,), pair.axes[1], groups, c), jnp.float32))
    return g

  oracle = tx.init(params)
  for g in grads:
    _, oracle = tx.update(transported(g), oracle, params)
  chex.assert_trees_all_close(moved[0].mu, oracle[0].mu, rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(moved[0].nu, oracle[0].nu, rtol=1e-5, atol=1e-9)


def test_canonicalize_is_idempotent_and_orbit_invariant():
  params, pairs = maxtext_params(), per_layer_pairs() + [GAIN]
  once, _ = saggs.canonicalize(params, None, pairs)
  twice, _ = saggs.canonicalize(once, None, pairs)
  chex.assert_trees_all_close(twice, once, rtol=1e-5)
  rng = np.random.default_rng(2)
  moved, _ = saggs.reparameterize(params, None, pairs, lambda p, s: np.exp(rng.uniform(-2, 2, s)))
  chex.assert_trees_all_close(saggs.canonicalize(moved, None, pairs)[0], once, rtol=1e-4)


def test_describe_and_imbalance_put_the_copy_axes_first():
  params = maxtext_params()
  text = saggs.describe(params, per_layer_pairs())
  assert f"{ATTN}/out/kernel" in text and f"({L}, {KV})" in text and f"({L}, {M})" in text
  shapes = {k: v.shape for k, v in saggs.imbalance(params, per_layer_pairs()).items()}
  assert sorted(shapes.values()) == [(L, KV), (L, KV), (L, M)]
  moe = {"wi": jnp.ones((3, L, E, M)), "wo": jnp.ones((3, L, M, E))}
  (shape,) = (
    v.shape for v in saggs.imbalance(moe, [saggs.Pair("wi", "wo", (1, 0), stacked=(0, 1))]).values()
  )
  assert shape == (3, L, M)


def test_qk_clip_clips_each_layer_by_its_own_logits_on_a_non_leading_layer_axis():
  tau = 50.0
  params, x = maxtext_params(), batch()
  q_path, k_path = f"{ATTN}/query/kernel", f"{ATTN}/key/kernel"
  params = put(params, q_path, get(params, q_path).at[:, 0].multiply(3.0))

  def per_layer(p):  # (layers, heads): layer i's pre-attention activations as x
    h = rms_norm(x, 1.0)
    return jnp.stack(
      [
        saggs.max_logits(
          jnp.einsum("bte,ehd->bthd", h, get(p, q_path)[:, i]),
          jnp.einsum("bte,ehd->bthd", h, get(p, k_path)[:, i]),
          is_causal=True,
        )
        for i in range(L)
      ]
    )

  before = np.asarray(per_layer(params))
  assert (before[0] > tau).any() and (before < tau).any()
  tx = saggs.chain(optax.sgd(0.0), saggs.qk_clip(per_layer_pairs()[:1], tau))
  updates, _ = jax.jit(lambda p: tx.update(p, tx.init(p), p, max_logits={q_path: per_layer(p)}))(
    params
  )
  after = np.asarray(per_layer(optax.apply_updates(params, updates)))
  np.testing.assert_allclose(after, np.minimum(before, tau), rtol=3e-6)


def test_checkpoint_round_trip_canonicalizes_per_layer(tmp_path):
  params, pairs = maxtext_params(), per_layer_pairs() + [GAIN]
  tx = saggs.chain(optax.adamw(1e-2), saggs.saggs(pairs))
  state = tx.init(params)
  updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
  params = optax.apply_updates(params, updates)
  manager = ocp.CheckpointManager(tmp_path / "ckpt")
  try:
    assert saggs.checkpoint.save(manager, 1, params, state)
    target = saggs.reparameterize(maxtext_params(seed=1), tx.init(params), pairs, 2.0)
    got_params, got_state, step = saggs.checkpoint.restore(manager, *target, canonicalize=False)
    assert step == 1
    chex.assert_trees_all_equal((got_params, got_state), (params, state))
    got_params, _, _ = saggs.checkpoint.restore(manager, *target, pairs=pairs, tx=tx)
  finally:
    manager.close()
  chex.assert_trees_all_close(got_params, saggs.canonicalize(params, None, pairs)[0], rtol=1e-5)


def test_jit_traces_once():
  params, pairs, traces = maxtext_params(), per_layer_pairs() + [GAIN], []
  tx = saggs.chain(optax.adam(1e-2), saggs.saggs(pairs))

  @jax.jit
  def step(params, state, x):
    traces.append(1)
    grads = jax.grad(lambda p: jnp.mean(forward(p, x) ** 2))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for seed in range(3):
    params, state = step(params, state, batch(seed))
  assert len(traces) == 1
  np.testing.assert_allclose(
    jnp.concatenate([v.ravel() for v in saggs.imbalance(params, pairs).values()]), 0.0, atol=0.1
  )


def _update_bytes(params, pairs):
  tx = saggs.chain(optax.adam(1e-2), saggs.saggs(pairs))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  state = jax.eval_shape(tx.init, abstract)
  compiled = jax.jit(lambda g, s, p: tx.update(g, s, p)).lower(abstract, state, abstract).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return cost["bytes accessed"]


def test_a_non_leading_layer_axis_costs_the_bytes_of_a_leading_one():
  """No transpose of a full parameter: the update reads and writes what it would with the
  layer axis leading (XLA's cost analysis, within 1%)."""
  params = jax.tree.map(lambda x: jnp.zeros(x.shape[:1] + (8,) + x.shape[2:]), maxtext_params())
  pairs = per_layer_pairs() + [GAIN]
  lead = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), params)
  lead_pairs = [saggs.Pair(**{**vars(p), "stacked": 1}) for p in pairs]
  at_one, leading = _update_bytes(params, pairs), _update_bytes(lead, lead_pairs)
  assert abs(at_one / leading - 1) < 0.01, (at_one, leading)


def test_bad_copy_axes_are_named():
  params = maxtext_params()
  with pytest.raises(ValueError, match="increasing axis positions"):
    saggs.Pair("a", "b", stacked=(1, 0))
  with pytest.raises(ValueError, match="increasing axis positions"):
    saggs.Pair("a", "b", stacked=(-1,))
  few = saggs.Pair(GAIN.a, GAIN.b, axes=(0, 0), stacked=(2,))
  path = next(p for p, _ in paths.arrays_with_paths(params) if p.endswith("norm/scale"))
  want = COPY_AXES_MSG.format(where=few.label, path=path, shape=(8, 2), copy=(2,))
  with pytest.raises(ValueError, match=re.escape(want)):
    saggs._src.plan.resolve([few], params)
  with pytest.raises(
    ValueError,
    match=r"group axis 3 is out of range for .*query/kernel' with shape \(8, 2, 4, 3\) \(3 axes besides",
  ):
    saggs._src.plan.resolve(
      [saggs.Pair(f"{ATTN}/query/kernel", f"{ATTN}/key/kernel", (3, 1), stacked=(1,))], params
    )
  with pytest.raises(ValueError, match="stacked axes differ"):
    bad = {"a": jnp.ones((4, 2, 3)), "b": jnp.ones((3, 5, 4))}
    saggs._src.plan.resolve([saggs.Pair("a", "b", axes=(1, 0), stacked=(1,))], bad)


SHARDED = textwrap.dedent(r"""
    import sys
    sys.path[:0] = [@TESTS@, @ROOT@]
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import saggs_jax as saggs
    import test_copy_axes as t

    assert jax.device_count() == 8
    params, pairs = t.maxtext_params(), t.per_layer_pairs() + [t.GAIN]
    tx = saggs.chain(optax.adam(1e-2), saggs.saggs(pairs))
    grads = jax.tree.map(lambda p: p * 0.5 + 0.1, params)
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    want = step(grads, tx.init(params), params)
    mesh = jax.make_mesh((8,), ("x",))
    # The emb axis (8) over the 8 devices: axis 0 of every leaf but out's (2) and wo's (0).
    spec = lambda path, x: P(*[("x" if n == t.E and i != 1 else None) for i, n in enumerate(x.shape)])
    sh = jax.tree_util.tree_map_with_path(
      lambda kp, x: NamedSharding(mesh, spec(kp, x)), params)
    with jax.set_mesh(mesh):
      p, g = jax.device_put(params, sh), jax.device_put(grads, sh)
      got = step(g, tx.init(p), p)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7)
    print("SHARDED OK")
""")


def test_sharded_equals_unsharded():
  script = SHARDED.replace("@TESTS@", repr(str(ROOT / "tests"))).replace("@ROOT@", repr(str(ROOT)))
  run = subprocess.run(
    [sys.executable, "-c", script], env=cpu_env(8), capture_output=True, text=True, timeout=600
  )
  assert "SHARDED OK" in run.stdout, run.stderr[-4000:]


def test_discover_confirmation_expands_factors_onto_a_non_leading_copy_axis():
  """discover's random factors (copies..., groups) land on a leaf's own copy axes."""
  from saggs_jax._src.discovery.confirmation import _expand

  rng = np.random.default_rng(0)
  x = rng.standard_normal((H, L, HD, E))  # MaxText's out kernel: heads, layers, head_dim, emb
  c = np.exp(rng.uniform(-1, 1, (L, KV)))
  got = x * _expand(c, x.shape, 0, (1,))
  np.testing.assert_allclose(got, np_scale(x, (1,), 0, KV, c), rtol=1e-12)
  lead = np.moveaxis(x, 1, 0)
  np.testing.assert_allclose(
    lead * _expand(c, lead.shape, 1, 1), np.moveaxis(got, 1, 0), rtol=1e-12
  )


def test_a_leaf_in_pairs_of_different_copy_axes_is_balanced_jointly():
  """MoE experts (experts, layers, emb, mlp) per expert and layer, and the norm gain
  (emb, layers) against every expert's input rows per layer: one leaf in two instances whose
  copy axes differ, solved jointly; the same factors as with the layer axis leading."""
  rng = np.random.default_rng(4)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s) * np.exp(rng.uniform(-1, 1, s)), jnp.float32)
  params = {
    "norm": {"scale": mk(E, L) + 2},
    "wi_0": mk(3, L, E, M),
    "wi_1": mk(3, L, E, M),
    "wo": mk(3, L, M, E),
  }
  pairs = [
    saggs.Pair("wi_1", "wo", axes=(1, 0), stacked=(0, 1)),
    saggs.Pair("norm/scale", ("wi_0", "wi_1"), axes=(0, 1), stacked=(1,)),
  ]
  got, _ = saggs.canonicalize(params, None, pairs)
  for v in saggs.imbalance(got, pairs).values():
    np.testing.assert_allclose(v, 0.0, atol=1e-4)
  lead = {
    "norm": {"scale": params["norm"]["scale"].T},
    **{k: jnp.swapaxes(params[k], 0, 1) for k in ("wi_0", "wi_1", "wo")},
  }
  lead_pairs = [
    saggs.Pair("wi_1", "wo", axes=(1, 0), stacked=(0, 1)),
    saggs.Pair("norm/scale", ("wi_0", "wi_1"), axes=(0, 1), stacked=(0,)),
  ]
  want, _ = saggs.canonicalize(lead, None, lead_pairs)
  np.testing.assert_allclose(got["norm"]["scale"].T, want["norm"]["scale"], rtol=1e-5)
  for k in ("wi_0", "wi_1", "wo"):
    np.testing.assert_allclose(jnp.swapaxes(got[k], 0, 1), want[k], rtol=1e-5)
