"""saggs_jax.chain and saggs_jax.wrap: stage order, several stages, a running optimizer joined
(init_from), an Equinox module trained like a dict."""

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import equinox_mlp
import models
import saggs_jax as saggs
from test_transform import (  # the small two-layer model and its pairs
  SMALL_GRAD,
  SMALL_PAIRS,
  balances,
  hand_transport,
  small_imbalanced,
  small_multipliers,
  small_params,
)


@pytest.mark.parametrize("wrapped", [False, True])
def test_init_from_joins_a_running_adam_with_its_moments_transported(wrapped):
  """SAGGS joining at a restart: Adam runs alone for 3 updates, then ``init_from`` builds the
  chain's state around Adam's. Oracle: the joined updates are the plain Adam steps from the
  hand-balanced point with the hand-transported moments (NumPy), Adam's count continuing."""
  adam = optax.adam(1e-2)
  p = small_imbalanced(22)
  s = adam.init(p)
  for _ in range(3):
    p, _, s = models.jit_step(adam, p, s, SMALL_GRAD(p))
  stage = saggs.saggs(SMALL_PAIRS, every=2)
  tx = saggs.wrap(adam, stage) if wrapped else saggs.chain(adam, stage)
  joined = tx.init_from(p, s)
  assert int(joined[0][0].count) == 3 and int(joined[1].step) == 0
  p_want, s_want = p, s
  for n in range(1, 4):
    p, _, joined = models.jit_step(tx, p, joined, SMALL_GRAD(p))
    if balances(n, 2):
      mult = small_multipliers(p_want)
      p_want, s_want = hand_transport(p_want, mult, -1), hand_transport(s_want, mult)
    p_want, _, s_want = models.jit_step(adam, p_want, s_want, SMALL_GRAD(p_want))
    chex.assert_trees_all_close(p, p_want, rtol=2e-5, atol=1e-6)
    chex.assert_trees_all_close(joined[0], s_want, rtol=2e-5, atol=1e-7)


def test_init_from_a_restored_state_compiles_the_train_step_once():
  """A restored state is committed to its device: the stage's fresh state joins it there,
  else the step's committed outputs would make the second call compile again."""
  adam = optax.adam(1e-2)
  params = jax.device_put(small_params(0), jax.devices()[0])
  tx = saggs.chain(adam, saggs.saggs(SMALL_PAIRS))
  state = tx.init_from(params, jax.device_put(adam.init(params), jax.devices()[0]))

  @jax.jit
  def train_step(params, state):
    updates, state = tx.update(SMALL_GRAD(params), state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(2):
    params, state = train_step(params, state)
  assert train_step._cache_size() == 1


def test_init_from_refuses_a_state_the_optimizer_does_not_make():
  params = small_params(0)
  adam = optax.adam(1e-2)
  tx = saggs.chain(adam, saggs.saggs(SMALL_PAIRS))
  with pytest.raises(ValueError, match=r"one state per transformation .* 1 here, got 2"):
    tx.init_from(params, adam.init(params), adam.init(params))
  other = small_params(0, jnp.bfloat16)
  with pytest.raises(ValueError, match=r"at '0/mu/layers/0/down' it holds bfloat16\[6, 4\]"):
    tx.init_from(params, adam.init(other))
  with pytest.raises(ValueError, match=r"at '0/count' it holds nothing, not int32\[\]"):
    tx.init_from(params, optax.sgd(1e-2, momentum=0.9).init(params))
  with pytest.raises(ValueError, match="no symmetry stage"):
    saggs.chain(adam).init_from(params, adam.init(params))


def test_chain_trains_an_equinox_module_as_it_trains_a_dict():
  """The Equinox idiom: the optimizer sees ``eqx.filter(model, eqx.is_inexact_array)`` and
  ``eqx.filter_grad``'s gradients (None for the function, flags and ints), the step runs
  under ``eqx.filter_jit``. The trajectory is that of the same arrays held in a dict."""

  def tx(pairs):
    return saggs.chain(optax.adam(1e-2), saggs.soft(pairs, strength=0.5, every=2))

  def as_dict(m):
    return {"up": m.up.weight, "down": m.down.weight, "bias": m.down.bias}

  def dict_loss(p):
    h = jax.nn.relu(equinox_mlp.X @ p["up"].T)
    return jnp.mean((h @ p["down"].T + p["bias"] - 1.0) ** 2)

  module_tx, dict_tx = tx(equinox_mlp.PAIRS), tx([saggs.Pair("up", "down", axes=(0, 1))])

  @eqx.filter_jit
  def module_step(model, state):
    grads = eqx.filter_grad(lambda m: dict_loss(as_dict(m)))(model)
    updates, state = module_tx.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), state

  @jax.jit
  def dict_step(p, state):
    updates, state = dict_tx.update(jax.grad(dict_loss)(p), state, p)
    return optax.apply_updates(p, updates), state

  model = equinox_mlp.imbalanced()
  p = as_dict(model)
  module_state = module_tx.init(eqx.filter(model, eqx.is_inexact_array))
  dict_state = dict_tx.init(p)
  for _ in range(3):  # balances on updates 1 and 3
    model, module_state = module_step(model, module_state)
    p, dict_state = dict_step(p, dict_state)
  chex.assert_trees_all_close(as_dict(model), p, rtol=1e-6)
  np.testing.assert_allclose(
    module_state[1].factors["up/weight|down/weight"], dict_state[1].factors["up|down"], rtol=1e-6
  )
  assert model.activation is jax.nn.relu and model.dropout.inference and model.hidden == 4


def test_a_symmetry_stage_must_follow_its_optimizer():
  with pytest.raises(ValueError, match=r"position 0 must come after the optimizer"):
    saggs.chain(saggs.soft(SMALL_PAIRS), optax.adamw(1e-3))
  with pytest.raises(ValueError, match=r"only symmetry stages may follow"):
    saggs.chain(optax.adam(1e-3), saggs.saggs(SMALL_PAIRS), optax.scale(0.5))


def test_two_symmetry_stages_in_one_chain():
  """The earlier stage's factors are not moments (one has the shape of the later pair's
  follower); each stage balances its own pairs, the later one moving the earlier one's inputs."""
  rng = np.random.default_rng(3)
  mk = lambda *s: jnp.asarray(
    rng.standard_normal(s) * np.exp(rng.uniform(-2, 2, s[-1])), jnp.float32
  )
  params = {"up": mk(3, 6), "down": mk(6, 3), "up2": mk(3, 6), "down2": mk(6, 3), "b2": mk(6)}
  first = [saggs.Pair("up", "down", axes=(1, 0))]
  second = [saggs.Pair("up2", "down2", axes=(1, 0), follow_a="b2")]
  tx = saggs.chain(optax.adam(0.0), saggs.soft(first), saggs.saggs(second))
  new, _, state = models.step(tx, params, tx.init(params), jax.tree.map(jnp.zeros_like, params))
  np.testing.assert_allclose(saggs.imbalance(new, second)["up2|down2"], 0.0, atol=1e-5)
  np.testing.assert_allclose(
    saggs.imbalance(new, first)["up|down"], saggs.imbalance(params, first)["up|down"] / 2, rtol=1e-5
  )
  assert [int(s.step) for s in state[1:]] == [1, 1]
