"""saggs_jax._src.scaling: multiplying the declared leaves by their factors, and landing updates."""

import jax.numpy as jnp
import numpy as np
import pytest

import saggs_jax as saggs
from saggs_jax._src.plan import resolve
from saggs_jax._src.scaling import land_on, scale_tree

PARAMS = {
  "q": jnp.arange(1.0, 9.0).reshape(2, 4),
  "k": jnp.arange(2.0, 10.0).reshape(2, 4),
  "o": jnp.ones(3),
}
PLAN = resolve([saggs.Pair("q", "k", axes=(1, 1), groups=2)], PARAMS)
C = np.array([2.0, 0.5], np.float32)  # per group of 2 columns
FACTORS = {PLAN.instances[0].key: jnp.asarray(C)}


@pytest.mark.parametrize("power", [1.0, -1.0, -2.0])
def test_scale_tree_multiplies_a_by_c_and_b_by_its_inverse_to_the_power(power):
  out = scale_tree(PLAN, PARAMS, FACTORS, power)
  cols = np.repeat(C, 2)[None]
  np.testing.assert_allclose(out["q"], np.asarray(PARAMS["q"]) * cols**power, rtol=1e-6)
  np.testing.assert_allclose(out["k"], np.asarray(PARAMS["k"]) * cols**-power, rtol=1e-6)
  assert out["o"] is PARAMS["o"]  # undeclared: the same object


def test_land_on_moves_to_the_target_and_keeps_the_update_where_the_factor_is_one():
  updates = {n: jnp.full_like(x, 0.1) for n, x in PARAMS.items()}
  factors = {PLAN.instances[0].key: jnp.asarray([2.0, 1.0])}  # group 1 unchanged
  target = scale_tree(PLAN, {n: x + updates[n] for n, x in PARAMS.items()}, factors, 1.0)
  out = land_on(PARAMS, updates, target, PLAN, factors)
  np.testing.assert_allclose(PARAMS["q"][:, :2] + out["q"][:, :2], target["q"][:, :2], rtol=1e-6)
  np.testing.assert_array_equal(out["q"][:, 2:], updates["q"][:, 2:])  # bit for bit
  np.testing.assert_array_equal(out["o"], updates["o"])
