"""saggs_jax._src.numerics: the compute dtype and the dtype limits balancing shares."""

import jax.numpy as jnp
import numpy as np
import pytest

from saggs_jax._src.numerics import compute_dtype, log_dtype_max


@pytest.mark.parametrize(
  "dtype, want",
  [
    (jnp.bfloat16, jnp.float32),
    (jnp.float16, jnp.float32),
    (jnp.float32, jnp.float32),
    (jnp.int8, jnp.float32),
  ],
)
def test_compute_dtype_is_at_least_float32(dtype, want):
  assert compute_dtype(dtype) == want


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_log_dtype_max_stays_below_the_largest_finite_value_by_a_rounding_margin(dtype):
  ratio = np.exp(np.float64(log_dtype_max(dtype))) / float(jnp.finfo(dtype).max)
  assert 1 - 2.0**-7 < ratio < 1  # scaled up to it, a leaf rounds to a finite value
  assert np.isfinite(np.asarray(np.exp(log_dtype_max(dtype)), np.float64).astype(dtype))
