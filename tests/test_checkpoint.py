"""Equivalent states: reparameterize on every optax layout, canonicalize, Orbax round trips.

Library calls run eagerly on tiny arrays; only optimizer updates are jitted.
"""

import collections
import functools
import hashlib
import json
import re
import shutil

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import equinox_mlp
import models
import saggs_jax as saggs
from saggs_jax._src.checkpoint import LAYOUT_MSG
from saggs_jax._src.checksums import ANOTHER_STEP

PAIRS = models.llama_pairs()
# A transform multiplies each element by a factor, so it keeps every element's
# relative precision: no absolute tolerance is needed...
EXACT = dict(rtol=1e-5, atol=0.0)
# ...but moments summed over several gradients lose it where the terms cancel.
CLOSE = dict(rtol=1e-5, atol=1e-7)


# canonicalize as one program per layout (the pairs static), shared by every call on that
# layout: on the LLaMA layouts, cheaper than compiling its eager primitives. The
# property test's 25 small layouts stay eager (one program each would cost more).
_canonicalize = jax.jit(lambda p, s, pairs: saggs.canonicalize(p, s, pairs), static_argnums=2)


def canonicalize(params, opt_state, pairs):
  return _canonicalize(params, opt_state, tuple(pairs))


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


# ---------------------------------------------------------------------------
# A transport oracle written without the library: which leaf of the tiny
# LLaMA moves along which axis, in which direction, with which factors.


def _name(entry):
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def llama_moves(c=models.CONFIG):
  """``{path suffix: (A path, group axis, sign)}`` for every leaf the LLaMA pairs move."""
  moves = {}
  for i in range(c.num_layers):
    q, v = f"layers/{i}/attn/q_proj/kernel", f"layers/{i}/attn/v_proj/kernel"
    up = f"layers/{i}/mlp/up_proj/kernel"
    moves.update(
      {
        q: (q, 1, +1),
        f"layers/{i}/attn/k_proj/kernel": (q, 1, -1),
        v: (v, 1, +1),
        f"layers/{i}/attn/o_proj/kernel": (v, 0, -1),
        up: (up, 1, +1),
        f"layers/{i}/mlp/down_proj/kernel": (up, 0, -1),
      }
    )
  return moves


MLP_MOVES = {
  "up_proj/kernel": ("up_proj/kernel", 1, +1),
  "down_proj/kernel": ("up_proj/kernel", 0, -1),
}


