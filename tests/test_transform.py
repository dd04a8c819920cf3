"""SAGGS dynamics: balancing math, moment transport, every-k, jit, dtypes, guards, chains.

The tests run on a small two-layer toy with GQA-style Q/K groups and a ReLU
MLP, pushed off balance first by a random exact reparameterisation so that
the balancing has real work to do. Real model layouts are in test_models.py.
"""

import re

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import models
import saggs_jax as saggs
from models import assert_balanced, assert_imbalanced, leaf_dict, norms, random_like
from saggs_jax import equivariant

# A two-layer toy with the same kinds of symmetry as a Transformer: Q/K per KV
# head under GQA (4 query columns per group against 2 key columns), and a ReLU
# MLP per hidden channel. All tests here share its shapes, so the eager JAX
# primitives compile once for the whole file.
SMALL_PAIRS = (
  saggs.Pair("layers/*/q", "layers/*/k", axes=(1, 1), groups=2),
  saggs.Pair("layers/*/up", "layers/*/down", axes=(1, 0)),
)
SMALL_DECLARED = {f"layers/{i}/{n}" for i in range(2) for n in ("q", "k", "up", "down")}


def small_params(seed, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  return {
    "layers": {
      str(i): {"q": mk(4, 8), "k": mk(4, 4), "up": mk(4, 6), "down": mk(6, 4), "norm": mk(4)}
      for i in range(2)
    }
  }


def small_imbalanced(seed, dtype=jnp.float32):
  """Small params pushed far off balance by an exact reparameterisation."""
  return models.perturb(small_params(seed, dtype), SMALL_PAIRS, seed)


def _small_apply(params, x):
  h = x
  for i in range(2):
    p = params["layers"][str(i)]
    q = (h @ p["q"]).reshape(-1, 2, 4).sum(-1)  # per group: linear in q_g
    k = (h @ p["k"]).reshape(-1, 2, 2).sum(-1)  # per group: linear in k_g
    qk = jnp.sum(q * k, -1, keepdims=True)
    h = h + jax.nn.relu(h @ p["up"]) @ p["down"] + qk * p["norm"]
  return h


small_apply = jax.jit(_small_apply)
SMALL_X = jnp.asarray(np.random.default_rng(99).standard_normal((3, 4)), jnp.float32)


def small_norms(params):
  """Per pair instance: (||A_g||, ||B_g||) computed here with NumPy, independently of the library."""
  out = {}
  for i in range(2):
    p = {k: np.asarray(v) for k, v in params["layers"][str(i)].items()}
    q, k = p["q"].reshape(4, 2, 4), p["k"].reshape(4, 2, 2)  # (in, group, rest of the group)
    out[f"{i}/qk"] = (norms(q, (0, 2)), norms(k, (0, 2)))
    out[f"{i}/ud"] = (norms(p["up"], 0), norms(p["down"], 1))
  return out


def small_multipliers(params, strength=1.0, limit=np.inf):
  """Per declared path: what hard (or soft) balancing multiplies it by, computed in NumPy;
  each factor within ``exp(+-limit)`` (one update's step)."""
  out = {}
  for i in range(2):
    n = small_norms(params)
    c = np.clip(
      (n[f"{i}/qk"][1] / n[f"{i}/qk"][0]) ** (strength / 2), np.exp(-limit), np.exp(limit)
    )
    out[f"layers/{i}/q"], out[f"layers/{i}/k"] = np.repeat(c, 4), 1 / np.repeat(c, 2)
    c = np.clip(
      (n[f"{i}/ud"][1] / n[f"{i}/ud"][0]) ** (strength / 2), np.exp(-limit), np.exp(limit)
    )
    out[f"layers/{i}/up"], out[f"layers/{i}/down"] = c, 1 / c[:, None]
  return out


DEGREES = {"mu": 1, "nu": 2, "nu_max": 2, "trace": 1, "acc_grads": 1}


def hand_transport(tree, mult, degree=None):
  """Multiplies every leaf ending in a declared path by ``mult ** -k`` in NumPy float64.

  ``degree``: k for every leaf (-1 for parameters, 1 for gradients); None takes k from the
  name of the state field holding the leaf (``DEGREES``). The oracle for the library's transport.
  """

  def visit(key_path, x):
    names = [saggs._src.paths.key_name(e) for e in key_path]
    path = next(
      ("/".join(names[i:]) for i in range(len(names)) if "/".join(names[i:]) in mult), None
    )
    if path is None or not hasattr(x, "shape") or x.ndim == 0:
      return x
    fields = [n for n in names if n in DEGREES]
    assert degree is not None or fields, f"no degree known for {names}"
    k = DEGREES[fields[-1]] if degree is None else degree
    moved = np.asarray(x, np.float64) * mult[path] ** (-k)
    # A NumPy leaf (a float64 oracle) stays NumPy: JAX would truncate it to float32.
    return moved.astype(x.dtype) if isinstance(x, np.ndarray) else jnp.asarray(moved, x.dtype)

  return jax.tree_util.tree_map_with_path(visit, tree)


step = models.step
imbalance = saggs.imbalance


def assert_same_function(p0, p1):
  models.assert_same_function(small_apply, p0, p1, SMALL_X)


# --- balancing ----------------------------------------------------------------

HARD0 = saggs.chain(optax.sgd(0.0), saggs.saggs(SMALL_PAIRS))


def test_hard_equalises_group_norms_at_geometric_mean():
  params = small_imbalanced(1)
  assert_same_function(small_params(1), params)
  before = small_norms(params)
  assert_imbalanced(before, at_least=1.0)
  new, _, state = step(HARD0, params, HARD0.init(params), jax.tree.map(jnp.zeros_like, params))
  assert_same_function(params, new)
  after = small_norms(new)
  assert_balanced(after)
  for k, (a, _) in after.items():
    np.testing.assert_allclose(a, np.sqrt(before[k][0] * before[k][1]), rtol=1e-5, err_msg=k)
  for v in imbalance(new, SMALL_PAIRS).values():
    np.testing.assert_allclose(v, 0.0, atol=1e-5)
  # The factors in the state are the ones that were applied: c = sqrt(||B|| / ||A||).
  a0, b0 = before["1/qk"]
  np.testing.assert_allclose(state[1].factors["layers/1/q|layers/1/k"], np.sqrt(b0 / a0), rtol=1e-5)
  # Leaves outside the pairs keep their values.
  for path, leaf in leaf_dict(params).items():
    if path not in SMALL_DECLARED:
      np.testing.assert_array_equal(leaf_dict(new)[path], leaf)


@pytest.mark.parametrize("strength", [0.25, 0.5, 0.9])
def test_soft_shrinks_log_imbalance_by_one_minus_strength(strength):
  tx = saggs.chain(optax.sgd(0.0), saggs.soft(SMALL_PAIRS, strength=strength))
  params = p0 = small_imbalanced(2)
  state = tx.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  imb0 = imbalance(params, SMALL_PAIRS)
  for n in range(1, 4):
    params, _, state = step(tx, params, state, zeros)
    imb = imbalance(params, SMALL_PAIRS)
    for k, v in imb.items():
      np.testing.assert_allclose(v, (1 - strength) ** n * imb0[k], atol=1e-5, err_msg=f"{k} n={n}")
  assert_same_function(p0, params)


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
@hypothesis.given(
  log_a=st.lists(st.floats(-6, 6), min_size=3, max_size=3),
  log_b=st.lists(st.floats(-6, 6), min_size=3, max_size=3),
  strength=st.floats(0.01, 1.0),
)
def test_soft_factor_property(log_a, log_b, strength):
  """For any group norms, one application multiplies log(||A||/||B||) by exactly 1 - strength."""
  rng = np.random.default_rng(0)
  a = rng.standard_normal((5, 3)) * np.exp(log_a)[None]
  b = rng.standard_normal((3, 4)) * np.exp(log_b)[:, None]
  params = {"a": jnp.asarray(a, jnp.float32), "b": jnp.asarray(b, jnp.float32)}
  pairs = [saggs.Pair("a", "b", axes=(1, 0))]
  c = saggs._src.balance.compute_factors(saggs._src.plan.resolve(pairs, params), params, strength)[
    0
  ]["a|b"]
  new, _ = saggs.reparameterize(params, None, pairs, lambda p, s: c)
  before = np.log(np.linalg.norm(a, axis=0) / np.linalg.norm(b, axis=1))
  after = np.log(
    np.linalg.norm(np.asarray(new["a"], np.float64), axis=0)
    / np.linalg.norm(np.asarray(new["b"], np.float64), axis=1)
  )
  np.testing.assert_allclose(after, (1 - strength) * before, atol=2e-5)


def test_canonicalize_is_idempotent_and_constant_on_orbits():
  params = small_params(3)
  state = random_like(optax.adam(1e-2).init(params), 3, positive=True)
  canon = saggs.canonicalize(params, state, SMALL_PAIRS)
  moved = models.reparam(params, state, SMALL_PAIRS, models.orbit_factors(params, SMALL_PAIRS, 4))
  assert not np.allclose(moved[0]["layers"]["0"]["q"], params["layers"]["0"]["q"], rtol=1e-2)
  assert not np.allclose(
    moved[1][0].nu["layers"]["0"]["q"], state[0].nu["layers"]["0"]["q"], rtol=1e-2
  )
  chex.assert_trees_all_close(saggs.canonicalize(*moved, SMALL_PAIRS), canon, rtol=2e-5, atol=1e-6)
  chex.assert_trees_all_close(saggs.canonicalize(*canon, SMALL_PAIRS), canon, rtol=2e-5, atol=1e-6)


# --- moment transport -----------------------------------------------------------


def _partition_labels(params):  # Q/K with Adam, the rest with Lion
  return jax.tree_util.tree_map_with_path(
    lambda kp, _: "adam" if kp[-1].key in ("q", "k") else "lion", params
  )


def _mask(params):  # masks out layer 0's K and layer 1's up and down
  return jax.tree_util.tree_map_with_path(
    lambda kp, _: (kp[1].key, kp[2].key) not in {("0", "k"), ("1", "up"), ("1", "down")}, params
  )


STATE_CASES = {
  "adam": lambda p: optax.adam(1e-2),
  "adamw": lambda p: optax.adamw(1e-2, weight_decay=0.1),
  "amsgrad": lambda p: optax.amsgrad(1e-2),
  "lion": lambda p: optax.lion(1e-3),
  "trace": lambda p: optax.sgd(1e-2, momentum=0.9),
  "multisteps": lambda p: optax.MultiSteps(optax.adam(1e-2), 2).gradient_transformation(),
  "masked": lambda p: optax.masked(optax.adam(1e-2), _mask(p)),
  "inject_hyperparams": lambda p: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
  "partition": lambda p: optax.partition(
    {"adam": optax.adam(1e-2), "lion": optax.lion(1e-3)}, _partition_labels(p)
  ),
  "equivariant": lambda p: equivariant.layerwise(
    {("q", "k", "up", "down"): equivariant.optimizer(equivariant.scale_by_row_norm(1), 1e-2)},
    default=optax.adam(1e-2),
  ),
}


@pytest.mark.parametrize("case", list(STATE_CASES))
def test_moments_transported(case):
  """One update of ``saggs.chain(inner, saggs)`` is ``inner`` stepping from the balanced state.

  The oracle balances by hand in NumPy: params times c, gradients and moments of degree k
  times c**-k, then runs ``inner`` alone. Leaves outside the pairs are bit-identical to
  ``inner`` alone from the unbalanced state.
  """
  make = STATE_CASES[case]
  params = small_imbalanced(5)
  inner = make(params)
  tx = saggs.chain(inner, saggs.saggs(SMALL_PAIRS))
  s0 = random_like(inner.init(params), 6, positive=True)
  grads = random_like(params, 7)
  mult = small_multipliers(params)
  p_want, u_want, s_want = step(
    inner,
    hand_transport(params, mult, -1),
    hand_transport(s0, mult),
    hand_transport(grads, mult, 1),
  )
  p_chain, u_chain, (s_chain, s_saggs) = step(tx, params, (s0, tx.init(params)[1]), grads)

  assert int(s_saggs.step) == 1
  np.testing.assert_allclose(
    s_saggs.factors["layers/1/q|layers/1/k"], mult["layers/1/q"][::4], rtol=1e-5
  )
  assert max(np.max(np.abs(np.log(m))) for m in mult.values()) > 1.0  # not vacuous
  chex.assert_trees_all_close(p_chain, p_want, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(s_chain, s_want, rtol=2e-5, atol=1e-6)
  # Params and updates outside the pairs are bit-identical to inner alone.
  _, u_alone, _ = step(inner, params, s0, grads)
  for path in leaf_dict(params):
    if path not in SMALL_DECLARED:
      np.testing.assert_array_equal(leaf_dict(u_chain)[path], leaf_dict(u_alone)[path])


def _ema_transform():
  import typing

  class MyEmaState(typing.NamedTuple):
    count: jax.Array
    ema: optax.Updates

  def init(params):
    return MyEmaState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params))

  def update(updates, state, params=None):
    ema = jax.tree.map(lambda e, g: 0.9 * e + 0.1 * g, state.ema, updates)
    return ema, MyEmaState(state.count + 1, ema)

  return MyEmaState, optax.GradientTransformation(init, update)


