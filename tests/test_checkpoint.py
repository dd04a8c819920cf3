"""Equivalent states: reparameterize on every optax layout, canonicalize, Orbax round trips.

Library calls run eagerly on tiny arrays; only optimizer updates are jitted.
"""

import functools
import hashlib
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import models
import saggs_jax as saggs

PAIRS = models.llama_pairs()
# A transform multiplies each element by a factor, so it keeps every element's
# relative precision: no absolute tolerance is needed...
EXACT = dict(rtol=1e-5, atol=0.0)
# ...but moments summed over several gradients lose it where the terms cancel.
CLOSE = dict(rtol=1e-5, atol=1e-7)


# ``fn(path_a, shape)``: log-uniform factors in [1/8, 8], a pure function of (seed, path).
factor_fn = functools.partial(models.random_factors, low=1 / 8, high=8.0)


def accumulator(tx):
  """``fn(params, grads)``: the state after updates with ``grads`` at fixed ``params``."""

  def accumulate(params, grads):
    state = tx.init(params)
    for g in grads:  # one compile per optimizer, however many calls
      state = models.jit_step(tx, params, state, g)[2]
    return state

  return accumulate


def params_of(config=models.CONFIG, seed=0):
  return models.llama_init(seed, config)


def _attn_or_mlp(tree):
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "adam" if "attn" in jax.tree_util.keystr(path) else "sgd", tree)


