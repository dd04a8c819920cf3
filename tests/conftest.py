"""Test-wide settings.

The suite compares float32 results at tight tolerances, so matmuls run at full
precision on every backend (no TF32 on GPUs).

Its programs are tiny and mostly run once, so LLVM's optimisation passes cost
more than they save: without them the suite spends about a third less CPU on
compiles. The level changes compile time only, not what is computed. XLA reads
``XLA_FLAGS`` once, at the first compile, so the flag is set for that compile
and then taken back: the suite's subprocesses choose their own.
"""

import os

import jax

jax.config.update("jax_default_matmul_precision", "highest")

_flags = os.environ.get("XLA_FLAGS")
os.environ["XLA_FLAGS"] = f"{_flags or ''} --xla_backend_optimization_level=0".strip()
jax.jit(lambda x: x + 1)(1.0)
if _flags is None:
  del os.environ["XLA_FLAGS"]
else:
  os.environ["XLA_FLAGS"] = _flags
