"""The package's own structure: what ``import saggs_jax`` loads, and how its modules import each
other (no cycles, no module reading another's private names)."""

import pathlib
import subprocess
import sys

import saggs_jax
from xla_env import cpu_env

PACKAGE = pathlib.Path(saggs_jax.__file__).parent

OPTIONAL = ("flax", "chex", "orbax", "tensorstore")  # loaded only where used, or never


def test_import_loads_no_optional_library():
  code = "import sys, saggs_jax; print(sorted({m.split('.')[0] for m in sys.modules}))"
  out = subprocess.run(
    [sys.executable, "-c", code], env=cpu_env(), capture_output=True, text=True, check=True
  )
  loaded = set(eval(out.stdout))
  assert "saggs_jax" in loaded and "jax" in loaded  # the probe itself works
  assert not loaded & set(OPTIONAL), sorted(loaded & set(OPTIONAL))


def test_the_harness_is_not_in_the_package():
  assert not (PACKAGE / "testing").exists()  # the wheel carries what is under PACKAGE
  assert (PACKAGE.parent / "harness" / "lm.py").exists()  # the repository's folder instead
