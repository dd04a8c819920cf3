"""Test-wide settings: the suite compares float32 results at tight tolerances,
so matmuls run at full precision on every backend (no TF32 on GPUs)."""

import jax

jax.config.update("jax_default_matmul_precision", "highest")
