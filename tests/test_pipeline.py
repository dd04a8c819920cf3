"""saggs_jax._src.discovery.pipeline: ``discover``'s own arguments (its key) and its name; what
it finds on models is checked by tests/test_discover*.py."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import saggs_jax as saggs


def test_the_module_and_the_function_have_different_names():
  """``saggs_jax.discover`` is the function; its module is ``saggs_jax.discovery``, so that
  ``import saggs_jax.discover`` cannot hand back the function in place of a module."""
  import saggs_jax

  assert callable(saggs_jax.discover) and not isinstance(saggs_jax.discover, type(saggs_jax))
  assert importlib.import_module("saggs_jax.discovery").discover is saggs_jax.discover
  with pytest.raises(ModuleNotFoundError):
    importlib.import_module("saggs_jax.discover")


def test_discover_takes_a_prng_key_as_check_symmetry_does():
  """``key=`` (typed or raw) seeds the random factors; the old ``seed=`` is a TypeError that
  names the new spelling, not a keyword silently handed to the model."""
  mlp = lambda p, x: jax.nn.relu(x @ p["up"]) @ p["down"]  # noqa: E731
  params = {
    "up": jax.random.normal(jax.random.key(0), (3, 4)),
    "down": jax.random.normal(jax.random.key(1), (4, 2)),
  }
  x = jnp.ones((2, 3))
  default = saggs.discover(mlp, params, x).pairs
  for key in (jax.random.key(7), jax.random.PRNGKey(7)):
    assert saggs.discover(mlp, params, x, key=key).pairs == default
  seed = saggs._src.discovery.pipeline._seed  # the NumPy seed the factors are drawn with
  np.testing.assert_array_equal(seed(jax.random.key(7)), seed(jax.random.PRNGKey(7)))
  assert not np.array_equal(seed(jax.random.key(7)), seed(jax.random.key(8)))
  with pytest.raises(TypeError, match=r"key=jax.random.key\(seed\)"):
    saggs.discover(mlp, params, x, seed=0)
