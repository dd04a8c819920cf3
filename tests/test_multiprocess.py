"""Multi-process training, the path of a TPU pod or multi-host GPU job, on local CPU processes.

Two processes with 4 CPU devices each join one ``jax.distributed`` job (gloo
collectives), shard a tiny LLaMA FSDP-style over all 8 devices, train it with
``saggs.chain(optax.adamw(...), saggs.saggs(pairs))`` and save it with
``saggs.checkpoint``, once as it is and once reciprocally rescaled. Two fresh
processes restore both (canonicalized) and train on. The final parameters must
match a single process running the same trajectory on 8 devices. A second
job trains with ``saggs.saggs(pairs, every=2)`` in a jitted full step on an
Auto and an Explicit mesh: its skipped updates run the gradient's collectives
beside a ``lax.cond`` branch that communicates nothing, and must match the
same run on one device. A third trains ``head_axis_llama.py`` in the setup where skipped
updates once aborted both processes in gloo (a later collective overtook a ``lax.cond``'s,
see :func:`saggs_jax._src.numerics.ordered_control_flow`). What each process does is in
``multiprocess_worker.py``.
"""

import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import models
from multiprocess_worker import order_start
from xla_env import cpu_env

pytestmark = pytest.mark.heavy  # run by .ci/run (pytest -m heavy), not by default

WORKER = pathlib.Path(__file__).with_name("multiprocess_worker.py")
TIMEOUT = 300  # seconds for the whole test; a few dozen on an idle 2-core machine


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def start(role, num_processes, directory, started, **env):
  """Starts the processes of one job, appending ``(name, Popen)`` to ``started`` at once;
  ``env`` adds or replaces variables of their environment."""
  port, job = free_port(), []
  env = cpu_env(8 // num_processes, **{"WORKER_TIMEOUT": str(TIMEOUT), **env})
  for i in range(num_processes):
    with open(directory / f"{role}{i}.log", "w") as log:
      command = [
        sys.executable,
        str(WORKER),
        role,
        str(i),
        str(num_processes),
        str(port),
        str(directory),
      ]
      job.append(
        (f"{role}{i}", subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
      )
    started.append(job[-1])
  return job


def wait(job, deadline, directory):
  for name, process in job:
    try:
      code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      code = None
    if code != 0:
      log = (directory / f"{name}.log").read_text().splitlines()
      status = "timed out" if code is None else f"exited with {code}"
      pytest.fail(
        f"{name} {status}; the end of its log:\n"
        + "\n".join(line for line in log[-40:] if not line.startswith("[Gloo]"))
      )


def stop(started):
  """Kills every process of ``started`` still running: none outlives its test."""
  for _, process in started:
    if process.poll() is None:
      process.kill()
      process.wait()


def assert_same_params(got, want, what):
  assert sorted(set(got) - {"balanced"}) == sorted(set(want) - {"balanced"})
  for k in set(want) - {"balanced"}:
    np.testing.assert_allclose(
      got[k], want[k], rtol=1e-5, atol=1e-5 * np.max(np.abs(want[k])), err_msg=f"{what}: {k}"
    )


def test_multiprocess_training_restores_and_matches_one_process(tmp_path):
  deadline, started = time.monotonic() + TIMEOUT, []
  try:
    train = start("train", 2, tmp_path, started)
    reference = start("reference", 1, tmp_path, started)
    wait(train, deadline, tmp_path)
    wait(start("resume", 2, tmp_path, started), deadline, tmp_path)
    wait(reference, deadline, tmp_path)
  finally:
    stop(started)

  want = np.load(tmp_path / "reference.npz")
  initial = dict(models.leaf_dict(models.llama_init(0)))
  assert max(np.max(np.abs(want[k] - initial[k])) for k in want) > 1e-2  # it trained
  for variant in ("plain", "rescaled"):
    assert_same_params(np.load(tmp_path / f"{variant}.npz"), want, variant)


def test_multiprocess_skipped_updates_in_a_full_step_match_one_device(tmp_path):
  started = []
  try:
    wait(start("every", 2, tmp_path, started), time.monotonic() + TIMEOUT, tmp_path)
  finally:
    stop(started)

  want = np.load(tmp_path / "every-oracle.npz")
  initial = dict(models.leaf_dict(models.llama_init(0)))
  assert max(np.max(np.abs(want[k] - initial[k])) for k in initial) > 1e-2  # it trained
  for kind in ("Auto", "Explicit"):
    got = np.load(tmp_path / f"every-{kind}.npz")
    # Updates 1 and 3 balanced (some factor differs from 1), 2 and 4 were skipped.
    assert got["balanced"].tolist() == want["balanced"].tolist() == [True, False, True, False]
    assert_same_params(got, want, kind)


def test_multiprocess_collectives_keep_their_order(tmp_path):
  """Eager init, FSDP on each leaf's first axis that divides, each process making its
  batch: SAGGS on every 2nd update (hard and soft) and on every update. XLA:CPU lets a
  later collective overtake those inside a ``lax.cond`` (gloo then aborts both processes:
  "collective mismatch"); each run must instead match the same run on one device."""
  started = []
  try:
    # XLA's default CPU code generation: the fast-compile flags schedule the step otherwise.
    flags = "--xla_force_host_platform_device_count=4"
    job = start("order", 2, tmp_path, started, XLA_FLAGS=flags, WORKER_TIMEOUT=str(2 * TIMEOUT))
    wait(job, time.monotonic() + 2 * TIMEOUT, tmp_path)
  finally:
    stop(started)

  initial = models.leaf_dict(order_start())
  for name in ("every2", "soft2", "every1"):
    want = np.load(tmp_path / f"order-{name}-oracle.npz")
    assert max(np.max(np.abs(want[k] - initial[k])) for k in initial) > 1e-2  # it trained
    assert_same_params(np.load(tmp_path / f"order-{name}.npz"), want, name)