def numpy_move(tree, moves, factors, degree):
  """Multiplies index j of a moved leaf's group axis by ``f[j // block] ** (sign * degree)``.

  ``factors[A path]`` holds one factor per group; groups are contiguous
  blocks. Leaves are matched by path suffix, so a moment nested anywhere in an
  optimizer state moves like its parameter. ``degree`` is the transport
  degree, or ``fn(path) -> degree``. float64 NumPy throughout.
  """

  def visit(key_path, x):
    names = [_name(k) for k in key_path]
    path = "/".join(names[:-1] if names[-1:] == ["value"] else names)  # nnx Variable boxes
    d = degree(path) if callable(degree) else degree
    for suffix, (a_path, axis, sign) in moves.items():
      if ("/" + path).endswith("/" + suffix) and d:
        f = np.asarray(factors[a_path], np.float64)
        per_index = np.repeat(f, x.shape[axis] // f.size) ** (sign * d)
        shape = [1] * x.ndim
        shape[axis] = -1
        return jnp.asarray(np.asarray(x, np.float64) * per_index.reshape(shape), x.dtype)
    return x

  return jax.tree_util.tree_map_with_path(visit, tree)


def draw_factors(moves, params, seed):
  """Log-uniform factors in [1/8, 8] per A path: one per KV head in attention, else per channel."""
  rng, leaves = np.random.default_rng(seed), models.leaf_dict(params)

  def groups(a_path, axis):
    return models.CONFIG.num_kv_heads if "/attn/" in a_path else leaves[a_path].shape[axis]

  return {
    a: np.exp(rng.uniform(-np.log(8), np.log(8), groups(a, axis))).astype(np.float32)
    for a, axis, _ in sorted(set(moves.values()))
  }


def _attn_or_mlp(tree):
  return jax.tree_util.tree_map_with_path(
    lambda path, _: "adam" if "attn" in jax.tree_util.keystr(path) else "sgd", tree
  )


LAYOUTS = {
  "partition": lambda: optax.partition(
    {"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-2, momentum=0.9)}, _attn_or_mlp
  ),
  "masked": lambda: optax.masked(
    optax.adam(1e-2), lambda p: jax.tree.map(lambda label: label == "adam", _attn_or_mlp(p))
  ),
  "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
  "multisteps": lambda: optax.MultiSteps(optax.lion(1e-3), every_k_schedule=2),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_reparameterize_transports_every_layout(layout):
  # Gradients move contravariantly (dL/d(cA) = dL/dA / c), so the state built from
  # the moved gradients at the moved parameters is the transported state.
  accumulate, params, moves = accumulator(LAYOUTS[layout]()), params_of(), llama_moves()
  factors = draw_factors(moves, params, 0)
  grads = [models.random_like(params, 1), models.random_like(params, 2)]
  state = accumulate(params, grads)
  moved_params, moved_state = saggs.reparameterize(params, state, PAIRS, lambda a, _: factors[a])
  chex.assert_trees_all_close(moved_params, numpy_move(params, moves, factors, 1), **EXACT)
  moved_grads = [numpy_move(g, moves, factors, -1) for g in grads]
  chex.assert_trees_all_close(moved_state, accumulate(moved_params, moved_grads), **CLOSE)
  with pytest.raises(AssertionError, match="Values not approximately equal"):
    chex.assert_trees_all_close(moved_state, state, **EXACT)  # the moments did move


# The moment fields of the SAGGS chains below and their gradient degrees.
DEGREES = {"mu": -1, "nu": -2, "acc_grads": -1}
SAGGS_CHAINS = {
  "adamw": lambda: saggs.chain(optax.adamw(1e-2), saggs.saggs(PAIRS)),
  "multisteps lion": lambda: optax.MultiSteps(
    saggs.chain(optax.lion(1e-3), saggs.soft(PAIRS)), every_k_schedule=2
  ),
}


@pytest.mark.parametrize("name", sorted(SAGGS_CHAINS))
def test_reparameterize_transports_saggs_chains(name):
  # A SAGGS stage balances on its first update, which makes the state after it
  # orbit-invariant: check a random state against the oracle field by field.
  params, moves = params_of(), llama_moves()
  factors = draw_factors(moves, params, 5)
  state = models.random_like(SAGGS_CHAINS[name]().init(params), 7)
  moved = saggs.reparameterize(params, state, PAIRS, lambda a, _: factors[a])[1]

  def degree(path):  # the innermost moment field on the path
    fields = [n for n in path.split("/") if n in DEGREES]
    return DEGREES[fields[-1]] if fields else 0

  chex.assert_trees_all_close(moved, numpy_move(state, moves, factors, degree), **EXACT)
  with pytest.raises(AssertionError, match="Values not approximately equal"):
    chex.assert_trees_all_close(moved, state, **EXACT)  # the moments did move


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
  model = NnxMLP()
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
  params, grads = nnx_params(model), models.random_like(nnx_params(model), 3)
  factors = draw_factors(MLP_MOVES, params, 1)
  optimizer.update(model, grads)
  moved_params, moved_state = saggs.reparameterize(
    params, optimizer.opt_state, NNX_PAIRS, lambda a, _: factors[a]
  )
  chex.assert_trees_all_close(moved_params, numpy_move(params, MLP_MOVES, factors, 1), **EXACT)

  moved_model = NnxMLP()
  nnx.update(moved_model, moved_params)
  moved_optimizer = nnx.Optimizer(moved_model, optax.adamw(1e-2), wrt=nnx.Param)
  moved_optimizer.update(moved_model, numpy_move(grads, MLP_MOVES, factors, -1))
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

  canon = canonicalize(params, state, pairs)
  for x in saggs.imbalance(canon[0], pairs).values():
    np.testing.assert_allclose(x, 0.0, atol=1e-5)
  chex.assert_trees_all_close(canonicalize(*canon, pairs), canon, **EXACT)
  for seed in (2, 3):
    moved = saggs.reparameterize(params, state, pairs, factor_fn(seed))
    chex.assert_trees_all_close(canonicalize(*moved, pairs), canon, **EXACT)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
  stacked=st.integers(0, 1),
  groups=st.integers(1, 3),
  group_size=st.integers(1, 2),
  axes=st.tuples(st.integers(0, 1), st.integers(0, 1)),
  widths=st.tuples(st.integers(1, 2), st.integers(1, 2)),
  seed=st.integers(0, 2**16),
)
def test_orbit_properties_over_layouts(stacked, groups, group_size, axes, widths, seed):
  # A (per copy 2-D) is scaled along `axes[0]`, B along `axes[1]`, in `groups`
  # contiguous blocks; "c" is in no pair.
  rng = np.random.default_rng(seed)
  lead, n = (2,) * stacked, groups * group_size

  def shape(axis, width):
    return lead + ((n, width) if axis == 0 else (width, n))

  def normal(shape):
    return rng.normal(size=shape).astype(np.float32)

  params = {
    "a": normal(shape(axes[0], widths[0])),
    "b": normal(shape(axes[1], widths[1])),
    "c": normal((3,)),
  }
  state = optax.ScaleByAdamState(
    np.int32(5),
    jax.tree.map(lambda x: normal(x.shape), params),
    jax.tree.map(lambda x: normal(x.shape) ** 2, params),
  )
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
  for p, mu, nu, p2, mu2, nu2 in zip(
    *map(
      jax.tree.leaves, (params, state.mu, state.nu, moved_params, moved_state.mu, moved_state.nu)
    )
  ):
    np.testing.assert_allclose(p2 * mu2, p * mu, rtol=1e-5)
    np.testing.assert_allclose(p2**2 * nu2, p**2 * nu, rtol=1e-5)

  canon = saggs.canonicalize(params, state, pairs)
  chex.assert_trees_all_close(saggs.canonicalize(moved_params, moved_state, pairs), canon, **EXACT)
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


def chain_tx(pairs=PAIRS):
  return saggs.chain(optax.adamw(1e-2), saggs.saggs(pairs, every=1))


def chain_state(pairs=PAIRS, params=None):
  """Params and a SAGGS chain state with random moments and factors."""
  params = params_of() if params is None else params
  return params, models.random_like(chain_tx(pairs).init(params), 6)


def test_round_trip_into_an_equivalent_but_different_state(manager):
  params, state = chain_state()
  assert saggs.checkpoint.save(manager, 5, params, state)
  # The target only lends its structure: a reparameterized fresh state.
  target = saggs.reparameterize(params_of(seed=1), chain_state()[1], PAIRS, 3.0)

  got_params, got_state, step = saggs.checkpoint.restore(manager, *target, canonicalize=False)
  assert step == 5
  chex.assert_trees_all_equal((got_params, got_state), (params, state))
  assert isinstance(got_state[1], saggs.SaggsState)

  got = saggs.checkpoint.restore(manager, *target, pairs=PAIRS, tx=chain_tx())[:2]
  chex.assert_trees_all_close(got, canonicalize(params, state, PAIRS), **EXACT)


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
    manager, nnx.state(other, nnx.Param), other_optimizer.opt_state, canonicalize=False
  )
  nnx.update(other, params)
  other_optimizer.opt_state = opt_state

  grads = models.random_like(nnx_params(model), 9)
  optimizer.update(model, grads)
  other_optimizer.update(other, grads)
  chex.assert_trees_all_equal(nnx_params(other), nnx_params(model))
  chex.assert_trees_all_equal(other_optimizer.opt_state, optimizer.opt_state)


def _field_degree(path):
  """The gradient degree of the innermost moment field on ``path`` (0 outside them)."""
  fields = [n for n in path.split("/") if n in DEGREES]
  return DEGREES[fields[-1]] if fields else 0


def test_restore_canonicalises_the_optax_state_inside_a_whole_train_state(manager):
  """A train state holding more than the optax state (an RNG key, a step, EMA weights): the
  subtree with tx.init's layout is canonicalised, the rest comes back bit-exact. Two
  equivalent checkpoints, the second moved in NumPy (parameters by c, mu by 1/c, nu by
  1/c**2), restore to one state."""
  params, state = chain_state()
  moves = llama_moves()
  factors = draw_factors(moves, params, 11)
  extra = {"rng": jax.random.key(3), "step": jnp.int32(7), "ema": models.random_like(params, 12)}
  saggs.checkpoint.save(manager, 1, params, {"opt": state, **extra})
  moved = numpy_move(params, moves, factors, 1), numpy_move(state, moves, factors, _field_degree)
  saggs.checkpoint.save(manager, 2, moved[0], {"opt": moved[1], **extra})
  target = (
    params_of(seed=1),
    {
      "opt": chain_state()[1],
      "rng": jax.random.key(0),
      "step": jnp.int32(0),
      "ema": params_of(seed=2),
    },
  )
  one, two = (
    saggs.checkpoint.restore(manager, *target, PAIRS, step=step, tx=chain_tx())[:2]
    for step in (1, 2)
  )
  chex.assert_trees_all_close((one[0], one[1]["opt"]), (two[0], two[1]["opt"]), **CLOSE)
  chex.assert_trees_all_close((one[0], one[1]["opt"]), canonicalize(params, state, PAIRS), **EXACT)
  for got in (one[1], two[1]):
    assert np.array_equal(jax.random.key_data(got["rng"]), jax.random.key_data(extra["rng"]))
    chex.assert_trees_all_equal((got["step"], got["ema"]), (extra["step"], extra["ema"]))
  saggs.checkpoint.save(manager, 3, params, {"a": state, "b": state})
  with pytest.raises(ValueError, match="2 subtrees of opt_state have the layout"):
    saggs.checkpoint.restore(manager, params, {"a": state, "b": state}, PAIRS, tx=chain_tx())


def numpy_canonical_mlp(params, flat):
  """The canonical point of the up/down pair, by hand in float64 NumPy: per channel j,
  ``c_j = sqrt(|down_j| / |up_j|)`` from ``params``; up's column j times c_j, down's row j
  over it; their ``mu`` by ``c**-1`` and ``nu`` by ``c**-2`` on the same sides. ``flat``
  maps the library's paths to arrays; returns the moved ``{path: array}`` of its up/down
  leaves."""
  up, down = (np.asarray(params[k]["kernel"], np.float64) for k in ("up_proj", "down_proj"))
  c = np.sqrt(np.linalg.norm(down, axis=1) / np.linalg.norm(up, axis=0))
  out = {}
  for path, x in flat.items():
    d = {"mu": -1, "nu": -2}.get(next((n for n in path.split("/") if n in ("mu", "nu")), ""), 1)
    if ("/" + path).endswith("/up_proj/kernel"):
      out[path] = np.asarray(x, np.float64) * c[None, :] ** d
    elif ("/" + path).endswith("/down_proj/kernel"):
      out[path] = np.asarray(x, np.float64) * c[:, None] ** -d
  return out


def assert_canonical_mlp(params, saved, restored):
  """``restored`` (a tree like ``saved``) is ``saved`` at the NumPy canonical point."""
  got = models.leaf_dict(restored)
  for path, want in numpy_canonical_mlp(params, models.leaf_dict(saved)).items():
    np.testing.assert_allclose(np.asarray(got[path]), want, rtol=1e-5, err_msg=path)


def nnx_chain():
  return saggs.chain(optax.adamw(1e-2), saggs.saggs(NNX_PAIRS, every=1))


def test_restore_canonicalises_nnx_state_of_an_optimizer(manager):
  """``nnx.state(optimizer)`` keeps the optax state as mappings (tuples as int keys, no empty
  states), in another leaf order: its arrays are matched to tx.init's by path. Two
  equivalent checkpoints restore to one state, the NumPy canonical point; the optimizer's
  own step comes back as saved, and nnx.update puts the state back into an Optimizer."""
  model = NnxMLP()
  optimizer = nnx.Optimizer(model, nnx_chain(), wrt=nnx.Param)
  for seed in (8, 9):
    optimizer.update(model, models.random_like(nnx_params(model), seed))
  params, state = nnx_params(model), jax.tree.map(jnp.copy, nnx.state(optimizer))
  factors = draw_factors(MLP_MOVES, params, 3)
  saggs.checkpoint.save(manager, 1, params, state, tx=nnx_chain())  # its degrees recorded
  moved = (
    numpy_move(params, MLP_MOVES, factors, 1),
    numpy_move(state, MLP_MOVES, factors, _field_degree),
  )
  saggs.checkpoint.save(manager, 2, *moved)

  other = NnxMLP(rngs=nnx.Rngs(1))
  other_optimizer = nnx.Optimizer(other, nnx_chain(), wrt=nnx.Param)
  target = nnx.state(other, nnx.Param), nnx.state(other_optimizer)
  one, two = (
    saggs.checkpoint.restore(manager, *target, NNX_PAIRS, step=step, tx=nnx_chain())[:2]
    for step in (1, 2)
  )
  assert jax.tree.structure(one[1]) == jax.tree.structure(target[1])
  chex.assert_trees_all_close(one, two, **CLOSE)
  assert_canonical_mlp(nnx.to_pure_dict(params), (params, state), one)
  assert int(jax.tree.leaves(one[1]["step"])[0]) == int(jax.tree.leaves(state["step"])[0]) == 2

  nnx.update(other, one[0])
  nnx.update(other_optimizer, one[1])
  assert isinstance(other_optimizer.opt_state[0][0], optax.ScaleByAdamState)
  other_optimizer.update(other, models.random_like(nnx_params(other), 10))
  assert int(jax.tree.leaves(other_optimizer.step)[0]) == 3
  with pytest.raises(TypeError, match="only tx can tell their degrees"):
    saggs.checkpoint.restore(manager, *target, NNX_PAIRS)


def test_restore_canonicalises_a_linen_train_state(manager):
  """A Linen TrainState saved and restored without its params field (they are the params
  argument): two equivalent checkpoints restore to the NumPy canonical point, the step as
  saved; a TrainState still holding the params is refused before anything is read."""
  from flax.training import train_state

  apply = jax.jit(lambda s, g: s.apply_gradients(grads=g))
  tx = nnx_chain()
  params = nnx.to_pure_dict(nnx_params(NnxMLP()))
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
  for seed in (8, 9):
    state = apply(state, models.random_like(params, seed))
  factors = draw_factors(MLP_MOVES, state.params, 4)
  saggs.checkpoint.save(manager, 1, state.params, state.replace(params=None))
  moved = state.replace(
    params=None, opt_state=numpy_move(state.opt_state, MLP_MOVES, factors, _field_degree)
  )
  saggs.checkpoint.save(manager, 2, numpy_move(state.params, MLP_MOVES, factors, 1), moved)

  fresh = train_state.TrainState.create(
    apply_fn=None, params=jax.tree.map(jnp.zeros_like, params), tx=tx
  ).replace(step=jnp.int32(0))  # as the saved one, an array: create's Python 0 is static
  with pytest.raises(ValueError, match="holds params themselves .*state.replace"):
    saggs.checkpoint.restore(manager, fresh.params, fresh, NNX_PAIRS, tx=fresh.tx)
  one, two = (
    saggs.checkpoint.restore(
      manager, fresh.params, fresh.replace(params=None), NNX_PAIRS, step=step, tx=fresh.tx
    )[:2]
    for step in (1, 2)
  )
  chex.assert_trees_all_close(one, two, **CLOSE)
  saved = state.params, state.opt_state
  assert_canonical_mlp(state.params, saved, (one[0], one[1].opt_state))
  assert int(one[1].step) == int(state.step) == 2
  state = one[1].replace(params=one[0])
  assert np.isfinite(apply(state, models.random_like(params, 10)).params["up_proj"]["kernel"]).all()


def test_a_restart_restored_without_pairs_is_the_uninterrupted_run(manager):
  """Resuming is restoring as saved: the run continues bit for bit. Canonicalising on
  restore (pairs given) is for equivalent checkpoints, and moves this one off its run."""
  tx = saggs.chain(optax.adamw(1e-2), saggs.saggs(PAIRS, every=3))
  grads = [models.random_like(params_of(), 100 + i, scale=0.1) for i in range(8)]

  def run(params, state, steps):
    for i in steps:
      params, _, state = models.jit_step(tx, params, state, grads[i])
    return params, state

  params, state = run(params_of(), tx.init(params_of()), range(4))
  saggs.checkpoint.save(manager, 4, params, state)
  uninterrupted = run(params, state, range(4, 8))
  target = params_of(seed=1), tx.init(params_of(seed=1))
  restored = saggs.checkpoint.restore(manager, *target)[:2]
  chex.assert_trees_all_equal(run(*restored, range(4, 8)), uninterrupted)
  canonical = saggs.checkpoint.restore(manager, *target, PAIRS, tx=tx)[:2]
  with pytest.raises(AssertionError, match="Values not exactly equal"):
    chex.assert_trees_all_equal(run(*canonical, range(4, 8))[0], uninterrupted[0])


def _fingerprint(directory):
  return {
    str(p): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    for p in sorted(directory.rglob("*"))
    if p.is_file()
  }


def _adam_state(tx):
  return params_of(), tx.init(params_of())


def _bf16(tree):
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)


