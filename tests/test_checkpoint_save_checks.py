"""saggs.checkpoint refuses Flax nnx objects at save, and the nnx restore recipes train on.

Both recipes the docs give (save ``nnx.state(model, nnx.Param)`` with
``nnx.state(optimizer)`` and put them back with ``nnx.update``; or with
``optimizer.opt_state``, assigned back) are checked against an uninterrupted run.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import saggs_jax as saggs

PAIRS = [saggs.Pair("up/kernel", "down/kernel", axes=(1, 0))]


class MLP(nnx.Module):
  def __init__(self, seed=0):
    rngs = nnx.Rngs(seed)
    self.up = nnx.Linear(3, 4, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(4, 3, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.relu(self.up(x)))


X = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)


@nnx.jit
def train_step(model, optimizer):
  grads = nnx.grad(lambda m: jnp.mean(m(X) ** 2))(model)
  optimizer.update(model, grads)


def make(seed=0):
  model = MLP(seed)
  tx = saggs.chain(optax.adam(1e-1), saggs.saggs(PAIRS, every=1))
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


@pytest.fixture
def manager(tmp_path):
  mngr = ocp.CheckpointManager(tmp_path / "ckpt")
  yield mngr
  mngr.close()


def kernels(model):
  return [np.asarray(model.up.kernel[...]), np.asarray(model.down.kernel[...])]


@pytest.mark.parametrize(
  "wrong, match",
  [
    (lambda model, optimizer: (model, optimizer.opt_state), "params is an nnx MLP object"),
    (
      lambda model, optimizer: (nnx.state(model, nnx.Param), optimizer),
      "opt_state is an nnx Optimizer object",
    ),
  ],
  ids=["module", "optimizer"],
)
def test_nnx_objects_fail_at_save_and_write_nothing(manager, wrong, match):
  model, optimizer = make()
  with pytest.raises(TypeError, match=match) as info:
    saggs.checkpoint.save(manager, 1, *wrong(model, optimizer))
  assert "nnx.update(optimizer, opt_state)" in str(info.value)  # the message gives the fix
  manager.wait_until_finished()
  assert manager.all_steps() == []
  # A restore into such a target fails the same way, before it looks for a checkpoint.
  with pytest.raises(TypeError, match=match):
    saggs.checkpoint.restore(manager, *wrong(model, optimizer))


@pytest.mark.parametrize("whole", [True, False], ids=["state_of_optimizer", "opt_state"])
def test_nnx_restore_recipe_continues_the_run(manager, whole):
  model, optimizer = make()
  train_step(model, optimizer)
  saved = nnx.state(optimizer) if whole else optimizer.opt_state
  assert saggs.checkpoint.save(manager, 1, nnx.state(model, nnx.Param), saved)
  train_step(model, optimizer)  # the uninterrupted run's next step

  other, other_optimizer = make(seed=1)  # another model only lends the structure
  target = nnx.state(other_optimizer) if whole else other_optimizer.opt_state
  params, opt_state, step = saggs.checkpoint.restore(manager, nnx.state(other, nnx.Param), target)
  nnx.update(other, params)
  if whole:
    nnx.update(other_optimizer, opt_state)
  else:
    with pytest.raises(AttributeError):  # opt_state is optax's tuple, not an nnx graph node
      nnx.update(other_optimizer.opt_state, opt_state)
    other_optimizer.opt_state = opt_state
  train_step(other, other_optimizer)
  assert step == 1
  for got, want in zip(kernels(other), kernels(model)):
    np.testing.assert_array_equal(got, want)  # bit for bit: a restart, not a canonicalisation