def test_unregistered_state_raises_then_register_transport_fixes_it():
  state_type, inner = _ema_transform()
  tx = saggs.chain(inner, saggs.saggs(SMALL_PAIRS))
  params = small_imbalanced(8)
  grads = random_like(params, 9)
  s0 = (random_like(inner.init(params), 10), saggs.saggs(SMALL_PAIRS).stage.init(params))
  tx.init(params)  # the degrees are measured at the first update, which refuses
  with pytest.raises(TypeError, match=r"MyEmaState.*opt_state.*register_transport\(MyEmaState"):
    tx.update(grads, s0, params)
  saggs.register_transport(state_type, {"ema": 1})
  mult = small_multipliers(params)
  _, _, (s_chain, _) = step(tx, params, s0, grads)
  _, _, s_want = step(
    inner,
    hand_transport(params, mult, -1),
    hand_transport(s0[0], mult, 1),
    hand_transport(grads, mult, 1),
  )
  chex.assert_trees_all_close(s_chain, s_want, rtol=2e-5, atol=1e-6)
  with pytest.raises(ValueError, match="no fields"):
    saggs.register_transport(state_type, {"nope": 1})


def test_plain_container_of_moments_raises():
  params = small_imbalanced(8)
  inner = optax.GradientTransformation(lambda p: {"m": p}, lambda u, s, p=None: (u, s))
  tx = saggs.chain(inner, saggs.saggs(SMALL_PAIRS))
  with pytest.raises(TypeError, match="register_transport"):
    tx.update(params, tx.init(params), params)


