"""What overlapping pairs cost before the first step: the first update's compile, and the first
canonicalising restore, against AdamW's and Orbax's.

The model is the harness's nnx decoder at about 39k parameters (d 32, 2 layers, 4 heads over
2 KV heads, head_dim 8, MLP 86), its pairs those ``saggs.discover`` proposes by default: Q/K,
V/O, up/down and three norm gains, which overlap Q/K, V/O and up/down and so take the joint
solve (:func:`saggs_jax._src.balance.solve`). ``(5 without norm gains)`` is the same model with the
three non-overlapping pairs alone.

``--part update``: the train step (loss, gradients and the update, as
``harness.lm.make_train_step`` builds it) lowered and compiled from a chain built afresh, JAX's
caches cleared first, so each compile is a new user's first: AdamW, hard SAGGS ``every=1`` with
the discovered pairs, and with the non-overlapping ones alone, in alternating rounds (each round
starting one variant later). Printed: the medians of lower + compile in process CPU seconds
(wall clock on a shared machine is noisier) and the median [quartiles] of the per-round ratios
to AdamW's. Also printed: the jaxpr equations (nested ones counted) of the joint solve, a
deterministic measure of what XLA has to compile, which ``tests/test_update_cost.py`` bounds.

``--part restore``: ``saggs.checkpoint.restore(manager, params, opt_state, pairs, tx=tx)``
(canonicalising by the degrees measured on ``tx``, a chain built afresh as a restart builds
it), the same with ``canonicalize=False``, and Orbax's ``StandardRestore`` of the same state,
each in a fresh process (so nothing is compiled or cached before it), in alternating order:
the restore call alone is timed (wall seconds), from abstract targets, after imports and
building the model. Printed: medians and the median [quartiles] of per-round ratios to Orbax's.
A fourth variant is the canonicalising restore in a fresh process whose JAX persistent
compilation cache (``jax_compilation_cache_dir``, JAX's other settings at their defaults) a
restore in an earlier process filled, as on a restart of a run that keeps one.

``--part pieces``: the update's parts compiled alone (the norms, the joint solve or the closed
form, both), with and without the norm gains: where the first step's compile goes.

  python bench/bench_compile.py --part update --rounds 7
  python bench/bench_compile.py --part pieces --rounds 3
  python bench/bench_compile.py --part restore --rounds 5
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax

import common  # also puts the repository root on sys.path, for harness
import saggs_jax as saggs
from harness import lm
from saggs_jax._src import balance, norms, paths
from saggs_jax._src.plan import resolve

CONFIG = dict(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_hidden=86)
BATCH = (4, 17)  # a window of 16 tokens and its next ones


def model(num_layers: int = CONFIG["num_layers"]):
  config = lm.ModelConfig(**{**CONFIG, "num_layers": num_layers}, seq_len=BATCH[1] - 1)  # pyright: ignore[reportArgumentType]
  return lm.init_model(config)


def discovered(graphdef, params) -> tuple[saggs.Pair, ...]:
  """The pairs ``saggs.discover`` proposes by default."""
  tokens = jnp.zeros((2, 16), jnp.int32) + jnp.arange(16)
  return saggs.discover(lambda p, t: lm.forward(graphdef, p, t), params, tokens).pairs


def without_norm_gains(pairs):
  return tuple(p for p in pairs if p.name != "norm gain")


def adamw():
  return optax.adamw(1e-3, weight_decay=0.1)


def compile_seconds(graphdef, params, batch, make_tx) -> float:
  """Process CPU seconds of lowering and compiling the train step of ``make_tx()``, built
  afresh after JAX's caches are cleared (a first compile, as in a fresh process)."""
  jax.clear_caches()
  tx = make_tx()
  state = jax.eval_shape(tx.init, params)
  step = lm.make_train_step(graphdef, tx)  # a new tx: a new jitted function
  start = time.process_time()
  step.lower(params, state, batch).compile()
  return time.process_time() - start


def count_eqns(jaxpr) -> int:
  """Equations of a (closed) jaxpr, those of every nested jaxpr (loops, conds, calls) included."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  n = 0
  for eqn in jaxpr.eqns:
    n += 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
          n += count_eqns(sub)
  return n


def solve_eqns(pairs, params) -> int:
  """The jaxpr equations of the balancing factors' solve (the norms excluded)."""
  plan = resolve(pairs, params)
  stats = jax.eval_shape(lambda p: norms.leaf_stats(plan, p), params)
  dtypes = {path: x.dtype for path, x in paths.arrays_with_paths(params)}
  return count_eqns(jax.make_jaxpr(lambda s: balance.solve(plan, s, dtypes, 1.0))(stats))


def part_update(rounds: int) -> None:
  graphdef, params = model()
  pairs = discovered(graphdef, params)
  plain = without_norm_gains(pairs)
  batch = jax.ShapeDtypeStruct(BATCH, jnp.int32)
  print(
    f"{lm.num_params(params)} parameters; {len(pairs)} pairs discovered, {len(plain)} without"
    f" norm gains; jaxpr equations of the solve: {solve_eqns(pairs, params)} with the norm gains"
    f" (joint), {solve_eqns(plain, params)} without"
  )
  variants = {
    "adamw": adamw,
    "saggs, discovered pairs": lambda: saggs.chain(adamw(), saggs.saggs(pairs, every=1)),
    f"saggs, {len(plain)} without norm gains": lambda: saggs.chain(
      adamw(), saggs.saggs(plain, every=1)
    ),
  }
  names = list(variants)
  times = {name: [] for name in names}
  for r in range(rounds):
    for name in names[r % len(names) :] + names[: r % len(names)]:
      times[name].append(compile_seconds(graphdef, params, batch, variants[name]))
  print(
    f"\nfirst train step, lower + compile (CPU s): median of {rounds} alternating rounds;"
    " ratios are medians of per-round ratios [quartiles]"
  )
  width = max(map(len, names))
  for name in names:
    q1, q2, q3 = common.round_ratios(times[name], times["adamw"])
    print(
      f"  {name:<{width}} {np.median(times[name]):7.2f} s   ratio vs adamw {q2:.2f} [{q1:.2f}-{q3:.2f}]"
    )


