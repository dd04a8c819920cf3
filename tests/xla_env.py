"""XLA settings of the test suite and the environment of its subprocesses."""

import os

import jaxlib

# LLVM's optimisation passes, the newer fusion emitters and splitting a program into
# several LLVM modules all cost more compile time than tiny programs that run once
# can win back. XLA aborts on a flag it does not know, and from jaxlib 0.11 on it has no
# switch for the fusion emitters (they are the only ones).
_OLD_EMITTERS = tuple(int(v) for v in jaxlib.__version__.split(".")[:2]) < (0, 11)
FAST_COMPILE = " ".join(
  ["--xla_backend_optimization_level=0", "--xla_cpu_parallel_codegen_split_count=1"]
  + ["--xla_cpu_use_fusion_emitters=false"] * _OLD_EMITTERS
)


def cpu_env(devices: int = 1, **extra: str) -> dict[str, str]:
  """This process's environment on the CPU backend with ``devices`` devices.

  The suite's XLA flags (set by conftest.py) carry over; ``extra`` adds or replaces variables.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  return {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
    **extra,
  }
