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

Many tests compile the same program (one optimizer over several checks, one
model in several files), so the run keeps one compilation cache, in a
temporary directory that its worker processes and subprocesses share and that
the run deletes at its end: every run starts cold.
"""

import os
import shutil
import tempfile

import jax
import pytest

from xla_env import FAST_COMPILE

jax.config.update("jax_default_matmul_precision", "highest")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

_CACHE = "SAGGS_TEST_COMPILATION_CACHE"
_created = pytest.StashKey[str]()  # the directory, in the process that made it


def pytest_configure(config):
  if _CACHE not in os.environ:  # the run's first process: xdist workers and subprocesses inherit
    os.environ[_CACHE] = tempfile.mkdtemp(prefix="saggs-jax-test-compilation-cache-")
    config.stash[_created] = os.environ[_CACHE]
  # Programs compile in milliseconds here, so every one is worth keeping.
  settings = {
    "jax_compilation_cache_dir": os.environ[_CACHE],
    "jax_persistent_cache_min_compile_time_secs": 0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
  }
  for name, value in settings.items():
    jax.config.update(name, value)
    os.environ[name.upper()] = str(value)


def pytest_unconfigure(config):
  if directory := config.stash.get(_created, None):
    shutil.rmtree(directory, ignore_errors=True)
    del os.environ[_CACHE]