MISMATCHES = {
  # checkpoint state, target state, where they differ: path, checkpoint entry, target entry
  "other pairs": (
    chain_state,
    lambda: chain_state(PAIRS[:1]),
    (
      "opt_state/1/factors/layers/0/attn/v_proj/kernel|layers/0/attn/o_proj/kernel",
      "float32[2]",
      "nothing",
    ),
  ),
  "another chain": (
    lambda: _adam_state(optax.adamw(1e-2)),
    chain_state,
    ("opt_state/0/0/count", "nothing", "int32[]"),
  ),
  "other shapes": (
    chain_state,
    lambda: chain_state(params=params_of(models.Config(mlp_hidden=8))),
    ("opt_state/0/0/mu/layers/0/mlp/down_proj/kernel", "float32[24, 16]", "float32[8, 16]"),
  ),
  "other dtypes": (
    lambda: (_bf16(params_of()), chain_state()[1]),
    chain_state,
    ("params/embed/embedding", "bfloat16[16, 16]", "float32[16, 16]"),
  ),
  # Same leaves, different empty states: only the layout's empty nodes tell them apart.
  "adam into adamw": (
    lambda: _adam_state(optax.adam(1e-2)),
    lambda: _adam_state(optax.adamw(1e-2)),
    ("opt_state/2", "nothing", "EmptyState()"),
  ),
  "adamw into adam": (
    lambda: _adam_state(optax.adamw(1e-2)),
    lambda: _adam_state(optax.adam(1e-2)),
    ("opt_state/2", "EmptyState()", "nothing"),
  ),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_mismatched_checkpoint_fails_and_touches_nothing(manager, tmp_path, case):
  saved_fn, target_fn, (path, there, want) = MISMATCHES[case]
  saved, target = saved_fn(), target_fn()
  saggs.checkpoint.save(manager, 3, *saved)
  manager.wait_until_finished()
  files = _fingerprint(tmp_path)
  snapshot = jax.tree.map(np.array, target)

  message = LAYOUT_MSG.format(what="", path=path, there=there, want=want)
  with pytest.raises(ValueError, match=re.escape(message)):
    saggs.checkpoint.restore(manager, *target, pairs=PAIRS)
  assert _fingerprint(tmp_path) == files
  chex.assert_trees_all_equal(target, snapshot)
  # The checkpoint is intact: it restores into a target of its own layout.
  chex.assert_trees_all_equal(
    saggs.checkpoint.restore(manager, *saved, canonicalize=False)[:2], saved
  )


def test_restore_without_checkpoint_fails(manager):
  with pytest.raises(FileNotFoundError, match="No checkpoint in .*: it holds none"):
    saggs.checkpoint.restore(manager, *chain_state())


def _times(tree, k):
  return jax.tree.map(lambda x: jnp.asarray(np.asarray(x) * k), tree)


def test_restore_reads_the_requested_step(manager):
  params = params_of()
  for step in (1, 2, 3):
    saggs.checkpoint.save(manager, step, _times(params, step), None)
  for step in (2, 1, 3):
    got, _, got_step = saggs.checkpoint.restore(manager, params, None, step=step)
    assert got_step == step
    chex.assert_trees_all_equal(got, _times(params, step))
  got, _, got_step = saggs.checkpoint.restore(manager, params, None)
  assert got_step == 3
  chex.assert_trees_all_equal(got, _times(params, 3))
  with pytest.raises(FileNotFoundError, match=r"No checkpoint 4 in .*: it holds steps \[1, 2, 3\]"):
    saggs.checkpoint.restore(manager, params, None, step=4)


@pytest.mark.parametrize("step", ["5", 5.0, True, None])
def test_a_step_that_is_not_an_int_is_refused(manager, step):
  params = params_of()
  saggs.checkpoint.save(manager, 5, params, None)
  message = re.escape(f"step must be an int, got {step!r} of type {type(step).__name__}.")
  if step is not None:
    with pytest.raises(TypeError, match=message):
      saggs.checkpoint.restore(manager, params, None, step=step)
  with pytest.raises(TypeError, match=message):
    saggs.checkpoint.save(manager, step, params, None)
  assert manager.all_steps() == [5]
  assert saggs.checkpoint.restore(manager, params, None, step=np.int64(5))[2] == 5


def test_a_checkpoint_not_written_by_save_is_named(manager, tmp_path):
  """A plain Orbax checkpoint, and one whose checksums were removed."""
  params = params_of()
  saggs.checkpoint.save(manager, 2, params, None)
  manager.wait_until_finished()
  shutil.rmtree(tmp_path / "ckpt" / "2" / "checksums")
  with ocp.CheckpointManager(tmp_path / "plain") as plain:
    plain.save(1, args=ocp.args.StandardSave({"params": params, "opt_state": None}))
    plain.wait_until_finished()
    for step, mngr in ((1, plain), (2, manager)):
      with pytest.raises(
        ValueError,
        match=re.escape(f"Checkpoint {step} in ")
        + ".*"
        + re.escape(
          " was not written by saggs_jax.checkpoint.save: it has no readable 'layout' and"
          " 'checksums' items"
        ),
      ):
        saggs.checkpoint.restore(mngr, params, None, step=step)


def test_static_leaves_are_taken_from_the_target(manager):
  """Leaves that are not arrays (a Python float, an Equinox module's function, flags and
  ints) are recorded as static in the layout, not saved, and restored from the target."""
  saved = {"model": equinox_mlp.imbalanced(seed=0, inference=True), "rate": 0.1}
  pairs = [saggs.Pair("model/up/weight", "model/down/weight", axes=(0, 1))]
  tx = saggs.chain(optax.adam(1e-2), saggs.saggs(pairs, every=2))
  state = models.random_like(tx.init(eqx.filter(saved, eqx.is_inexact_array)), 1)
  layout = saggs.checkpoint.layout({"params": saved, "opt_state": state})
  assert {p: v for p, v in layout.items() if p.startswith("params/")} == {
    "params/model/up/weight": "float32[4, 3]",
    "params/model/up/bias": "None",
    "params/model/down/weight": "float32[2, 4]",
    "params/model/down/bias": "float32[2]",
    "params/model/dropout/p": "static",
    "params/model/dropout/inference": "static",
    "params/model/activation": "static",
    "params/model/hidden": "static",
    "params/rate": "static",
  }
  saggs.checkpoint.save(manager, 1, saved, state)

  target = {"model": equinox_mlp.MLP(seed=1, inference=False), "rate": 0.5}
  got, got_state, _ = saggs.checkpoint.restore(manager, target, state, canonicalize=False)
  assert got["rate"] == 0.5 and not got["model"].dropout.inference
  assert type(got["model"]) is equinox_mlp.MLP and got["model"].activation is jax.nn.relu
  chex.assert_trees_all_equal(
    eqx.filter((got, got_state), eqx.is_array), eqx.filter((saved, state), eqx.is_array)
  )
  # With pairs: the canonical form of the saved arrays, the target's static leaves.
  got, got_state, _ = saggs.checkpoint.restore(manager, target, state, pairs, tx=tx)
  expected = saggs.canonicalize(saved, state, pairs)
  chex.assert_trees_all_close(
    eqx.filter((got, got_state), eqx.is_array), eqx.filter(expected, eqx.is_array), **EXACT
  )
  assert got["rate"] == 0.5 and not got["model"].dropout.inference
  # An array where the target holds a static leaf is another layout.
  with pytest.raises(
    ValueError, match=re.escape("at 'params/rate': static there, the target float32[]")
  ):
    saggs.checkpoint.restore(manager, {**target, "rate": jnp.float32(0.5)}, state)


def _is_key(x):
  return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _bits(tree):
  """NumPy copies of every leaf, typed PRNG keys as their key data: comparable bit for bit."""
  return jax.tree.map(lambda x: np.array(jax.random.key_data(x) if _is_key(x) else x), tree)


KEYS = {
  "fry": jax.random.key(7),
  "split": jax.random.split(jax.random.key(1), 3),
  "rbg": jax.random.key(2, impl="rbg"),
}


def test_typed_prng_keys_round_trip(manager):
  params = params_of()
  saggs.checkpoint.save(manager, 1, params, KEYS)
  target = {
    "fry": jax.random.key(0),
    "split": jax.random.split(jax.random.key(0), 3),
    "rbg": jax.random.key(0, impl="rbg"),
  }
  got = saggs.checkpoint.restore(manager, params, target, canonicalize=False)[1]
  for name, key in KEYS.items():
    assert got[name].dtype == key.dtype, name
  chex.assert_trees_all_equal(_bits(got), _bits(KEYS))
  np.testing.assert_array_equal(jax.random.bits(got["rbg"]), jax.random.bits(KEYS["rbg"]))
  # Another implementation's key is another layout.
  with pytest.raises(
    ValueError, match=re.escape("at 'opt_state/rbg': key<rbg>[] there, the target key<fry>[]")
  ):
    saggs.checkpoint.restore(manager, params, {**target, "rbg": jax.random.key(0)})


def corruptible_state():
  """Random arrays over 1 KiB compressed, which Orbax stores outside its B-tree
  nodes (smaller ones are inlined there, under the nodes' own CRC), a typed key
  array among them."""
  rng = np.random.default_rng(11)
  params = {
    "w": jnp.asarray(rng.standard_normal((24, 32)), jnp.float32),
    "emb": jnp.asarray(rng.standard_normal((40, 32)), jnp.bfloat16),
  }
  mu = models.random_like(params, 12)
  nu = models.random_like(params, 13, positive=True)
  keys = jax.random.split(jax.random.key(5), 256)
  return params, (optax.ScaleByAdamState(jnp.int32(3), mu, nu), {"keys": keys})


def _contents(directory):
  return {
    str(p): hashlib.sha256(p.read_bytes()).hexdigest()
    for p in sorted(directory.rglob("*"))
    if p.is_file()
  }


def _flip(path, pos):
  data = bytearray(path.read_bytes())
  data[pos] ^= 0x20
  path.write_bytes(bytes(data))


# Orbax leaves a failed restore's other reads pending when it closes its event loop: they
# raise "Event loop is closed" later, in TensorStore's threads (ignored in pyproject.toml).
def test_corrupted_data_files_never_restore_silently(manager, tmp_path):
  saved = corruptible_state()
  saggs.checkpoint.save(manager, 1, *saved)
  manager.wait_until_finished()
  files = _contents(tmp_path)
  data_files = sorted(p for p in (tmp_path / "ckpt").rglob("*") if p.parent.name == "d")
  assert data_files, sorted(files)
  target = (_times(saved[0], 2), jax.tree.map(jnp.zeros_like, saved[1]))
  target = (target[0], target[1][:1] + ({"keys": jax.random.split(jax.random.key(0), 256)},))
  snapshot = _bits(target)

  named = collections.Counter()
  for path in data_files:
    for pos in range(0, path.stat().st_size, 97):  # about 10 flips per KiB
      _flip(path, pos)
      try:
        got = saggs.checkpoint.restore(manager, *target, canonicalize=False)[:2]
      except ValueError as e:
        corrupted = re.search(r"the array at '([^']+)' does not match the checksum", str(e))
        assert corrupted or "could not be read" in str(e), str(e)
        named[corrupted[1] if corrupted else "(unreadable)"] += 1
      else:  # only bytes that restore does not read: the saved state, bit for bit
        chex.assert_trees_all_equal(_bits(got), _bits(saved))
      finally:
        _flip(path, pos)
      chex.assert_trees_all_equal(_bits(target), snapshot)
  assert _contents(tmp_path) == files  # a failed restore writes nothing
  # Every flip undone, the checkpoint restores bit for bit.
  chex.assert_trees_all_equal(
    _bits(saggs.checkpoint.restore(manager, *target, canonicalize=False)[:2]), _bits(saved)
  )
  # Flips hit every array stored outside the B-tree nodes (all but the inlined
  # count), and each is named by its checksum.
  arrays = {
    p for p, _ in saggs._src.paths.leaves_with_paths({"params": saved[0], "opt_state": saved[1]})
  }
  assert set(named) - {"(unreadable)"} == arrays - {"opt_state/0/count"}, named


def test_a_checksum_entry_deleted_is_an_error_naming_the_array(manager, tmp_path):
  """An array the checksums file does not list would be restored unverified."""
  saved = corruptible_state()
  saggs.checkpoint.save(manager, 1, *saved)
  manager.wait_until_finished()
  record = tmp_path / "ckpt" / "1" / "checksums" / "metadata"
  sums = json.loads(record.read_text())
  del sums["params/w"]
  record.write_text(json.dumps(sums))
  files = _contents(tmp_path)
  with pytest.raises(
    ValueError,
    match=re.escape("has no checksum for the array at 'params/w'")
    + ".*"
    + re.escape(ANOTHER_STEP.strip()),
  ):
    saggs.checkpoint.restore(manager, *saved, canonicalize=False)
  assert _contents(tmp_path) == files


def test_saving_an_existing_step_overwrites_nothing(manager, tmp_path):
  params = params_of()
  assert saggs.checkpoint.save(manager, 4, params, None)
  manager.wait_until_finished()
  files = _fingerprint(tmp_path)
  assert not saggs.checkpoint.save(manager, 4, _times(params, 2), None)
  manager.wait_until_finished()
  assert _fingerprint(tmp_path) == files
  chex.assert_trees_all_equal(saggs.checkpoint.restore(manager, params, None)[0], params)


def _abstract_llama_state(layers=32, d=4096, hidden=11008, vocab=32000):
  """The parameters, Adam moments and count of a LLaMA-7B-sized model (at 32 layers,
  stacked: scanned layers), as ShapeDtypeStructs."""
  f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
  params = {
    "embed": {"embedding": f32((vocab, d))},
    "layers": {
      "attn": {
        n: {"kernel": f32((layers, d, d))} for n in ("q_proj", "k_proj", "v_proj", "o_proj")
      },
      "mlp": {
        "gate_proj": {"kernel": f32((layers, d, hidden))},
        "up_proj": {"kernel": f32((layers, d, hidden))},
        "down_proj": {"kernel": f32((layers, hidden, d))},
      },
      "attn_norm": {"scale": f32((layers, d))},
      "mlp_norm": {"scale": f32((layers, d))},
    },
    "final_norm": {"scale": f32((d,))},
    "lm_head": {"kernel": f32((d, vocab))},
  }
  count = jax.ShapeDtypeStruct((), jnp.int32)
  return params, optax.ScaleByAdamState(count, params, params)


# ---------------------------------------------------------------------------
# Restoring by the degrees of the optimizer that made the state

UP_DOWN = [saggs.Pair("up", "down", axes=(1, 0))]


def _up_down(seed):
  rng = np.random.default_rng(seed)
  spread = np.exp(rng.uniform(-2, 2, 6))  # an imbalanced channel j: up * s_j, down / s_j
  return {
    "up": jnp.asarray(rng.standard_normal((4, 6)) * spread, jnp.float32),
    "down": jnp.asarray(rng.standard_normal((6, 4)) / spread[:, None], jnp.float32),
  }


@functools.cache
def _history_fn(tx):
  """``fn(params, grads)``: the state of ``tx`` after updates with ``grads`` at fixed params."""

  def history(params, grads):
    state = tx.init(params)
    for g in grads:
      state = tx.update(g, state, params)[1]
    return state

  return jax.jit(history)


def _balanced_by_numpy(params):
  """``(params, move_grads)`` at the canonical point: channel j of up times
  ``c_j = sqrt(||down_j|| / ||up_j||)``, of down divided by it; gradients move inversely."""
  up, down = (np.asarray(params[k], np.float64) for k in ("up", "down"))
  c = np.sqrt(np.linalg.norm(down, axis=1) / np.linalg.norm(up, axis=0))

  def move(tree, power):
    return {
      "up": jnp.asarray(np.asarray(tree["up"], np.float64) * c**power, jnp.float32),
      "down": jnp.asarray(np.asarray(tree["down"], np.float64) / c[:, None] ** power, jnp.float32),
    }

  return move(params, 1), lambda g: move(g, -1)


ADAMAX_TX = {
  "saggs chain": lambda: saggs.chain(optax.adamax(1e-2), saggs.saggs(UP_DOWN, every=100)),
  "optax": lambda: optax.adamax(1e-2),
}


@pytest.mark.parametrize("given", sorted(ADAMAX_TX))
def test_restore_moves_adamax_by_its_measured_degrees(manager, given):
  """Equivalent history: adamax run at the canonical parameters on the moved gradients
  holds the state that restore must give (its nu, an infinity norm, has degree 1 where
  Adam's state type registers 2)."""
  tx, adamax = ADAMAX_TX[given](), optax.adamax(1e-2)
  params, grads = _up_down(0), [models.random_like(_up_down(0), s) for s in (1, 2, 3)]
  state = _history_fn(adamax)(params, grads)
  if given == "saggs chain":  # the chain's layout, a SAGGS stage state beside adamax's
    stage = models.random_like(saggs.saggs(UP_DOWN).stage.init(params), 4)
    state = (state, stage)
  saggs.checkpoint.save(manager, 1, params, state)
  got_params, got_state, _ = saggs.checkpoint.restore(manager, params, state, UP_DOWN, tx=tx)

  balanced, move_grads = _balanced_by_numpy(params)
  want = _history_fn(adamax)(balanced, [move_grads(g) for g in grads])
  chex.assert_trees_all_close(got_params, balanced, **EXACT)
  if given == "saggs chain":
    chex.assert_trees_all_equal(got_state[1], stage)  # the stage's own state holds no moments
    got_state = got_state[0]
  chex.assert_trees_all_close(got_state, want, **CLOSE)
  # Adam's registered degrees (nu by c**-2) miss it.
  registered = saggs.canonicalize(params, _history_fn(adamax)(params, grads), UP_DOWN)[1]
  with pytest.raises(AssertionError, match="Values not approximately equal"):
    chex.assert_trees_all_close(registered[0].nu, want[0].nu, rtol=0.1)


UNTOLD_STATES = {
  "adamax chain": (ADAMAX_TX["saggs chain"], "ScaleByAdamState leaf at opt_state/0/0/mu/down"),
  "sgd momentum": (lambda: optax.sgd(1e-2, momentum=0.9), "TraceState leaf at opt_state/0/trace"),
  "masked adam": (
    lambda: optax.masked(optax.adam(1e-2), {"up": True, "down": False}),
    "ScaleByAdamState leaf at opt_state/inner_state/0/mu/up",
  ),
  "rmsprop": (lambda: optax.rmsprop(1e-2), "ScaleByRmsState leaf at opt_state/0/nu/down"),
}


@pytest.mark.parametrize("case", sorted(UNTOLD_STATES))
def test_restore_without_tx_refuses_states_whose_degrees_it_cannot_tell(manager, tmp_path, case):
  make, named = UNTOLD_STATES[case]
  params = _up_down(0)
  state = models.random_like(make().init(params), 5)
  saggs.checkpoint.save(manager, 1, params, state)
  manager.wait_until_finished()
  files, snapshot = _fingerprint(tmp_path), jax.tree.map(np.array, (params, state))
  with pytest.raises(TypeError, match=re.escape(named) + ".*" + re.escape("pairs, tx=tx)")):
    saggs.checkpoint.restore(manager, params, state, UP_DOWN)
  assert _fingerprint(tmp_path) == files
  chex.assert_trees_all_equal((params, state), snapshot)
  # Without canonicalising, no degree is needed.
  chex.assert_trees_all_equal(
    saggs.checkpoint.restore(manager, params, state, UP_DOWN, canonicalize=False)[:2], snapshot
  )


# Moments whose registered degree (1) is not theirs (0): issue 43, finding 7. An eps of
# 1e-30 keeps the two histories equivalent to float32 rounding (1e-8 is not negligible
# next to the squares of gradients moved by 1 / 4.5).
AFTER_A_NORMALISER = {
  "rms then lion": lambda: optax.chain(
    optax.scale_by_rms(eps=1e-30), optax.scale_by_lion(), optax.scale(-1e-2)
  ),
  "rms then MultiSteps(sgd)": lambda: optax.chain(
    optax.scale_by_rms(eps=1e-30), optax.MultiSteps(optax.sgd(1e-2), 4).gradient_transformation()
  ),
}


@pytest.mark.parametrize("case", sorted(AFTER_A_NORMALISER))
def test_equivalent_checkpoints_are_never_restored_apart_silently(manager, case):
  """Two equivalent checkpoints (the second the history of the first at parameters moved by
  c per channel in NumPy, on the gradients moved by 1 / c) of moments placed after a
  normaliser: their registered degrees moved them ~2 apart without a word; restore without
  tx now refuses them, naming the leaf, and with tx= restores both onto one state."""
  tx = AFTER_A_NORMALISER[case]()
  params, grads = _up_down(0), [models.random_like(_up_down(0), s) for s in (1, 2, 3)]
  c = np.exp(np.random.default_rng(4).uniform(-1.5, 1.5, 6))

  def move(tree, power):
    return {"up": tree["up"] * c**power, "down": tree["down"] / c[:, None] ** power}

  moved = move(params, 1)
  states = [_history_fn(tx)(params, grads), _history_fn(tx)(moved, [move(g, -1) for g in grads])]
  for step, (p, s) in enumerate(zip((params, moved), states), start=1):
    saggs.checkpoint.save(manager, step, p, s)
  manager.wait_until_finished()
  target = params, tx.init(params)
  for step in (1, 2):
    with pytest.raises(TypeError, match=r"leaf at opt_state/0/nu/down \(and 3 more\)"):
      saggs.checkpoint.restore(manager, *target, UP_DOWN, step=step)
  one, two = (
    saggs.checkpoint.restore(manager, *target, UP_DOWN, step=step, tx=tx)[:2] for step in (1, 2)
  )
  chex.assert_trees_all_close(one, two, rtol=1e-4, atol=1e-6)
  # What restoring by the registered degrees gave: the two far apart.
  by_type = [saggs.canonicalize(p, s, UP_DOWN)[1] for p, s in zip((params, moved), states)]
  gap = max(
    float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
    for a, b in zip(jax.tree.leaves(by_type[0]), jax.tree.leaves(by_type[1]))
    if np.issubdtype(a.dtype, np.floating)
  )
  assert gap > 0.5


def test_a_checkpoint_saved_with_tx_refuses_another_optimizer_of_its_layout(manager, monkeypatch):
  """Adam's and adamax's states have one layout; adamax's nu moves by degree 1, adam's by 2
  (issue 43, finding 8: restored 1.97 apart). save(tx=) records the degrees, so restore(tx=)
  with the other is refused before any array is read; a tx of the same degrees (another
  learning rate) is accepted and restores what the saving one does."""
  params = _up_down(0)
  grads = [models.random_like(params, s) for s in (1, 2)]
  chains = {
    name: saggs.chain(make(lr), saggs.saggs(UP_DOWN, every=100))
    for name, make, lr in (("adam", optax.adam, 1e-2), ("adamax", optax.adamax, 1e-2))
  }
  state = _history_fn(optax.adam(1e-2))(params, grads)
  chain_state = (state, chains["adam"].init(params)[1])
  saggs.checkpoint.save(manager, 1, params, chain_state, tx=chains["adam"])  # pairs: the stage's
  saggs.checkpoint.save(manager, 2, params, state, tx=optax.adam(1e-2), pairs=UP_DOWN)
  saggs.checkpoint.save(manager, 3, params, chain_state)  # no record: not checked
  manager.wait_until_finished()
  reads, restore = [], type(manager).restore

  def counting(self, step, args=None, **kwargs):
    reads.append(sorted(args.keys()))
    return restore(self, step, args=args, **kwargs)

  monkeypatch.setattr(type(manager), "restore", counting)
  for step, tx, target, path in (
    (1, chains["adamax"], chain_state, "0/0/nu/down"),
    (2, optax.adamax(1e-2), state, "0/nu/down"),
  ):
    reads.clear()
    with pytest.raises(ValueError, match=rf"saved by another optimizer: its leaf '{path}'"):
      saggs.checkpoint.restore(manager, params, target, UP_DOWN, step=step, tx=tx)
    assert ["state"] not in reads  # refused before any array was read
  other_rate = saggs.chain(optax.adam(0.5), saggs.saggs(UP_DOWN, every=100))
  got = saggs.checkpoint.restore(manager, params, chain_state, UP_DOWN, step=1, tx=other_rate)
  want = saggs.checkpoint.restore(manager, params, chain_state, UP_DOWN, step=1, tx=chains["adam"])
  chex.assert_trees_all_equal(got[:2], want[:2])
  saggs.checkpoint.restore(manager, params, chain_state, UP_DOWN, step=3, tx=chains["adamax"])
  with pytest.raises(ValueError, match="pass pairs= too"):
    saggs.checkpoint.save(manager, 4, params, state, tx=optax.adam(1e-2))
  with pytest.raises(ValueError, match="tx does not make this opt_state"):
    saggs.checkpoint.save(manager, 4, params, state, tx=optax.sgd(1e-2, 0.9), pairs=UP_DOWN)


def test_restore_refuses_a_tx_that_did_not_make_the_state(manager):
  params = _up_down(0)
  state = optax.adamax(1e-2).init(params)
  saggs.checkpoint.save(manager, 1, params, state)
  with pytest.raises(
    ValueError,
    match=re.escape("tx does not make this opt_state: at '0/trace/down', tx.init(params) gives"),
  ):
    saggs.checkpoint.restore(manager, params, state, UP_DOWN, tx=optax.sgd(1e-2, momentum=0.9))
  # A SAGGS stage would balance the probe histories that measure the degrees.
  wrapped = optax.MultiSteps(ADAMAX_TX["saggs chain"](), every_k_schedule=2)
  saggs.checkpoint.save(manager, 2, params, wrapped.init(params))
  with pytest.raises(TypeError, match="tx holds a SAGGS stage inside another transformation"):
    saggs.checkpoint.restore(manager, params, wrapped.init(params), UP_DOWN, tx=wrapped)


def test_a_tx_whose_degrees_cannot_be_measured_fails_before_any_array_is_read(manager, monkeypatch):
  """The canonicalisation compiles while Orbax reads, but is lowered (its degrees measured)
  first: a trust ratio over a leaf whose channels move apart (lars) leaves its trace at no
  degree, and that refusal comes before the arrays are read."""
  params = _up_down(0)
  tx = optax.lars(1e-2)
  state = models.random_like(tx.init(params), 6)
  saggs.checkpoint.save(manager, 1, params, state)
  manager.wait_until_finished()
  reads = []
  restore = type(manager).restore

  def counting(self, step, args=None, **kwargs):
    reads.append(sorted(args.keys()))
    return restore(self, step, args=args, **kwargs)

  monkeypatch.setattr(type(manager), "restore", counting)
  with pytest.raises(TypeError, match=re.escape("TraceState at opt_state[3].trace")):
    saggs.checkpoint.restore(manager, params, state, UP_DOWN, tx=tx)
  assert reads and all("state" not in r for r in reads)  # the JSON records only, no array


def test_restore_verifies_by_checksum_programs_compiled_before_the_read(manager, monkeypatch):
  """The checksum programs are lowered from the target and compiled while Orbax reads: the
  verification after the read compiles nothing, and still catches a corrupted array."""
  params = _up_down(0)
  tx = saggs.chain(optax.adam(1e-2), saggs.saggs(UP_DOWN))
  state = models.random_like(tx.init(params), 6)
  saggs.checkpoint.save(manager, 1, params, state)
  manager.wait_until_finished()
  jitted = saggs._src.checksums.checksum_all

  class LoweredOnly:  # the jitted program, which may only be lowered now
    lower = staticmethod(jitted.lower)

    def __call__(self, leaves):
      raise AssertionError("a checksum program compiled after the read")

  monkeypatch.setattr(saggs._src.checksums, "checksum_all", LoweredOnly())
  got_params, _, _ = saggs.checkpoint.restore(manager, params, state, UP_DOWN, tx=tx)
  want, _ = saggs.canonicalize(params, state[0], UP_DOWN, tx=optax.adam(1e-2))
  chex.assert_trees_all_close(got_params, want, rtol=1e-6)
  restore = type(manager).restore

  def flipped(self, step, args=None, **kwargs):  # one bit of one restored array
    out = restore(self, step, args=args, **kwargs)
    if "state" in args.keys():
      up = out["state"]["params"]["up"]
      out["state"]["params"]["up"] = up.at[0, 0].set(-up[0, 0])
    return out

  monkeypatch.setattr(type(manager), "restore", flipped)
  with pytest.raises(ValueError, match="corrupted"):
    saggs.checkpoint.restore(manager, params, state, UP_DOWN, tx=tx)


def test_a_restore_in_a_new_process_compiles_nothing_jax_has_cached(manager):
  """With JAX's persistent compilation cache (conftest gives each test process one), a
  canonicalising restore compiles nothing a restore compiled before: after the in-memory
  caches are emptied, as in a new process, every program of the second restore is a hit. JAX
  writes no program with a host callback (as the joint solve's warning was) to the cache."""
  params = _up_down(0)
  tx = saggs.chain(optax.adam(1e-2), saggs.saggs(UP_DOWN))
  state = models.random_like(tx.init(params), 6)
  saggs.checkpoint.save(manager, 1, params, state)
  manager.wait_until_finished()
  first = saggs.checkpoint.restore(manager, params, state, UP_DOWN, tx=tx)
  saggs._src.checkpoint._canonicalizer.cache_clear()
  with models.as_after_a_restart() as events:
    second = saggs.checkpoint.restore(manager, params, state, UP_DOWN, tx=tx)
  chex.assert_trees_all_equal(first, second)
  assert events["cache_hits"] == events["compile_requests_use_cache"] >= 2, events


def test_restore_canonicalizes_in_place_on_abstract_7b_shapes():
  """The restore's canonicalisation, compiled on an abstract 7B state (Adam-shaped, of a
  type whose degrees its type fixes): every output overwrites its donated input, and its
  temporaries stay under 5% of the state, so restoring peaks where Orbax's restore does."""
  params, adam = _abstract_llama_state()
  state = optax.ScaleByBeliefState(adam.count, adam.mu, adam.nu)
  pairs = saggs.presets.llama(num_kv_heads=32, stacked=1)
  specs, treedef = jax.tree.flatten((params, state))
  program = saggs._src.checkpoint._canonicalizer(
    tuple(pairs), None, -1, None, treedef, tuple(specs)
  ).result()
  memory = program.memory_analysis()
  nbytes = sum(x.size * x.dtype.itemsize for x in specs)
  assert nbytes > 80e9
  fresh = memory.output_size_in_bytes - memory.alias_size_in_bytes  # outputs not in place
  assert fresh + memory.temp_size_in_bytes <= 0.05 * nbytes


def test_restore_by_tx_canonicalizes_in_place_on_abstract_7b_shapes():
  """As above, by the degrees measured on a saggs.chain of AdamW (restore(..., tx=tx), the
  path bench/bench_checkpoint.py times): the measured degrees move every moment in place."""
  params, _ = _abstract_llama_state()
  pairs = saggs.presets.llama(num_kv_heads=32, stacked=1)
  tx = saggs.chain(optax.adamw(1e-3), saggs.saggs(pairs, every=100))
  state = jax.eval_shape(tx.init, params)
  optimizer, n, made = saggs._src.checkpoint._made_by(tx, params, state)
  specs, treedef = jax.tree.flatten((params, state))
  program = saggs._src.checkpoint._canonicalizer(
    tuple(pairs), optimizer, n, made, treedef, tuple(specs)
  ).result()
  memory = program.memory_analysis()
  nbytes = sum(x.size * x.dtype.itemsize for x in specs)
  assert nbytes > 80e9
  fresh = memory.output_size_in_bytes - memory.alias_size_in_bytes  # outputs not in place
  assert fresh + memory.temp_size_in_bytes <= 0.05 * nbytes
