"""Test-wide settings.

The suite compares float32 results at tight tolerances, so matmuls run at full
precision on every backend (no TF32 on GPUs).

Its programs are tiny and mostly run once, so compiling them costs far more
than running them. :data:`xla_env.FAST_COMPILE` picks XLA's cheapest CPU code
generation; it roughly halves the suite's compile time. The flags choose how
the compiled HLO becomes machine code, not the HLO: what is computed and what
is communicated are unchanged. XLA reads ``XLA_FLAGS`` once, at the first
compile, so they are set here, before any, and the suite's subprocesses
inherit them (see :func:`xla_env.cpu_env`), and the repository root on ``PYTHONPATH``.

Many tests compile the same program (one optimizer over several checks, one
model in several files), so each test process keeps a compilation cache, in a
temporary directory of its own that it deletes at its end: every run starts
cold. (Processes do not share one: JAX may read an entry another is writing.)
"""

import os
import pathlib
import shutil
import tempfile

import jax
import pytest

from xla_env import FAST_COMPILE

jax.config.update("jax_default_matmul_precision", "highest")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
# pytest puts the repository root on sys.path (pyproject's pythonpath) for harness/; the
# suite's subprocesses (workers, third-party checks) inherit it through PYTHONPATH.
_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))

_cache = pytest.StashKey[str]()


def pytest_configure(config):
  config.stash[_cache] = tempfile.mkdtemp(prefix="saggs-jax-test-compilation-cache-")
  jax.config.update("jax_compilation_cache_dir", config.stash[_cache])
  # Programs compile in milliseconds here, so every one is worth keeping.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_unconfigure(config):
  shutil.rmtree(config.stash[_cache], ignore_errors=True)
