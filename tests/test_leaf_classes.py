"""State leaves an optimizer computes alike: hand-written programs with known classes, and the
degree probe that runs one leaf per class against a NumPy equivalent history."""

from typing import Any, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax

import saggs_jax as saggs
from harness import shapes
from saggs_jax._src import degrees, leaf_classes, paths, probe
from saggs_jax._src.plan import resolve

SPEC = [jax.ShapeDtypeStruct((2, 3), jnp.float32)] * 3
SAME = [("f32", (2, 3))] * 3  # the three parameter leaves' layouts: all alike


def jaxpr(fn, *args):
  return jax.jit(fn).trace(*args).jaxpr


def classes(init, update, n_state, layouts=SAME, places=None):
  """``leaf_classes.classes`` of ``init(params) -> state`` and ``update(g, s, p) -> state``
  (lists of leaves), state leaf j of parameter leaf ``j % 3`` unless ``places`` says."""
  state = jax.eval_shape(init, SPEC)
  places = places or [(("s", j // 3), j % 3) for j in range(n_state)]
  programs = (
    leaf_classes.Program(jaxpr(init, SPEC)),
    leaf_classes.Program(jaxpr(update, SPEC, state, SPEC)),
  )
  return leaf_classes.classes(*programs, (0, 0), layouts, places)


def zeros(p):
  return [jnp.zeros_like(x) for x in p]


def test_leaves_updated_by_the_same_program_share_a_class():
  got = classes(zeros, lambda g, s, p: [0.9 * a + x for a, x in zip(s, g)], 3)
  assert got == [0, 0, 0]


def test_a_leaf_updated_otherwise_is_a_class_of_its_own():
  def update(g, s, p):
    return [0.9 * s[0] + g[0], 0.9 * s[1] + g[1], 0.9 * s[2] + g[2] * jnp.abs(g[2])]

  assert classes(zeros, update, 3) == [0, 0, 2]


def test_constants_are_compared_by_value():
  scales = [np.full((2, 3), v, np.float32) for v in (0.5, 0.5, 0.25)]
  got = classes(zeros, lambda g, s, p: [a + x * c for a, x, c in zip(s, g, scales)], 3)
  assert got == [0, 0, 2]


def test_a_leaf_reading_two_parameter_leaves_is_a_class_of_its_own():
  def update(g, s, p):  # leaves 1 and 2 each read two gradients, alike
    return [s[0] + g[0], s[1] + g[1] * g[0], s[2] + g[2] * g[0]]

  assert classes(zeros, update, 3) == [0, 1, 2]


def test_leaves_of_other_layouts_or_places_are_not_merged():
  update = lambda g, s, p: [a + x for a, x in zip(s, g)]  # noqa: E731
  layouts = [*SAME[:2], ("f32", (2, 3), "another slot")]
  assert classes(zeros, update, 3, layouts=layouts) == [0, 0, 2]
  places = [(("mu",), 0), (("nu",), 1), (("mu",), 2)]
  assert classes(zeros, update, 3, places=places) == [0, 1, 0]
  assert classes(zeros, update, 3, places=[(("s",), 1), (("s",), 1), None]) == [0, 1, 2]


def copy_chain(g, s, p):
  """State leaves a_i (0-2) and b_i (3-5): b_i takes a_i, a_i adds its gradient, leaf 2's
  twice. After one step the b's still agree; they differ from the second on."""
  a = s[:3]
  return [a[0] + g[0], a[1] + g[1], a[2] + 2 * g[2], a[0], a[1], a[2]]


def test_classes_are_refined_until_histories_of_any_length_agree():
  got = classes(lambda p: zeros(p) + zeros(p), copy_chain, 6)
  assert got == [0, 0, 2, 3, 3, 5]


def test_closure_and_reduced_keep_what_the_kept_leaves_read():
  state = jax.eval_shape(lambda p: zeros(p) + zeros(p), SPEC)
  update = jaxpr(copy_chain, SPEC, state, SPEC)
  assert leaf_classes.closure(leaf_classes.Program(update), 0, 3, [5]) == [2, 5]
  cut, used = leaf_classes.reduced(update, [2, 5])
  assert used == [2, 3 + 2]  # gradient 2, state a_2 (after the 3 gradients)
  rng = np.random.default_rng(0)
  g, a = (rng.standard_normal((2, 3)).astype(np.float32) for _ in range(2))
  got = jax.extend.core.jaxpr_as_fun(cut)(g, a)
  np.testing.assert_allclose(got[0], a + 2 * g, rtol=1e-6)
  np.testing.assert_array_equal(got[1], a)


# ---------------------------------------------------------------------------------------
# The probe on one leaf per class, against a NumPy equivalent history.


def probed(opt, params, pairs):
  """The probe's program of ``opt`` on the proxy of ``params``."""
  opt = optax.with_extra_args_support(opt)
  small, spec, init, _, update = degrees._fitting_proxy(
    opt, params, resolve(pairs, params), None, {}
  )
  return probe.trace(spec, init.out_info, small, init.jaxpr, update)


class PathTrace(NamedTuple):
  """A trace whose layer-1 leaves accumulate ``g |g|`` (degree 2), the others ``g``."""

  acc: Any


saggs.register_transport(PathTrace, {"acc": 1})


def path_trace() -> optax.GradientTransformation:
  def init(params):
    return PathTrace(jax.tree.map(jnp.zeros_like, params))

  def update(grads, state, params=None) -> tuple[Any, Any]:
    def leaf(key_path, a, g):
      layer1 = jax.tree_util.keystr(key_path).startswith("['layer1']")
      return 0.9 * a + (g * jnp.abs(g) if layer1 else g)

    acc = jax.tree_util.tree_map_with_path(leaf, state.acc, grads)
    return acc, PathTrace(acc)

  return optax.GradientTransformation(init, update)


LAYERS = 4
PAIRS = [saggs.Pair(f"layer{i}/q", f"layer{i}/k", axes=(1, 1), groups=2) for i in range(LAYERS)]
C = np.array([1.7, 0.6])


def test_layers_an_optimizer_treats_otherwise_get_their_own_degrees():
  """Layer 1 accumulates g |g|: its trace has degree 2 where the other layers' have 1; the
  layers alike share one probe leaf, layer 1 has its own, and reparameterize with ``tx=``
  equals the equivalent history (NumPy multipliers, c per group of two columns)."""
  rng = np.random.default_rng(0)
  layer = lambda: {"q": rng.standard_normal((3, 4)), "k": rng.standard_normal((5, 4))}  # noqa: E731
  params = {
    f"layer{i}": {n: jnp.asarray(x, jnp.float32) for n, x in layer().items()} for i in range(LAYERS)
  }
  grads = [jax.tree.map(lambda x: jnp.asarray(rng.uniform(0.5, 1.5, x.shape), x.dtype), params)]
  grads += [jax.tree.map(lambda x: -x, grads[0])]
  opt = path_trace()

  def history(params, grads):
    state = opt.init(params)
    for g in grads:
      state = opt.update(g, state, params)[1]
    return state

  mult = {"q": np.repeat(C, 2), "k": 1 / np.repeat(C, 2)}
  moved = lambda tree, k: {  # noqa: E731
    layer: {n: jnp.asarray(np.asarray(x) * mult[n] ** -k, jnp.float32) for n, x in leaves.items()}
    for layer, leaves in tree.items()
  }
  want = history(moved(params, -1), [moved(g, 1) for g in grads])
  _, got = saggs.reparameterize(
    params, history(params, grads), PAIRS, lambda path, shape: C, tx=opt
  )
  assert isinstance(got, PathTrace)
  for i in range(LAYERS):
    for n in ("q", "k"):
      np.testing.assert_allclose(
        got.acc[f"layer{i}"][n], want.acc[f"layer{i}"][n], rtol=1e-5, err_msg=f"layer{i}/{n}"
      )
  assert (
    len(probed(opt, params, PAIRS).kept) == 4
  )  # q and k of layer 0 (layers 2, 3 alike), and of layer 1


def test_the_probe_of_an_unrolled_model_runs_one_layer():
  """The probe's program on an unrolled LLaMA does not grow with the layers: it runs AdamW's
  mu and nu of layer 0's leaves (those of one layout: V with Q, the two norms, as one) and of
  those outside the layers, and the step count."""

  def run(layers):
    cfg = dict(shapes.SIZES["1b"], num_layers=layers)
    params = shapes.llama(**cfg, scanned=False)
    program = probed(optax.adamw(1e-3), params, saggs.presets.llama(cfg["num_kv_heads"]))
    names = [paths.path_str(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    assert program.sizes == (len(names), 2 * len(names) + 1)
    return [names[i] for i in program.params], len(program.kept), len(program.update.jaxpr.eqns)

  two, twelve = run(2), run(12)
  assert two == twelve
  assert all(not n.startswith("layers/") or n.startswith("layers/0/") for n in two[0])
  assert "layers/0/attn/v_proj/kernel" not in two[0]  # alike layer 0's q_proj
  assert two[1] == 2 * len(two[0])  # the count, which mu and nu do not read, is not run
