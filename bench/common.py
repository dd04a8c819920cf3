"""Model sizes and timing helpers shared by the benchmarks in this folder.

Every benchmark compiles each variant first, then times them in alternating
rounds in one process (a, b, c, b, c, a, c, a, b, ...), so drift in machine
load hits all of them alike, and reports the median over rounds of per-round
ratios to baselines.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax

# The harness is a folder of the repository, not an installed package: a script's own folder
# is on sys.path, the repository root is not.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from harness import lm  # noqa: E402

SIZES = {
  # d_model, layers, heads, kv heads, head_dim, mlp hidden, seq, batch
  "cpu": dict(
    d_model=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    mlp_hidden=688,
    seq_len=64,
    batch=8,
  ),
  "gpt2": dict(
    d_model=768,
    num_layers=12,
    num_heads=12,
    num_kv_heads=12,
    head_dim=64,
    mlp_hidden=2048,
    seq_len=1024,
    batch=16,
  ),
}


def default_size() -> str:
  """``gpt2`` on a GPU, ``cpu`` elsewhere."""
  return "gpt2" if jax.default_backend() == "gpu" else "cpu"


def device_name() -> str:
  """The accelerator's kind, or on the CPU backend the host CPU's model and core count:
  CPU figures differ between machines of the same size (memory- or compute-bound)."""
  if jax.default_backend() != "cpu":
    return jax.devices()[0].device_kind
  try:
    with open("/proc/cpuinfo") as f:
      info = dict(
        line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line
      )
    info = {k.strip(): v.strip() for k, v in info.items()}
    model = (
      f"{info['model name']}, family {info.get('cpu family', '?')} model {info.get('model', '?')}"
    )
  except (OSError, KeyError):
    model = platform.processor() or platform.machine()
  return f"{model}, {os.cpu_count()} cores"


def commit() -> str:
  """The repository's commit (``git rev-parse --short HEAD``), ``+changes`` where tracked
  files differ from it (figures measured there belong to no commit), or ``unknown`` outside
  a git checkout."""
  root = pathlib.Path(__file__).resolve().parents[1]

  def git(*args: str) -> str:
    command = ["git", "-C", str(root), *args]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()

  try:
    changed = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short", "HEAD") + ("+changes" if changed else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def provenance() -> str:
  """What a figure was measured on: the commit, the CPU or GPU, and the JAX version."""
  return f"commit {commit()}, {device_name()}, jax {jax.__version__}"


def setup(size: str, seed: int = 0):
  """``(config, graphdef, params, batch_size)`` of a ``SIZES`` entry, and a banner line."""
  sizes = dict(SIZES[size])
  batch = sizes.pop("batch")
  config = lm.ModelConfig(**sizes)
  graphdef, params = lm.init_model(config, seed=seed)
  print(
    f"{provenance()}\nbackend {jax.default_backend()}, size {size}:"
    f" {lm.num_params(params) / 1e6:.1f}M params, batch {batch}x{config.seq_len}"
  )
  return config, graphdef, params, batch


def fake_grads(params: Any, scale: float = 1e-3) -> Any:
  """Random gradients shaped like ``params`` (one key per leaf)."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  return jax.tree.unflatten(
    treedef, [scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  )


def random_tokens(batch: int, seq_len: int) -> jax.Array:
  """A (batch, seq_len + 1) window of random bytes, as ``train_step`` takes."""
  return jax.random.randint(jax.random.key(2), (batch, seq_len + 1), 0, lm.VOCAB_SIZE)