# --- every-k, balancing before the inner step, jit, retracing ---------------------

EVERY3 = saggs.chain(optax.sgd(0.1), saggs.saggs(SMALL_PAIRS, every=3))


def balances(n, every):
  """Whether update number n (from 1) balances: updates 1, every + 1, 2 * every + 1, ..."""
  return (n - 1) % every == 0


def test_every_k_balances_only_on_updates_1_k_plus_1():
  """With zero gradients only the balancing moves params: imbalance changes on updates 1, 4, 7."""
  params = small_params(0)
  state = EVERY3.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  for n in range(1, 8):
    params = models.perturb(params, SMALL_PAIRS, n, 0.2, 5.0)
    before = imbalance(params, SMALL_PAIRS)
    assert max(float(jnp.max(jnp.abs(v))) for v in before.values()) > 0.3
    want = small_multipliers(params)
    params, updates, state = models.jit_step(EVERY3, params, state, zeros)
    after = imbalance(params, SMALL_PAIRS)
    sstate = state[1]
    assert int(sstate.step) == n
    assert set(sstate.factors) == set(before)
    if balances(n, 3):
      for k in after:
        np.testing.assert_allclose(after[k], 0.0, atol=1e-5)
      np.testing.assert_allclose(
        sstate.factors["layers/0/up|layers/0/down"], want["layers/0/up"], rtol=1e-5
      )
    else:
      chex.assert_trees_all_equal(after, before)
      chex.assert_trees_all_equal(updates, zeros)
      for f in sstate.factors.values():
        np.testing.assert_array_equal(f, np.ones(f.shape, np.float32))


