"""Every Python block of README.md and docs/ runs as written, and the API page is complete.

Blocks with ``>>>`` prompts are doctests, run by
``python -m pytest --doctest-glob='*.md' docs`` (see ``.ci/run``). The other
Python blocks are scripts: each page's scripts run here, concatenated in page
order, in a fresh CPU process. ``docs/multi_host.md`` runs as two processes
of a SLURM job step on this machine, which ``jax.distributed.initialize()``
joins with no arguments.
"""

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

from xla_env import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MULTI_HOST = ROOT / "docs" / "multi_host.md"
TIMEOUT = 600
# A fence and its info string: ```python, ```{code-block} python, ```pycon, ...
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(page: pathlib.Path) -> list[str]:
  # A MyST directive's options (":caption: ...") open its block; they are not code.
  return [
    re.sub(r"\A(:\w[\w-]*:.*\n)+", "", code) if info.startswith("{") else code
    for info, code in FENCE.findall(page.read_text())
    if re.search(r"\b(python|py|pycon)\b", info)
  ]


def script(page: pathlib.Path) -> str:
  return "\n".join(b for b in python_blocks(page) if ">>>" not in b)


def name(page: pathlib.Path) -> str:
  return str(page.relative_to(ROOT))


def snippet_env(devices: int, **extra: str) -> dict[str, str]:
  return cpu_env(devices, PYTHONPATH=str(ROOT), **extra)


def run(command, env, cwd) -> subprocess.Popen:
  return subprocess.Popen(
    command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )


def finish(processes) -> list[str]:
  """Waits for every process (ending all of them on a timeout) and returns their outputs."""
  outputs = []
  try:
    for process in processes:
      outputs.append(process.communicate(timeout=TIMEOUT)[0])
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
        process.wait()
  for process, output in zip(processes, outputs):
    assert process.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]  # e.g. an unclosed manager's at exit
  return outputs


SCRIPT_PAGES = [p for p in PAGES if script(p) and p != MULTI_HOST]


def test_readme_and_every_guide_have_checked_python():
  assert script(ROOT / "README.md"), "README.md lost its runnable tour"
  assert script(MULTI_HOST)
  for page in PAGES:
    for block in python_blocks(page):
      # A block mixing prompts and plain lines would run only in part.
      if ">>>" in block:
        assert block.lstrip().startswith(">>>"), f"{name(page)}: doctest block with a preamble"


@pytest.mark.parametrize("page", SCRIPT_PAGES, ids=name)
def test_page_scripts_run(page, tmp_path):
  file = tmp_path / "snippet.py"
  file.write_text(script(page))
  finish(
    [
      run(
        [sys.executable, str(file)],
        snippet_env(8),
        tmp_path,
      )
    ]
  )


def free_port_in(low: int, high: int) -> int:
  for port in range(low, high):
    with socket.socket() as s:
      try:
        s.bind(("localhost", port))
      except OSError:
        continue
      return port
  raise RuntimeError(f"no free port in [{low}, {high})")


@pytest.mark.heavy  # a two-process job, as tests/test_multiprocess.py: run by .ci/run
def test_multi_host_guide_runs_as_two_processes(tmp_path):
  file = tmp_path / "multi_host.py"
  file.write_text(script(MULTI_HOST))
  # jax's SLURM detection puts the coordinator on port SLURM_JOB_ID % 4096 + 61440.
  port = free_port_in(61440 + os.getpid() % 2048, 65536)
  env = snippet_env(
    2,
    JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
    SLURM_JOB_ID=str(port - 61440),
    SLURM_STEP_NODELIST="localhost",
    SLURM_NTASKS="2",
    CHECKPOINT_DIR=str(tmp_path / "checkpoints"),
  )
  outputs = finish(
    [
      run(
        [sys.executable, str(file)],
        {**env, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)},
        tmp_path,
      )
      for i in range(2)
    ]
  )
  found = [re.findall(r"process (\d): step 20, loss (\S+), restored \S+", o) for o in outputs]
  assert all(len(f) == 1 for f in found), outputs
  assert sorted(f[0][0] for f in found) == ["0", "1"]
  assert len({f[0][1] for f in found}) == 1  # both hosts computed the one global loss


def test_the_readme_stays_short():
  """What a researcher reads first: what it is, the two commands, the tour, one table, links;
  the measurements live in docs/ (benchmarks, pod scale, study, development)."""
  size = (ROOT / "README.md").stat().st_size
  assert size < 10_000, f"README.md is {size} bytes; move measurements to docs/"