# Each SAGGS stage has every=3: after two updates it has not fired, so the
# state depends on the gradients alone and transport must commute with it.
LAYOUTS = {
    "chain": lambda: saggs.chain(optax.adamw(1e-2), saggs.saggs(PAIRS, every=3)),
    "partition": lambda: optax.partition(
        {"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-2, momentum=0.9)}, _attn_or_mlp),
    "masked": lambda: optax.masked(optax.adam(1e-2), lambda p: jax.tree.map(
        lambda label: label == "adam", _attn_or_mlp(p))),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
    "multisteps": lambda: optax.MultiSteps(
        saggs.chain(optax.lion(1e-3), saggs.soft(PAIRS, every=3)), every_k_schedule=2),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_reparameterize_transports_every_layout(layout):
  # Gradients move contravariantly (dL/d(cA) = dL/dA / c), so the state built from
  # the moved gradients at the moved parameters is the transported state.
  accumulate, params, f = accumulator(LAYOUTS[layout]()), params_of(), factor_fn(0)
  grads = [models.random_like(params, 1), models.random_like(params, 2)]
  state = accumulate(params, grads)
  moved_params, moved_state = saggs.reparameterize(params, state, PAIRS, f)
  moved_grads = [saggs.reparameterize(g, None, PAIRS, models.inverse(f))[0] for g in grads]
  chex.assert_trees_all_close(moved_state, accumulate(moved_params, moved_grads), **CLOSE)
  with pytest.raises(AssertionError):  # the moments did move
    chex.assert_trees_all_close(moved_state, state, **EXACT)


class NnxMLP(nnx.Module):
  """The up/down pair of an MLP; only its parameter and optimizer-state layout matter here.

  Its kernels have the shapes of the tiny model's MLP, so eager ops reuse the
  kernels already compiled for those shapes.
  """

  def __init__(self, rngs=None):
    rngs, d, hidden = rngs or nnx.Rngs(0), models.CONFIG.d_model, models.CONFIG.mlp_hidden
    self.up_proj = nnx.Linear(d, hidden, use_bias=False, rngs=rngs)
    self.down_proj = nnx.Linear(hidden, d, use_bias=False, rngs=rngs)


NNX_PAIRS = [saggs.Pair("up_proj/kernel", "down_proj/kernel", axes=(1, 0))]


def nnx_params(model):
  """A snapshot of the model's parameters (new Variables, so later updates do not leak in)."""
  return jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))


def test_reparameterize_nnx_optimizer_state():
  f = factor_fn(1)
  model = NnxMLP()
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
  params, grads = nnx_params(model), models.random_like(nnx_params(model), 3)
  optimizer.update(model, grads)
  moved_params, moved_state = saggs.reparameterize(params, optimizer.opt_state, NNX_PAIRS, f)

  moved_model = NnxMLP()
  nnx.update(moved_model, moved_params)
  moved_optimizer = nnx.Optimizer(moved_model, optax.adamw(1e-2), wrt=nnx.Param)
  moved_grads = saggs.reparameterize(grads, None, NNX_PAIRS, models.inverse(f))[0]
  moved_optimizer.update(moved_model, moved_grads)
  chex.assert_trees_all_close(moved_state, moved_optimizer.opt_state, **EXACT)


def test_nnx_state_of_optimizer_is_rejected_with_a_hint():
  model = NnxMLP()
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  with pytest.raises(TypeError, match="pass optimizer.opt_state"):
    saggs.reparameterize(nnx.state(model, nnx.Param), nnx.state(optimizer), NNX_PAIRS, 2.0)


@pytest.mark.parametrize("stacked", [False, True], ids=["layers", "stacked"])
def test_canonicalize_is_idempotent_and_orbit_invariant(stacked):
  config = models.STACKED if stacked else models.CONFIG
  pairs = models.llama_pairs(config)
  params = params_of(config)
  # Every float leaf (moments, SAGGS factors) drawn at random.
  state = models.random_like(saggs.chain(optax.adamw(1e-2), saggs.saggs(pairs)).init(params), 4)
  assert max(float(jnp.max(jnp.abs(x))) for x in saggs.imbalance(params, pairs).values()) > 0.1

  canon = saggs.canonicalize(params, state, pairs)
  for x in saggs.imbalance(canon[0], pairs).values():
    np.testing.assert_allclose(x, 0.0, atol=1e-5)
  chex.assert_trees_all_close(saggs.canonicalize(*canon, pairs), canon, **EXACT)
  for seed in (2, 3):
    moved = saggs.reparameterize(params, state, pairs, factor_fn(seed))
    chex.assert_trees_all_close(saggs.canonicalize(*moved, pairs), canon, **EXACT)


@settings(max_examples=25, deadline=None)
@given(stacked=st.integers(0, 1), groups=st.integers(1, 3), group_size=st.integers(1, 2),
       axes=st.tuples(st.integers(0, 1), st.integers(0, 1)),
       widths=st.tuples(st.integers(1, 2), st.integers(1, 2)), seed=st.integers(0, 2**16))
def test_orbit_properties_over_layouts(stacked, groups, group_size, axes, widths, seed):
  # A (per copy 2-D) is scaled along `axes[0]`, B along `axes[1]`, in `groups`
  # contiguous blocks; "c" is in no pair.
  rng = np.random.default_rng(seed)
  lead, n = (2,) * stacked, groups * group_size

  def shape(axis, width):
    return lead + ((n, width) if axis == 0 else (width, n))

  def normal(shape):
    return rng.normal(size=shape).astype(np.float32)

  params = {"a": normal(shape(axes[0], widths[0])), "b": normal(shape(axes[1], widths[1])),
            "c": normal((3,))}
  state = optax.ScaleByAdamState(np.int32(5), jax.tree.map(lambda x: normal(x.shape), params),
                                 jax.tree.map(lambda x: normal(x.shape) ** 2, params))
  pairs = [saggs.Pair("a", "b", axes=axes, groups=groups, stacked=stacked)]
  factor = np.exp(rng.uniform(-np.log(8), np.log(8), lead + (groups,))).astype(np.float32)
  moved_params, moved_state = saggs.reparameterize(params, state, pairs, lambda *_: factor)

  # Group g of A is the g-th contiguous block of its axis: check against numpy.
  per_index = np.repeat(factor, group_size, axis=-1)
  for name, sign in (("a", 1), ("b", -1)):
    axis = axes[0] if name == "a" else axes[1]
    mult = np.expand_dims(per_index, -1 if axis == 0 else -2) ** sign
    np.testing.assert_allclose(moved_params[name], params[name] * mult, rtol=1e-6)
  np.testing.assert_array_equal(moved_params["c"], params["c"])
  # p * mu and p**2 * nu are invariant along the orbit (degrees +1, -1, -2).
  for p, mu, nu, p2, mu2, nu2 in zip(*map(jax.tree.leaves, (
      params, state.mu, state.nu, moved_params, moved_state.mu, moved_state.nu))):
    np.testing.assert_allclose(p2 * mu2, p * mu, rtol=1e-5)
    np.testing.assert_allclose(p2**2 * nu2, p**2 * nu, rtol=1e-5)

  canon = saggs.canonicalize(params, state, pairs)
  chex.assert_trees_all_close(saggs.canonicalize(moved_params, moved_state, pairs), canon,
                              **EXACT)
  chex.assert_trees_all_close(saggs.canonicalize(*canon, pairs), canon, **EXACT)
  for x in saggs.imbalance(canon[0], pairs).values():
    np.testing.assert_allclose(x, 0.0, atol=1e-5)


# ---------------------------------------------------------------------------
# Orbax round trips


@pytest.fixture
def manager(tmp_path):
  mngr = ocp.CheckpointManager(tmp_path / "ckpt")
  yield mngr
  mngr.close()


def chain_state(pairs=PAIRS, params=None):
  """Params and a SAGGS chain state with random moments and factors."""
  params = params_of() if params is None else params
  tx = saggs.chain(optax.adamw(1e-2), saggs.saggs(pairs, every=1))
  return params, models.random_like(tx.init(params), 6)


def test_round_trip_into_an_equivalent_but_different_state(manager):
  params, state = chain_state()
  assert saggs.checkpoint.save(manager, 5, params, state)
  # The target only lends its structure: a reparameterized fresh state.
  target = saggs.reparameterize(params_of(seed=1), chain_state()[1], PAIRS, 3.0)

  got_params, got_state, step = saggs.checkpoint.restore(manager, *target, canonicalize=False)
  assert step == 5
  chex.assert_trees_all_equal((got_params, got_state), (params, state))
  assert isinstance(got_state[1], saggs.SaggsState)

  got = saggs.checkpoint.restore(manager, *target, pairs=PAIRS)[:2]
  chex.assert_trees_all_close(got, saggs.canonicalize(params, state, PAIRS), **EXACT)


def test_round_trip_nnx_model_and_optimizer(manager):
  def tx():
    return saggs.chain(optax.adamw(1e-2), saggs.saggs(NNX_PAIRS))

  model = NnxMLP()
  optimizer = nnx.Optimizer(model, tx(), wrt=nnx.Param)
  optimizer.update(model, models.random_like(nnx_params(model), 8))
  saggs.checkpoint.save(manager, 1, nnx.state(model, nnx.Param), optimizer.opt_state)

  other = NnxMLP(rngs=nnx.Rngs(1))
  snapshot = nnx_params(other)
  with pytest.raises(ValueError, match="at 'opt_state/0/count'"):  # AdamW alone: another chain
    plain = nnx.Optimizer(other, optax.adamw(1e-2), wrt=nnx.Param)
    saggs.checkpoint.restore(manager, nnx.state(other, nnx.Param), plain.opt_state)
  chex.assert_trees_all_equal(nnx_params(other), snapshot)

  other_optimizer = nnx.Optimizer(other, tx(), wrt=nnx.Param)
  params, opt_state, _ = saggs.checkpoint.restore(
      manager, nnx.state(other, nnx.Param), other_optimizer.opt_state, canonicalize=False)
  nnx.update(other, params)
  other_optimizer.opt_state = opt_state

  grads = models.random_like(nnx_params(model), 9)
  optimizer.update(model, grads)
  other_optimizer.update(other, grads)
  chex.assert_trees_all_equal(nnx_params(other), nnx_params(model))
  chex.assert_trees_all_equal(other_optimizer.opt_state, optimizer.opt_state)


def _fingerprint(directory):
  return {str(p): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
          for p in sorted(directory.rglob("*")) if p.is_file()}


MISMATCHES = {
    # checkpoint state, target state, the path the error must name
    "other pairs": (lambda: chain_state(),
                    lambda: chain_state(PAIRS[:1]),
                    "opt_state/1/factors/layers/0/attn/v_proj/kernel|layers/0/attn/o_proj/kernel"),
    "another chain": (lambda: (params_of(), optax.adamw(1e-2).init(params_of())),
                      lambda: chain_state(),
                      "opt_state/0/0/count"),
    "other shapes": (lambda: chain_state(),
                     lambda: chain_state(params=params_of(models.Config(mlp_hidden=8))),
                     "opt_state/0/0/mu/layers/0/mlp/down_proj/kernel"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_mismatched_checkpoint_fails_and_touches_nothing(manager, tmp_path, case):
  saved, target, path = (fn() if callable(fn) else fn for fn in MISMATCHES[case])
  saggs.checkpoint.save(manager, 3, *saved)
  manager.wait_until_finished()
  files = _fingerprint(tmp_path)
  snapshot = jax.tree.map(np.array, target)

  with pytest.raises(ValueError, match=f"at '{re.escape(path)}'.*other pairs or another"):
    saggs.checkpoint.restore(manager, *target, pairs=PAIRS)
  assert _fingerprint(tmp_path) == files
  chex.assert_trees_all_equal(target, snapshot)
  # The checkpoint is intact: it restores into a target of its own layout.
  chex.assert_trees_all_equal(
      saggs.checkpoint.restore(manager, *saved, canonicalize=False)[:2], saved)


def test_restore_without_checkpoint_fails(manager):
  with pytest.raises(FileNotFoundError, match="No checkpoint"):
    saggs.checkpoint.restore(manager, *chain_state())