def test_every_k_skipped_updates_are_the_inner_updates_bit_for_bit():
  params = small_imbalanced(1)
  state = EVERY3.init(params)
  sgd = optax.sgd(0.1)
  for n in range(1, 6):
    grads = random_like(params, 30 + n)
    new, updates, state = models.jit_step(EVERY3, params, state, grads)
    inner, _ = sgd.update(grads, sgd.init(params), params)
    if balances(n, 3):  # SGD from the balanced point, by hand: p c - 0.1 g / c
      mult = small_multipliers(params)
      want = hand_transport(params, mult, -1)
      want = jax.tree.map(lambda w, g: w - 0.1 * g, want, hand_transport(grads, mult, 1))
      chex.assert_trees_all_close(new, want, rtol=1e-5, atol=1e-6)
      assert max(np.max(np.abs(np.log(m))) for m in mult.values()) > 0.1  # not vacuous
    else:
      chex.assert_trees_all_equal(updates, inner)
    params = new


SMALL_GRAD = jax.jit(jax.grad(lambda params: jnp.mean(_small_apply(params, SMALL_X) ** 2)))


@pytest.mark.parametrize("every", [1, 3])
def test_update_is_the_plain_step_from_the_balanced_state(every):
  """Oracle: balance by hand (NumPy), take the gradient AT the balanced point, step plain Adam.

  The library instead transports the gradient taken at the unbalanced point; both must agree
  on every update, balancing (1, every + 1, ...) or not.
  """
  tx = saggs.chain(optax.adam(1e-2), saggs.saggs(SMALL_PAIRS, every=every))
  adam = optax.adam(1e-2)
  p = p_want = small_imbalanced(21)
  s, s_want = tx.init(p), adam.init(p)
  for n in range(1, 7):
    p, _, s = models.jit_step(tx, p, s, SMALL_GRAD(p))
    if balances(n, every):
      mult = small_multipliers(p_want)
      p_want, s_want = hand_transport(p_want, mult, -1), hand_transport(s_want, mult)
    p_want, _, s_want = models.jit_step(adam, p_want, s_want, SMALL_GRAD(p_want))
    chex.assert_trees_all_close(p, p_want, rtol=2e-5, atol=1e-6)
    chex.assert_trees_all_close(s[0], s_want, rtol=2e-5, atol=1e-7)
  assert (
    max(np.max(np.abs(np.log(m))) for m in small_multipliers(small_imbalanced(21)).values()) > 1
  )


# A loss whose gradient stays bounded on the toy's large outputs, so that every optimizer
# below trains stably for 20 steps.
BOUNDED_GRAD = jax.jit(jax.grad(lambda p: jnp.mean(jnp.log1p(_small_apply(p, SMALL_X) ** 2))))

EQUIVARIANCE_CASES = {  # rates small enough that the toy's dynamics are not chaotic
  "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
  "adam": lambda: optax.adam(1e-3),
  "lion": lambda: optax.lion(1e-4, weight_decay=0.1),
  "sgd_momentum": lambda: optax.sgd(2e-4, momentum=0.9),
  "muon": lambda: optax.contrib.muon(3e-3),
  "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
  "multisteps": lambda: optax.MultiSteps(optax.adam(1e-3), 2).gradient_transformation(),
}