def make_opt_step(tx: optax.GradientTransformation):
  """The optimizer alone: ``(params, opt_state, grads) -> (params, opt_state, 0)``, jitted."""

  def opt_step(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jnp.zeros(())

  return jax.jit(opt_step, donate_argnums=(0, 1))


@contextlib.contextmanager
def skipping(opaque: bool = False):
  """A context in which every ``lax.cond`` traced is its second branch alone: the
  update that ``every`` skips, without the cond (and the norms' scale-safe pass, which
  ordinary weights skip). With ``opaque`` that branch's result passes an optimization
  barrier, so that XLA cannot fold the factors' ones away and the multiply by them is
  left in. JAX's trace caches are cleared on entry and exit, so that a nested ``jax.jit``
  traced before (the norms') is traced again inside, and what was traced inside is not
  reused after."""

  def cond(pred, true_fun, false_fun, *operands, **kwargs):
    del pred, true_fun, kwargs
    out = false_fun(*operands)
    return jax.lax.optimization_barrier(out) if opaque else out

  jax.clear_caches()
  try:
    with mock.patch.object(jax.lax, "cond", cond):
      yield
  finally:
    jax.clear_caches()


def update_cost(steps_fn: Callable, tx: optax.GradientTransformation, params: Any, arg: Any):
  """XLA's cost analysis of the compiled ``steps_fn(tx)``: ``(bytes accessed, flops)``."""
  compiled = steps_fn(tx).lower(params, tx.init(params), arg).compile()
  analysis = compiled.cost_analysis()
  return float(analysis["bytes accessed"]), float(analysis["flops"])


def bytes_accessed(
  steps_fn: Callable,
  txs: Mapping[str, optax.GradientTransformation],
  params: Any,
  arg: Any,
  base: str = "adamw",
) -> dict[str, float]:
  """Prints XLA's "bytes accessed" of each compiled ``steps_fn(tx)`` as a ratio to ``base``'s.

  Deterministic, unlike wall-clock time. XLA charges a ``lax.cond`` with its
  costliest branch and a ``lax.while_loop`` with one run of its body, so the
  update as compiled counts every=100's balancing branch in full and the norms'
  scale-safe pass (one ``lax.cond`` for the ordinary leaves, whose branch ordinary
  weights skip: one more read of every declared leaf). The second figure traces every
  ``lax.cond`` as its second branch: an update that ``every`` skips, and for every=1
  the update that runs on ordinary weights (the plain sums of squares alone).
  """

  compiled = {name: update_cost(steps_fn, tx, params, arg)[0] for name, tx in txs.items()}
  with skipping():
    skipped = {name: update_cost(steps_fn, tx, params, arg)[0] for name, tx in txs.items()}
  width = max(map(len, txs))
  print(
    f"\nXLA cost analysis of the compiled update: bytes accessed, ratio vs {base}\n"
    f"  {'':<{width}} {'as compiled':>22}   {'an update that skips':>22}"
  )
  for name in txs:
    print(
      f"  {name:<{width}} {compiled[name] / 2**20:9.2f} MiB  {compiled[name] / compiled[base]:6.3f}"
      f"   {skipped[name] / 2**20:9.2f} MiB  {skipped[name] / skipped[base]:6.3f}"
    )
  return compiled


def round_ratios(times: Sequence[float], base: Sequence[float]) -> tuple[float, float, float]:
  """The first quartile, median and third quartile of the per-round ratios ``times / base``:
  a round's variants ran back to back, so their ratio is what drift in machine load
  disturbs least."""
  q1, q2, q3 = np.percentile(np.divide(times, base), (25, 50, 75))
  return float(q1), float(q2), float(q3)


def time_round(step, carry, arg, steps):
  """Runs ``steps`` consecutive steps; returns the new carry and seconds per step."""
  params, opt_state = carry
  start = time.perf_counter()
  for _ in range(steps):
    params, opt_state, out = step(params, opt_state, arg)
  jax.block_until_ready((params, opt_state, out))
  return (params, opt_state), (time.perf_counter() - start) / steps


def bench(
  kind: str,
  steps_fn: Callable,
  txs: Mapping[str, optax.GradientTransformation],
  params: Any,
  arg: Any,
  rounds: int,
  steps: int,
  bases: Sequence[str] = ("adamw",),
  round_seconds: float | None = None,
) -> dict[str, float]:
  """Times ``steps_fn(tx)`` for every ``tx`` in alternating rounds; prints the
  median seconds per step and, against each of ``bases``, the median and
  quartiles of the per-round ratios (a round's variants ran back to back, so
  their ratio is what drift in machine load disturbs least). Returns the
  medians.

  A round runs ``steps`` consecutive steps of each variant; with
  ``round_seconds``, a variant runs about that long per round instead (one
  warm step timed after compilation sets its count; at least 1, at most
  ``steps``), so a slow variant does not stretch the whole benchmark.
  """
  carries, steppers, counts = {}, {}, {}
  for name, tx in txs.items():
    steppers[name] = steps_fn(tx)
    state = (jax.tree.map(jnp.copy, params), lm.donatable_copy(tx.init(params)))
    carries[name], _ = time_round(steppers[name], state, arg, 2)  # compile + warm up
    counts[name] = steps
    if round_seconds:
      carries[name], t = time_round(steppers[name], carries[name], arg, 1)
      counts[name] = int(np.clip(round(round_seconds / t), 1, steps))
  times = {name: [] for name in txs}
  names = list(txs)
  for r in range(rounds):
    # Each round starts one variant later, so no variant always runs first or
    # always follows the same neighbour (both shift timings by a few percent).
    for name in names[r % len(names) :] + names[: r % len(names)]:
      carries[name], t = time_round(steppers[name], carries[name], arg, counts[name])
      times[name].append(t)
  medians = {name: float(np.median(ts)) for name, ts in times.items()}
  width = max(map(len, txs))
  same = len(set(counts.values())) == 1
  print(
    f"\n{kind}: median of {rounds} alternating rounds"
    + (f" x {steps} steps" if same else " (steps per round in brackets)")
    + "; ratios are medians of per-round ratios [quartiles]"
  )
  for name, med in medians.items():
    ratios = []
    for base in bases:
      q1, q2, q3 = round_ratios(times[name], times[base])
      ratios.append(f"ratio vs {base} {q2:.3f} [{q1:.2f}-{q3:.2f}]")
    count = "" if same else f" [{counts[name]:>3}]"
    print(f"  {name:<{width}}{count} {med * 1e3:9.3f} ms   " + "   ".join(ratios))
  return medians
