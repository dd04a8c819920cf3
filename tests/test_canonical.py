"""saggs_jax._src.canonical: reparameterize's checks of its factors (eagerly an error, traced a
no-op on the groups they would break) and canonicalize against a NumPy balance of each channel
with Adam's moments moved alongside. Every layout and optimizer: tests/test_checkpoint.py."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import saggs_jax as saggs

QK = [saggs.Pair("q", "k", axes=(1, 1), name="QK")]


def _qk():
  return {"q": jnp.ones((2, 3)), "k": jnp.ones((2, 3))}


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e39
@pytest.mark.parametrize(
  "factor, got",
  [
    (float("inf"), "got inf."),
    (0.0, "got 0.0."),
    (-2.0, "got -2.0."),
    (1e39, "got inf."),
    (lambda path, shape: np.array([1.0, np.nan, -1.0]), "got -1.0, nan."),
  ],
)
def test_reparameterize_refuses_factors_not_positive_and_finite(factor, got):
  with pytest.raises(
    ValueError,
    match=re.escape("The factors of QK on 'q|k' must be positive and finite in float32, " + got),
  ):
    saggs.reparameterize(_qk(), None, QK, factor)


@pytest.mark.parametrize("factor", ["2", lambda path, shape: np.ones(4)])
def test_reparameterize_refuses_factors_of_another_shape_or_type(factor):
  with pytest.raises(
    ValueError,
    match=re.escape("The factors of QK on 'q|k' must be numbers broadcastable to shape (3,)"),
  ):
    saggs.reparameterize(_qk(), None, QK, factor)


def test_reparameterize_under_jit_leaves_groups_with_bad_factors_alone():
  """Traced factors cannot be checked without waiting on the device: a group whose factor
  is not positive and finite keeps its values (factor 1), so no NaN or inf leaves it."""
  move = jax.jit(lambda p, c: saggs.reparameterize(p, None, QK, lambda path, shape: c)[0])
  out = move(_qk(), jnp.asarray([4.0, jnp.inf, -1.0]))
  np.testing.assert_array_equal(out["q"], np.array([[4.0, 1.0, 1.0]] * 2, np.float32))
  np.testing.assert_array_equal(out["k"], np.array([[0.25, 1.0, 1.0]] * 2, np.float32))
  out = move(_qk(), jnp.asarray([0.0, jnp.nan, 2.0]))
  np.testing.assert_array_equal(out["q"], np.array([[1.0, 1.0, 2.0]] * 2, np.float32))


UP_DOWN = [saggs.Pair("up", "down", axes=(1, 0))]


def test_canonicalize_balances_each_channel_and_transports_adams_moments_as_numpy_does():
  """Channel j of up (column) and of down (row) both get norm sqrt(|up_j| |down_j|): the
  factor c_j = sqrt(|down_j| / |up_j|) on up, 1/c_j on down; Adam's mu moves as the
  gradient (1/c on up), nu as its square."""
  rng = np.random.default_rng(0)
  params = {
    "up": rng.standard_normal((3, 4)) * [0.1, 1.0, 5.0, 2.0],
    "down": rng.standard_normal((4, 2)),
  }
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  (state, *rest) = optax.adam(1e-2).init(params)
  state = state._replace(
    mu=jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params),
    nu=jax.tree.map(lambda x: jnp.asarray(rng.random(x.shape), x.dtype), params),
  )
  moved, (moved_state, *_) = saggs.canonicalize(params, (state, *rest), UP_DOWN)

  up, down = (np.asarray(params[k], np.float64) for k in ("up", "down"))
  c = np.sqrt(np.linalg.norm(down, axis=1) / np.linalg.norm(up, axis=0))
  np.testing.assert_allclose(moved["up"], up * c, rtol=1e-5)
  np.testing.assert_allclose(moved["down"], down / c[:, None], rtol=1e-5)
  np.testing.assert_allclose(moved_state.mu["up"], np.asarray(state.mu["up"]) / c, rtol=1e-5)
  np.testing.assert_allclose(moved_state.nu["up"], np.asarray(state.nu["up"]) / c**2, rtol=1e-5)
  np.testing.assert_allclose(
    moved_state.nu["down"], np.asarray(state.nu["down"]) * c[:, None] ** 2, rtol=1e-5
  )
  again, _ = saggs.canonicalize(moved, None, UP_DOWN)
  chex.assert_trees_all_close(again, moved, rtol=1e-5)  # idempotent


# --- flax.nnx: two optimizers from a state and its moved copy --------------------------------


class _Bilinear(nnx.Module):
  """``(x W_q) · (x W_k)`` per head of 2: Q/K rescale per head, an exact symmetry."""

  def __init__(self, rngs):
    self.q = nnx.Linear(4, 4, use_bias=False, rngs=rngs)
    self.k = nnx.Linear(4, 4, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return (self.q(x) * self.k(x)).reshape(-1, 2, 2).sum(-1)


NNX_PAIRS = [saggs.Pair("q/kernel", "k/kernel", axes=(1, 1), groups=2)]


@nnx.jit
def _nnx_step(model, optimizer, x):
  grads = nnx.grad(lambda m: jnp.mean(jnp.sin(m(x))))(model)
  optimizer.update(model, grads)


def _boxes(tree):
  return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


@pytest.mark.parametrize("with_tx", [False, True])
def test_nnx_optimizers_from_a_state_and_its_reparameterised_copy_train_identically(with_tx):
  """reparameterize returns fresh nnx Variables (none of its input's), so an nnx.Optimizer
  built from the moved state counts on its own: both follow one trajectory under hard SAGGS
  every=1. The moved moments are checked against a NumPy transport (mu / c, nu / c**2 on Q)."""
  tx = saggs.chain(optax.adam(1e-2), saggs.saggs(NNX_PAIRS))
  xs = jax.random.normal(jax.random.key(1), (8, 16, 4))
  model = _Bilinear(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  for x in xs[:3]:
    _nnx_step(model, optimizer, x)
  params, state = nnx.state(model, nnx.Param), optimizer.opt_state
  c = np.array([3.0, 0.25])
  moved_params, moved = saggs.reparameterize(
    params, state, NNX_PAIRS, lambda path, shape: c, tx=tx if with_tx else None
  )
  shared = {id(v) for v in _boxes((params, state))} & {id(v) for v in _boxes((moved_params, moved))}
  assert not shared
  c_q = np.repeat(c, 2)  # per output column of W_q
  adam, moved_adam = state[0][0], moved[0][0]
  np.testing.assert_allclose(
    moved_adam.mu["q"]["kernel"][...], adam.mu["q"]["kernel"][...] / c_q, rtol=1e-6
  )
  np.testing.assert_allclose(
    moved_adam.nu["k"]["kernel"][...], adam.nu["k"]["kernel"][...] * c_q**2, rtol=1e-6
  )

  other = _Bilinear(nnx.Rngs(0))
  nnx.update(other, moved_params)
  other_optimizer = nnx.Optimizer(other, tx, wrt=nnx.Param)
  other_optimizer.opt_state = moved
  for x in xs[3:]:
    _nnx_step(model, optimizer, x)
    _nnx_step(other, other_optimizer, x)
    chex.assert_trees_all_close(
      nnx.to_pure_dict(nnx.state(other, nnx.Param)),
      nnx.to_pure_dict(nnx.state(model, nnx.Param)),
      rtol=1e-5,
      atol=1e-6,
    )
  assert (
    int(optimizer.opt_state[0][0].count[...])
    == int(other_optimizer.opt_state[0][0].count[...])
    == 8
  )


def test_canonicalize_with_tx_takes_an_nnx_optimizer_state():
  """nnx.Optimizer boxes its state in OptVariable where tx.init boxes Param: the same layout,
  accepted with tx=, and a state of another optimizer is a short error naming its path."""
  tx = saggs.chain(optax.adam(1e-2), saggs.saggs(NNX_PAIRS))
  model = _Bilinear(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  params = nnx.state(model, nnx.Param)
  canonical, state = saggs.canonicalize(params, optimizer.opt_state, NNX_PAIRS, tx=tx)
  assert jax.tree.structure(state) == jax.tree.structure(optimizer.opt_state)
  norms = [
    np.linalg.norm(np.reshape(canonical[n]["kernel"][...], (4, 2, 2)), axis=(0, 2)) for n in "qk"
  ]
  np.testing.assert_allclose(norms[0], norms[1], rtol=1e-5)
  other = saggs.chain(optax.sgd(1e-2, momentum=0.9), saggs.saggs(NNX_PAIRS))
  with pytest.raises(
    ValueError, match=r"^opt_state is not what tx makes: at '0/0/trace/k/kernel' it holds nothing"
  ) as e:
    saggs.canonicalize(params, optimizer.opt_state, NNX_PAIRS, tx=other)
  assert len(str(e.value)) < 300


@pytest.mark.parametrize("factor", [1e30, 1e-30, 2.0**64])
def test_reparameterize_refuses_factors_that_move_moments_past_their_dtype(factor):
  """Adam's nu moves by c**-2 (A) and c**2 (B): at these factors float32 holds neither, and
  every entry would become inf or 0, which no later canonicalize recovers (issue 43, finding
  10). The parameters alone (c and 1/c) still fit."""
  params = _qk()
  tx = optax.adam(1e-2)
  _, state = optax.adam(1e-2).update(params, tx.init(params), params)
  with pytest.raises(
    ValueError, match=r"entries of opt_state\[0\]\.nu\['[qk]'\] \(float32\) to inf or 0"
  ):
    saggs.reparameterize(params, state, QK, factor, tx=tx)
  moved, _ = saggs.reparameterize(params, None, QK, factor)
  assert np.all(np.isfinite(moved["q"]) & (moved["q"] != 0))