@pytest.mark.parametrize("name", list(EQUIVARIANCE_CASES))
def test_equivalent_states_follow_one_trajectory(name):
  """Hard SAGGS every=1: two equivalent states (same function, transported moments, same
  count) give the same parameters after every update, with no canonicalize; the inner
  optimizer alone gives two different trajectories."""
  inner = EQUIVARIANCE_CASES[name]()

  def run(tx, p, s, steps=20, ret_state=False):
    for _ in range(steps):
      p, _, s = models.jit_step(tx, p, s, BOUNDED_GRAD(p))
    return (p, s) if ret_state else p

  p0, s0 = run(inner, small_params(40), inner.init(small_params(40)), 3, True)  # real moments
  mult = {k: np.asarray(v) for k, v in small_multipliers(small_imbalanced(41)).items()}
  p1, s1 = hand_transport(p0, mult, -1), hand_transport(s0, mult)
  assert_same_function(p0, p1)

  def rel(a, b):
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)]) for t in (a, b))
    return np.linalg.norm(a - b) / np.linalg.norm(b)

  tx = saggs.chain(inner, saggs.saggs(SMALL_PAIRS))
  state = lambda s: (s, tx.init(p0)[1])  # noqa: E731
  assert rel(run(tx, p0, state(s0)), run(tx, p1, state(s1))) <= 1e-4
  # Control: alone, the inner optimizer takes the two equivalent states to different orbits.
  ends = [
    saggs.canonicalize(run(inner, p, s), None, SMALL_PAIRS)[0] for p, s in ((p0, s0), (p1, s1))
  ]
  assert rel(*ends) > 1e-3


