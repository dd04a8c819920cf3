"""The zoo, the gemma package: ``gm.nn.Transformer`` with a tiny config (GQA with a fused
``kv_einsum``, a fused ``gating_einsum``, (1 + w) RMSNorms), checked in a process of its own
(``gemma_worker.py``): importing ``gemma.gm`` replaces flax's ``nn.Module.param`` process-wide,
which would change every other model built in this process."""

import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import pytest

import zoo_oracle

pytestmark = pytest.mark.heavy  # run by .ci/run (pytest -m heavy), not by default

if importlib.util.find_spec("gemma") is None:  # not imported here: see above
  pytest.skip("the zoo extra is not installed: pip install -e '.[zoo]'", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 600  # seconds; about 1-2 minutes on the 2-core CI machine


@functools.cache
def results() -> dict:
  scratch = tempfile.mkdtemp(prefix="zoo_gemma_")
  out = os.path.join(scratch, "result.json")
  root = os.path.dirname(os.path.dirname(HERE))
  env = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join(
      [root, HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    ),
  )
  run = subprocess.run(
    [sys.executable, os.path.join(HERE, "gemma_worker.py"), out, scratch],
    env=env,
    capture_output=True,
    text=True,
    timeout=TIMEOUT,
  )
  assert run.returncode == 0 and os.path.exists(out), run.stderr[-4000:]
  with open(out) as f:
    return json.load(f)


@pytest.mark.parametrize("check", list(zoo_oracle.CHECKS))
def test_gemma_package(check):
  outcome = results()["checks"][check]
  if outcome != "ok":
    pytest.fail(outcome, pytrace=False)
