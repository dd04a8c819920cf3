"""A small Equinox model whose fields are not all arrays: an activation function,
a Dropout (a float rate and an ``inference`` flag) and an int, as real Equinox
models hold. Its ReLU MLP has one exact symmetry per hidden channel; Equinox's
Linear stores weights as (out, in), so the channel is axis 0 of ``up`` and axis
1 of ``down``."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import saggs_jax as saggs

PAIRS = [saggs.Pair("up/weight", "down/weight", axes=(0, 1), name="ReLU channels")]
X = jnp.asarray(np.random.default_rng(0).standard_normal((5, 3)), jnp.float32)


class MLP(eqx.Module):
  up: eqx.nn.Linear
  down: eqx.nn.Linear
  dropout: eqx.nn.Dropout
  activation: Callable
  hidden: int

  def __init__(self, seed: int = 0, inference: bool = True):
    k1, k2 = jax.random.split(jax.random.key(seed))
    self.hidden = 4
    self.up = eqx.nn.Linear(3, self.hidden, use_bias=False, key=k1)
    self.down = eqx.nn.Linear(self.hidden, 2, key=k2)
    self.dropout = eqx.nn.Dropout(0.1, inference=inference)
    self.activation = jax.nn.relu

  def __call__(self, x):
    return self.down(self.dropout(self.activation(self.up(x))))


def imbalanced(seed: int = 0, inference: bool = True) -> MLP:
  """The model with its up rows scaled by 1..4 and down columns by their inverses."""
  model = MLP(seed, inference)
  c = jnp.arange(1.0, 5.0)
  model = eqx.tree_at(lambda m: m.up.weight, model, model.up.weight * c[:, None])
  return eqx.tree_at(lambda m: m.down.weight, model, model.down.weight / c[None, :])


def apply(model: MLP, x: jax.Array) -> jax.Array:
  return jax.vmap(model)(x)