def test_jit_equals_eager_and_traces_once():
  tx = saggs.chain(optax.adam(1e-2), saggs.soft(SMALL_PAIRS, strength=0.5, every=2))
  traces = []

  def train_step(params, state, grads):
    traces.append(1)  # Python side effect: runs once per trace
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  jitted = jax.jit(train_step)
  p_eager = p_jit = small_params(1)
  s_eager = s_jit = tx.init(p_eager)
  for n in range(4):  # balance, skip, balance, skip
    grads = random_like(p_eager, 20 + n)
    p_eager, s_eager = train_step(p_eager, s_eager, grads)
    p_jit, s_jit = jitted(p_jit, s_jit, grads)
    chex.assert_trees_all_close(p_jit, p_eager, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(s_jit, s_eager, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal_dtypes(s_jit, s_eager)
  assert len(traces) == 4 + 1  # four eager calls, one trace for the jitted function


# --- dtypes and guards -------------------------------------------------------------


def test_bf16_dtypes_preserved_and_balanced():
  params = small_imbalanced(11, dtype=jnp.bfloat16)
  before = imbalance(params, SMALL_PAIRS)
  assert max(float(jnp.max(jnp.abs(v))) for v in before.values()) > 1.0
  tx = saggs.chain(optax.adam(1e-3), saggs.saggs(SMALL_PAIRS))
  state = tx.init(params)
  grads = random_like(params, 12)
  new, updates, state = models.jit_step(tx, params, state, grads)
  chex.assert_trees_all_equal_dtypes(new, params)
  chex.assert_trees_all_equal_dtypes(updates, params)
  chex.assert_trees_all_equal_dtypes(state[0][0].mu, params)
  chex.assert_trees_all_equal_dtypes(state[0][0].nu, params)
  for v in state[1].factors.values():
    assert v.dtype == jnp.float32
  # One bfloat16 update rescales by at most 2**±1: each |log(||A||/||B||)| shrinks by up to
  # 2 log 2 (the rest is left to the next updates).
  after = imbalance(new, SMALL_PAIRS)
  for k, v in before.items():
    assert after[k].dtype == jnp.float32
    want = np.sign(v) * np.maximum(np.abs(v) - 2 * np.log(2), 0)
    np.testing.assert_allclose(after[k], want, atol=2e-2, err_msg=k)
  chex.assert_tree_all_finite(new)
  chex.assert_tree_all_finite(state)
  # Both moments hold the transported gradient g / c to bf16 precision (a few 2**-8), from an
  # oracle in float64: Adam's first step from zero moments, mu = 0.1 g', nu = 0.001 g'**2.
  g = hand_transport(
    jax.tree.map(lambda x: np.asarray(x, np.float64), grads),
    small_multipliers(params, limit=np.log(2)),
    1,
  )
  for name, want, rtol in (
    ("mu", jax.tree.map(lambda x: 0.1 * x, g), 2**-7),
    ("nu", jax.tree.map(lambda x: 0.001 * x**2, g), 2**-6),
  ):
    got = getattr(state[0][0], name)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(got))
    for path, w in leaf_dict(want).items():
      np.testing.assert_allclose(
        np.asarray(leaf_dict(got)[path], np.float64),
        w,
        rtol=rtol,
        atol=1e-30,
        err_msg=f"{name} {path}",
      )


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_zero_and_nonfinite_norms_give_factor_one(dtype):
  """Groups: 0 zero A, 1 inf in A, 2 NaN in B, 3 zero B, 4 normal (A 4x B)."""
  a = np.ones((3, 5), np.float32) * 4.0
  b = np.ones((5, 3), np.float32)
  a[:, 0] = 0.0
  a[1, 1] = np.inf
  b[2, 0] = np.nan
  b[3, :] = 0.0
  params = {"a": jnp.asarray(a, dtype), "b": jnp.asarray(b, dtype), "other": jnp.ones(2, dtype)}
  pairs = [saggs.Pair("a", "b", axes=(1, 0))]
  tx = saggs.chain(optax.adam(0.0), saggs.saggs(pairs))  # lr 0: zeros stay
  grads = jax.tree.map(jnp.ones_like, params)
  new, updates, state = models.jit_step(tx, params, tx.init(params), grads)
  f = np.asarray(state[1].factors["a|b"])
  np.testing.assert_array_equal(f[:4], np.ones(4, np.float32))
  np.testing.assert_allclose(f[4], 0.5, rtol=1e-6)  # sqrt(||B|| / ||A||) = sqrt(1/4)
  # No NaN appears anywhere it was not already: updates and moments are finite,
  # and params are NaN exactly where they were NaN before.
  chex.assert_tree_all_finite(updates)
  chex.assert_tree_all_finite(state)
  np.testing.assert_array_equal(np.isnan(np.asarray(new["a"], np.float32)), np.isnan(a))
  np.testing.assert_array_equal(np.isnan(np.asarray(new["b"], np.float32)), np.isnan(b))
  assert np.isinf(np.asarray(new["a"], np.float32)[1, 1])
  for n in (new["a"], new["b"], updates["a"], state[0][0].mu["a"], state[0][0].nu["b"]):
    assert n.dtype == dtype
  # The healthy group is balanced.
  a4, b4 = np.asarray(new["a"], np.float32)[:, 4], np.asarray(new["b"], np.float32)[4]
  np.testing.assert_allclose(np.linalg.norm(a4), np.linalg.norm(b4), rtol=2e-2)


def test_float16_norms_do_not_underflow():
  """Squares of 1e-4 underflow in float16; norms are taken in float32, so balancing still works."""
  params = {"a": jnp.full((4, 2), 1e-4, jnp.float16), "b": jnp.full((2, 4), 1e-2, jnp.float16)}
  pairs = [saggs.Pair("a", "b", axes=(1, 0))]
  new, _ = saggs.canonicalize(params, None, pairs)
  assert new["a"].dtype == jnp.float16
  np.testing.assert_allclose(np.asarray(new["a"], np.float32), 1e-3, rtol=1e-2)
  np.testing.assert_allclose(np.asarray(new["b"], np.float32), 1e-3, rtol=1e-2)


@pytest.mark.parametrize("scale", [1e25, 1e-20])
def test_norms_are_scale_safe(scale):
  """Squared norms of q * s overflow (s = 1e25) or underflow (s = 1e-20) float32, and those
  of k / s the other way; the pair is still balanced, with finite factors and imbalance."""
  rng = np.random.default_rng(0)
  q, k = rng.standard_normal((4, 8)), rng.standard_normal((4, 4))
  params = {"q": jnp.asarray(q * scale, jnp.float32), "k": jnp.asarray(k / scale, jnp.float32)}
  pairs = [saggs.Pair("q", "k", axes=(1, 1), groups=2)]
  want = np.log(
    norms((q * scale).reshape(4, 2, 4), (0, 2)) / norms((k / scale).reshape(4, 2, 2), (0, 2))
  )
  np.testing.assert_allclose(imbalance(params, pairs)["q|k"], want, rtol=1e-5)
  canon, _ = saggs.canonicalize(params, None, pairs)
  chex.assert_tree_all_finite(canon)
  np.testing.assert_allclose(imbalance(canon, pairs)["q|k"], 0.0, atol=1e-5)
  # The stage computes the same factors, each update's within its float32 step (2**10).
  tx = saggs.chain(optax.sgd(0.0), saggs.saggs(pairs))
  new, _, state = models.jit_step(tx, params, tx.init(params), jax.tree.map(jnp.zeros_like, params))
  chex.assert_tree_all_finite(new)
  np.testing.assert_allclose(
    np.log(state[1].factors["q|k"]), np.clip(-want / 2, -10 * np.log(2), 10 * np.log(2)), rtol=1e-5
  )


@pytest.mark.parametrize(
  "dtype, scale, updates", [(jnp.float32, 1e25, 9), (jnp.float32, 1e4, 2), (jnp.bfloat16, 1e25, 84)]
)
def test_updates_keep_the_function_through_any_imbalance(dtype, scale, updates):
  """q * s, k / s through saggs.chain(sgd(0), saggs): apply_updates adds p * (c - 1), which
  rounds at the precision of p, so each update shrinks a weight by at most 2**-10 (float32)
  or 1/2 (bfloat16, where p * c - p is then exact). Oracles: NumPy logits q k^T after every
  update (float32), the landing point p * c rounded once to the dtype (bfloat16), and
  NumPy norms balanced after the expected number of updates."""
  rng = np.random.default_rng(0)
  q0, k0 = rng.standard_normal((4, 3)), rng.standard_normal((5, 3))
  logits = q0 @ k0.T
  params = {"q": jnp.asarray(q0 * scale, dtype), "k": jnp.asarray(k0 / scale, dtype)}
  tx = saggs.chain(optax.sgd(0.0), saggs.saggs([saggs.Pair("q", "k")]))
  state = tx.init(params)
  update = jax.jit(tx.update)
  limit = (10 if dtype == jnp.float32 else 1) * np.log(2)
  for _ in range(updates):
    before = {n: np.asarray(x, np.float32) for n, x in params.items()}
    u, state = update(jax.tree.map(jnp.zeros_like, params), state, params)
    params = optax.apply_updates(params, u)
    c = np.float32(state[1].factors["q|k"])
    assert abs(np.log(c)) <= limit * (1 + 1e-6)
    if dtype == jnp.float32:
      got = np.asarray(params["q"], np.float64) @ np.asarray(params["k"], np.float64).T
      np.testing.assert_allclose(got, logits, atol=1e-4 * np.max(np.abs(logits)))
    else:  # lands on p * c rounded once, as a direct rescale would
      np.testing.assert_array_equal(
        np.asarray(params["q"], np.float32),
        np.asarray(jnp.asarray(before["q"] * c, dtype), np.float32),
      )
      np.testing.assert_array_equal(
        np.asarray(params["k"], np.float32),
        np.asarray(jnp.asarray(before["k"] / c, dtype), np.float32),
      )
  norm = {n: np.linalg.norm(np.asarray(x, np.float64)) for n, x in params.items()}
  assert abs(np.log(norm["q"] / norm["k"])) <= (1e-5 if dtype == jnp.float32 else 1e-2), norm


@pytest.mark.parametrize("dtype,big,small", [(jnp.float16, 6e4, 1e-3), (jnp.bfloat16, 3e38, 1e25)])
def test_factors_never_overflow_the_dtype(dtype, big, small):
  """q is all ``big`` and k one ``big`` entry among small ones: the hard factor would push
  that k entry past the dtype's largest value. It is clipped instead: finite, and as close
  to balance as the dtype allows."""
  q = np.full((4, 2), big, np.float32)
  k = np.full((2, 4), small, np.float32)
  k[0, 0] = big
  params = {"q": jnp.asarray(q, dtype), "k": jnp.asarray(k, dtype)}
  pairs = [saggs.Pair("q", "k", axes=(1, 0))]
  new, _ = saggs.canonicalize(params, None, pairs)
  chex.assert_tree_all_finite(new)
  assert new["q"].dtype == dtype
  c = np.asarray(new["q"], np.float64)[0] / np.asarray(q, np.float64)[0]
  assert np.all(c < 1)  # it moved towards balance on both groups ...
  hard = np.sqrt(norms(k, 1) / norms(q, 0))
  assert c[0] > 1.2 * hard[0]  # ... but stopped short of the hard factor on group 0
  np.testing.assert_allclose(c[1], hard[1], rtol=1e-2)  # group 1 has room: exact
  limit = float(jnp.finfo(dtype).max)
  assert np.max(np.abs(np.asarray(new["k"], np.float64))) <= limit


def test_only_the_leaves_that_overflow_take_the_safe_passes():
  """Layer 0's Q/K squares overflow and underflow float32 and layer 1's up underflows,
  while every other leaf is ordinary: each of the three is recomputed on its own (one
  loop iteration per leaf), and every instance's log-imbalance and factor match float64."""
  params = small_params(12)
  scale = {"layers/0/q": 1e25, "layers/0/k": 1e-25, "layers/1/up": 1e-22}
  params = jax.tree_util.tree_map_with_path(
    lambda kp, x: x * scale.get(saggs._src.paths.path_str(kp), 1.0), params
  )
  p = {k: np.asarray(v, np.float64) for k, v in leaf_dict(params).items()}
  want = {}
  for i in range(2):
    q, k = p[f"layers/{i}/q"].reshape(4, 2, 4), p[f"layers/{i}/k"].reshape(4, 2, 2)
    want[f"layers/{i}/q|layers/{i}/k"] = np.log(norms(q, (0, 2)) / norms(k, (0, 2)))
    want[f"layers/{i}/up|layers/{i}/down"] = np.log(
      norms(p[f"layers/{i}/up"], 0) / norms(p[f"layers/{i}/down"], 1)
    )
  got = imbalance(params, SMALL_PAIRS)
  for key, w in want.items():
    np.testing.assert_allclose(got[key], w, rtol=1e-5, err_msg=key)
  tx = saggs.chain(optax.sgd(0.0), saggs.saggs(SMALL_PAIRS))
  _, _, state = models.jit_step(tx, params, tx.init(params), jax.tree.map(jnp.zeros_like, params))
  for key, w in want.items():  # each update's factor within its float32 step (2**10)
    np.testing.assert_allclose(
      np.log(state[1].factors[key]),
      np.clip(-w / 2, -10 * np.log(2), 10 * np.log(2)),
      rtol=1e-5,
      atol=1e-6,
      err_msg=key,
    )


def test_the_compiled_update_reads_the_declared_leaves_once():
  """XLA's cost analysis (deterministic) of a jitted every=1 update: beyond Adam's own
  traffic it reads the declared leaves once for their plain sums of squares, and XLA
  charges each leaf's scale-safe pass (a ``lax.cond`` that ordinary weights skip) with one
  more read: under three reads of them in all. (The update that runs on ordinary weights
  reads them about once: tests/test_update_cost.py.)"""
  rng = np.random.default_rng(0)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  params = {
    "layers": {
      str(i): {
        "q": mk(64, 128),
        "k": mk(64, 64),
        "up": mk(64, 256),
        "down": mk(256, 64),
        "norm": mk(64),
      }
      for i in range(8)
    }
  }
  declared = sum(x.nbytes for path, x in leaf_dict(params).items() if not path.endswith("norm"))

  def cost(tx):
    def train(p, s, g):
      updates, s = tx.update(g, s, p)
      return optax.apply_updates(p, updates), s

    compiled = jax.jit(train).lower(params, tx.init(params), params).compile()
    return compiled.cost_analysis()["bytes accessed"]

  extra = cost(saggs.chain(optax.adam(1e-3), saggs.saggs(SMALL_PAIRS))) - cost(optax.adam(1e-3))
  assert declared < extra < 3 * declared, extra / declared


def test_a_non_finite_entry_changes_only_its_own_group():
  rng = np.random.default_rng(1)
  q, k = rng.standard_normal((4, 8)), rng.standard_normal((4, 4))
  k[1, 0] = np.inf  # KV head 0
  params = {"q": jnp.asarray(q, jnp.float32), "k": jnp.asarray(k, jnp.float32)}
  pairs = [saggs.Pair("q", "k", axes=(1, 1), groups=2)]
  _, _, state = step(
    saggs.chain(optax.sgd(0.0), saggs.saggs(pairs)),
    params,
    saggs.chain(optax.sgd(0.0), saggs.saggs(pairs)).init(params),
    jax.tree.map(jnp.zeros_like, params),
  )
  f = np.asarray(state[1].factors["q|k"])
  assert f[0] == 1.0
  np.testing.assert_allclose(
    f[1], np.sqrt(norms(k[:, 2:], (0, 1)) / norms(q[:, 4:], (0, 1))), rtol=1e-5
  )


@pytest.mark.parametrize(
  "kwargs,match",
  [
    ({"strength": "0.5"}, "strength must be a number"),
    ({"strength": 0}, "strength"),
    ({"strength": 1.5}, "strength"),
    ({"every": True}, "every must be an int"),
    ({"every": 0}, "every"),
    ({"every": 2.0}, "every must be an int"),
  ],
)
def test_bad_arguments_are_clear_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    saggs.scale_by_saggs(SMALL_PAIRS, **kwargs)


@pytest.mark.parametrize("make", [saggs.saggs, saggs.soft, saggs.scale_by_saggs])
def test_bad_pairs_and_axis_names_fail_at_construction(make):
  """Not at init, and not read as the characters of a string."""
  with pytest.raises(
    TypeError, match=r"Expected a saggs_jax.Pair or a sequence of them, got str: 'q'"
  ):
    make("q")
  with pytest.raises(TypeError, match=r"Expected saggs_jax.Pair, got str: 'q'"):
    make([SMALL_PAIRS[0], "q"])
  for bad in (3, ("data", 3)):
    with pytest.raises(
      ValueError,
      match=re.escape(f"axis_name must be None, a mesh axis name or a tuple of them, got {bad!r}"),
    ):
      make(SMALL_PAIRS, axis_name=bad)
  make(SMALL_PAIRS, axis_name=("data", "fsdp"))


@pytest.mark.parametrize("every, pairs", [(1, []), (3, saggs.discovery.Discovery())])
def test_no_pairs_is_a_no_op_stage(every, pairs):
  """An empty declaration (a discover result that found nothing) changes nothing: the
  chain's updates and inner state are the inner optimizer's, bit for bit, under jit."""
  params = small_params(0)
  grads = random_like(params, 1)
  tx = saggs.chain(optax.adam(1e-2), saggs.saggs(pairs, every=every))
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  inner = optax.adam(1e-2)
  expected, inner_state = jax.jit(inner.update)(grads, inner.init(params), params)
  chex.assert_trees_all_equal((updates, state[0]), (expected, inner_state))
  assert state[1].factors == {} and int(state[1].step) == 1
  assert saggs.imbalance(params, []) == {}
  same, _ = saggs.canonicalize(params, None, [])
  chex.assert_trees_all_equal(same, params)


def test_optax_map_params_maps_the_moments_not_the_factors():
  """optax.tree.map_params (used to build state shardings from param shardings) reaches
  every params-shaped tree of a SAGGS chain's state, and leaves the factors to
  transform_non_params."""
  params = small_params(0)
  tx = saggs.chain(optax.adam(1e-2), saggs.saggs(SMALL_PAIRS))
  state = tx.init(params)
  marked = optax.tree.map_params(
    tx, lambda _: "param", state, transform_non_params=lambda _: "other"
  )
  assert set(jax.tree.leaves(marked[0][0].mu)) == {"param"}
  assert set(jax.tree.leaves(marked[0][0].nu)) == {"param"}
  assert jax.tree.leaves(marked[1]) == ["other"] * 4  # step, factors, residual, global_shapes


# --- inside a plain optax.chain ------------------------------------------------------


# The stage protocol: a stage gives factors (before the step) or a correction (after it);
# the chain scales, transports and lands. Two toy stages against Adam written in NumPy.
