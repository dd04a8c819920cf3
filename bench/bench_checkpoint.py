"""Time and peak memory of saggs.checkpoint.save/restore against plain Orbax.

The state is ``--layers`` up/down pairs of ``--width``-square float32 matrices
(the default, 6 layers of 4096, is 201M parameters: a 2.4 GB AdamW state),
trained by ``saggs.chain(optax.adamw, saggs.saggs(pairs, every=100))`` and
given random moments. Each measurement runs in a fresh process (so its peak
RSS is its own), in alternating order (saggs, Orbax, Orbax, saggs, ...) over
``--rounds`` rounds, and prints per operation the median wall time and peak
RSS of each, their ratio, and the peak difference as a share of the state:

* ``save``: ``saggs.checkpoint.save`` (layout and checksums included) against
  ``manager.save(step, args=StandardSave(state))``, each with
  ``wait_until_finished``;
* ``restore``: ``saggs.checkpoint.restore(..., pairs, tx=tx)`` (checksums
  verified, canonicalised by the degrees measured on ``tx``) against
  ``manager.restore(step, args=StandardRestore(abstract))``; ``restore-raw`` is
  the saggs restore with ``canonicalize=False`` (against the same Orbax restore).
  The degrees are measured by a probe history on the parameters' shapes
  (``saggs._src.degrees.measure``), whose cost ``restore`` includes: ``--ops
  restore-raw`` leaves it out.

Targets are abstract (``jax.ShapeDtypeStruct``) on both sides, as a restart
builds them (``jax.eval_shape(tx.init, params)``).

  python bench/bench_checkpoint.py                        # 201M parameters, 3 rounds
  python bench/bench_checkpoint.py --ops restore-raw      # without canonicalising
  python bench/bench_checkpoint.py --layers 2 --rounds 1  # a quick look
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def build(width: int, layers: int):
  import jax
  import jax.numpy as jnp
  import optax

  import saggs_jax as saggs

  pairs = [saggs.Pair("*/up", "*/down", axes=(1, 0))]
  tx = saggs.chain(optax.adamw(1e-3), saggs.saggs(pairs, every=100))
  shape = jax.ShapeDtypeStruct((width, width), jnp.float32)
  abstract_params = {str(i): {"up": shape, "down": shape} for i in range(layers)}
  abstract_state = jax.eval_shape(tx.init, abstract_params)
  return pairs, tx, abstract_params, abstract_state


def state(width: int, layers: int):
  """Concrete params and a chain state with moments drawn at random (on the device)."""
  import jax
  import jax.numpy as jnp

  _, _, abstract_params, abstract_state = build(width, layers)
  key = iter(jax.random.split(jax.random.key(0), 6 * layers + 8))

  def draw(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return jnp.zeros(x.shape, x.dtype)
    return jnp.abs(jax.random.normal(next(key), x.shape, x.dtype)) + 0.1

  return jax.tree.map(draw, abstract_params), jax.tree.map(draw, abstract_state)


def child(op: str, kind: str, directory: str, width: int, layers: int) -> dict:
  import jax
  import orbax.checkpoint as ocp

  import saggs_jax as saggs

  pairs, tx, abstract_params, abstract_state = build(width, layers)
  manager = ocp.CheckpointManager(directory)
  if op == "save":
    params, opt_state = state(width, layers)
    jax.block_until_ready((params, opt_state))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if kind == "saggs":
      saggs.checkpoint.save(manager, 1, params, opt_state)
    else:
      manager.save(1, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
    manager.wait_until_finished()
  else:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
      (abstract_params, abstract_state),
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if kind == "saggs":
      out = saggs.checkpoint.restore(
        manager, target[0], target[1], pairs, canonicalize=op == "restore", tx=tx
      )[:2]
    else:
      items = {"params": target[0], "opt_state": target[1]}
      out = manager.restore(1, args=ocp.args.StandardRestore(items))
    jax.block_until_ready(out)
  seconds = time.perf_counter() - start
  manager.close()
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return {"seconds": seconds, "peak_gb": peak / 2**20, "before_gb": before / 2**20}


def run(op, kind, directory, args) -> dict:
  command = [sys.executable, __file__, "--child", op, kind, str(directory)]
  command += ["--width", str(args.width), "--layers", str(args.layers)]
  out = subprocess.run(command, check=True, capture_output=True, text=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main():
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--width", type=int, default=4096)
  parser.add_argument("--layers", type=int, default=6)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument(
    "--ops",
    nargs="+",
    default=["restore", "restore-raw"],
    choices=["restore", "restore-raw"],
    help="the restores to time (saving is always timed)",
  )
  parser.add_argument("--child", nargs=3, metavar=("OP", "KIND", "DIR"), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    op, kind, directory = args.child
    print(json.dumps(child(op, kind, directory, args.width, args.layers)))
    return
  params = 2 * args.layers * args.width**2
  state_gb = 3 * 4 * params / 2**30  # params, mu, nu
  print(f"{params / 1e6:.0f}M float32 parameters, AdamW state {state_gb:.2f} GiB")
  root = pathlib.Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
  results = {}
  try:
    for r in range(args.rounds):
      order = ("saggs", "orbax") if r % 2 == 0 else ("orbax", "saggs")
      for kind in order:
        directory = root / kind
        shutil.rmtree(directory, ignore_errors=True)
        results.setdefault(("save", kind), []).append(run("save", kind, directory, args))
      for op in args.ops:
        for kind in order if op == "restore" or "restore" not in args.ops else ("saggs",):
          results.setdefault((op, kind), []).append(run(op, kind, root / kind, args))
  finally:
    shutil.rmtree(root, ignore_errors=True)

  def median(op, kind, key):
    return statistics.median(x[key] for x in results[(op, kind)])

  print(
    f"{'':12} {'saggs s':>8} {'Orbax s':>8} {'ratio':>6} {'saggs GiB':>10} {'Orbax GiB':>10}"
    f" {'diff/state':>10}"
  )
  for op in ("save", *args.ops):
    t, m = median(op, "saggs", "seconds"), median(op, "saggs", "peak_gb")
    base = "save" if op == "save" else next(o for o in args.ops if (o, "orbax") in results)
    t0, m0 = median(base, "orbax", "seconds"), median(base, "orbax", "peak_gb")
    print(
      f"{op:12} {t:8.2f} {t0:8.2f} {t / t0:6.2f} {m:10.2f} {m0:10.2f} {(m - m0) / state_gb:10.3f}"
    )


if __name__ == "__main__":
  main()
