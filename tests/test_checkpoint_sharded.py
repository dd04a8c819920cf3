"""saggs.checkpoint on 8 (virtual CPU) devices: sharded save and restore, nothing gathered.

A 2-D ('data', 'model') mesh splits the tiny LLaMA's parameters and moments.
Restored arrays (raw and canonicalised by the optimizer's degrees) keep the
target's shardings shard by shard, equal the saved values or their canonical
form computed unsharded, and the compiled checksum and canonicalisation programs
move nothing between devices but per-group norms and sums (no all-gather). The
checks run in a subprocess (XLA_FLAGS must be set before JAX starts):
tests/checkpoint_sharded_worker.py.
"""

import pathlib
import subprocess
import sys

import pytest

from xla_env import cpu_env

TESTS = pathlib.Path(__file__).resolve().parent


# Half a minute each: Auto runs by default, Explicit with the heavy checks of .ci/run.
@pytest.mark.parametrize("axis_type", ["Auto", pytest.param("Explicit", marks=pytest.mark.heavy)])
def test_sharded_save_and_restore_gather_nothing(axis_type):
  proc = subprocess.run(
    [sys.executable, str(TESTS / "checkpoint_sharded_worker.py"), axis_type],
    capture_output=True,
    text=True,
    timeout=600,
    env=cpu_env(8, PYTHONPATH=f"{TESTS}:{TESTS.parent}"),
  )
  assert f"{axis_type} OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-6000:]