def part_pieces(rounds: int) -> None:
  """The update's parts compiled alone (the norms, the solve, both), with the discovered pairs
  and without the norm gains: process CPU seconds of lower + compile, median of ``rounds``, and
  the kernels (fusions) of the compiled program."""
  graphdef, params = model()
  pairs = discovered(graphdef, params)
  dtypes = {path: x.dtype for path, x in paths.arrays_with_paths(params)}
  print("\nthe update's parts alone, lower + compile (CPU s, median) and kernels")
  for name, ps in (("discovered pairs", pairs), ("without norm gains", without_norm_gains(pairs))):
    plan = resolve(ps, params)
    stats = jax.eval_shape(lambda p, plan=plan: norms.leaf_stats(plan, p), params)
    parts = {
      "norms": (lambda p, plan=plan: norms.leaf_stats(plan, p), params),
      "solve": (lambda s, plan=plan: balance.solve(plan, s, dtypes, 1.0), stats),
      "norms + solve": (lambda p, plan=plan: balance.compute_factors(plan, p, 1.0), params),
    }
    for part, (fn, arg) in parts.items():
      seconds = []
      for _ in range(rounds):
        jax.clear_caches()
        start = time.process_time()
        compiled = jax.jit(fn).lower(arg).compile()
        seconds.append(time.process_time() - start)
      kernels = compiled.as_text().count(" fusion(")
      print(f"  {name:<18} {part:<13} {np.median(seconds):5.2f} s  {kernels:4d} kernels")


def child(kind: str, directory: str) -> float:
  """One restore in this fresh process; its wall seconds."""
  import orbax.checkpoint as ocp

  if kind == "saggs-cached":  # before anything compiles
    jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(directory).parent / "cache"))
  graphdef, params = model()
  pairs = discovered(graphdef, params)
  tx = saggs.chain(adamw(), saggs.saggs(pairs, every=100))
  manager = ocp.CheckpointManager(directory)
  if kind in ("save", "save-orbax"):  # saggs's layout for the saggs restores, Orbax's alone
    if kind == "save":
      saggs.checkpoint.save(manager, 1, params, tx.init(params))
    else:
      state = {"params": params, "opt_state": tx.init(params)}
      manager.save(1, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    manager.close()
    return 0.0
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
    (params, jax.eval_shape(tx.init, params)),
  )
  start = time.perf_counter()
  if kind == "orbax":
    items = {"params": target[0], "opt_state": target[1]}
    out = manager.restore(1, args=ocp.args.StandardRestore(items))
  else:
    out = saggs.checkpoint.restore(
      manager, target[0], target[1], pairs, canonicalize=kind == "saggs", tx=tx
    )[:2]
  jax.block_until_ready(out)
  seconds = time.perf_counter() - start
  manager.close()
  return seconds


def run(kind: str, directory) -> float:
  command = [sys.executable, __file__, "--child", kind, str(directory)]
  out = subprocess.run(command, check=True, capture_output=True, text=True)
  return float(json.loads(out.stdout.strip().splitlines()[-1]))


def part_restore(rounds: int) -> None:
  root = pathlib.Path(tempfile.mkdtemp(prefix="bench-compile-"))
  names = ["orbax", "saggs", "saggs-raw", "saggs-cached"]
  labels = {
    "orbax": "Orbax StandardRestore",
    "saggs": "saggs restore, canonicalising",
    "saggs-raw": "saggs restore, canonicalize=False",
    "saggs-cached": "saggs restore, canonicalising, JAX's compilation cache warm",
  }
  times = {name: [] for name in names}
  try:
    run("save", root / "saggs")
    run("save-orbax", root / "orbax")
    run("saggs-cached", root / "saggs")  # fills the cache
    for r in range(rounds):
      for name in names[r % len(names) :] + names[: r % len(names)]:
        times[name].append(run(name, root / ("orbax" if name == "orbax" else "saggs")))
  finally:
    shutil.rmtree(root, ignore_errors=True)
  print(
    f"\nrestore in a fresh process (wall s): median of {rounds} alternating rounds;"
    " ratios are medians of per-round ratios [quartiles]"
  )
  width = max(map(len, labels.values()))
  for name in names:
    q1, q2, q3 = common.round_ratios(times[name], times["orbax"])
    print(
      f"  {labels[name]:<{width}} {statistics.median(times[name]):7.2f} s"
      f"   ratio vs Orbax {q2:.2f} [{q1:.2f}-{q3:.2f}]"
    )


def main():
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--part", choices=("update", "pieces", "restore", "both"), default="both")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--child", nargs=2, metavar=("KIND", "DIR"), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(child(*args.child)))
    return
  print(common.provenance())
  if args.part == "pieces":
    part_pieces(args.rounds)
    return
  if args.part != "restore":
    part_update(args.rounds)
  if args.part != "update":
    part_restore(args.rounds)


if __name__ == "__main__":
  main()
