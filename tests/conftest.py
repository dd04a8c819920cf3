"""Test-wide settings.

The suite compares float32 results at tight tolerances, so matmuls run at full
precision on every backend (no TF32 on GPUs).

Its programs are tiny and mostly run once, so compiling them costs far more
than running them. :data:`xla_env.FAST_COMPILE` picks XLA's cheapest CPU code
generation; it roughly halves the suite's compile time. The flags choose how
the compiled HLO becomes machine code, not the HLO: what is computed and what
is communicated are unchanged. XLA reads ``XLA_FLAGS`` once, at the first
compile, so they are set here, before any, and the suite's subprocesses
inherit them (see :func:`xla_env.cpu_env`).
"""

import os

import jax

from xla_env import FAST_COMPILE

jax.config.update("jax_default_matmul_precision", "highest")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
