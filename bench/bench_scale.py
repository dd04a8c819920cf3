"""SAGGS at LLaMA scale: init, the compiled update, canonicalize, checkpoints and discover,
each next to its plain optax / Orbax baseline measured in the same run.

Sizes: 1B, 7B and 70B LLaMA shapes (:mod:`harness.shapes`: GQA, SwiGLU,
head_dim 128, vocabulary 32000, float32) as abstract values (nothing allocated), and a
concrete ~170M model (d 1024, 8 layers) built briefly for the rows that need arrays.
The optimizer is ``saggs.chain(optax.adamw(1e-3), saggs.saggs(presets.llama(...),
every=100))`` against ``optax.adamw(1e-3)``.

Rows (each in a child process whose heap is capped by ``--memory-gib``, so a row that
would allocate parameter-sized host arrays fails alone, its error printed; the
checkpoint row, concrete only, is watched at ``--checkpoint-memory-gib`` instead, as
Orbax's threads cannot start under a heap cap):

* ``init``: wall time of ``jax.eval_shape(tx.init, params)`` and of
  ``jax.jit(tx.init, out_shardings=...).lower(params).compile()`` for FSDP parameters
  (Explicit) on 8 CPU devices under ``jax.set_mesh``, scanned and unrolled, for adamw,
  SAGGS, soft SAGGS, QK-clip and the equivariant stack, and the process's peak host memory
  after each (``tx.init(params)`` for the concrete model). A chain's init measures nothing:
  the transport degrees (:func:`saggs_jax._src.degrees.measure`, a probe on a small proxy) are
  measured where they are first used, the update's trace or a restore, and timed there.
* ``update``: the train step ``(params, state, grads) -> (params, state)`` lowered and
  compiled from abstract values: XLA's temp memory and bytes accessed (deterministic; the
  balancing branch as compiled), and lower + compile time (process CPU seconds, the median
  of alternating rounds, and the median [quartiles] of the per-round ratios to adamw's:
  wall clock on a shared machine is noisier), scanned and unrolled
  layers, with the chain's degrees already measured (the probe bypassed); and beside it
  the lower + compile of a first update, a chain built afresh whose lowering also measures
  the degrees (once per optimizer and layout) from the state it is given.
* ``fsdp``: the scanned update on 8 CPU devices, each leaf sharded along its largest axis
  under ``jax.set_mesh``: temp memory as a share of a device's parameter shard, and bytes.
* ``canonicalize``: ``jax.jit(canonicalize).lower(abstract).compile()``, without and with
  ``tx=`` (whose degrees are measured: the probe), its time and temp memory, against
  ``reparameterize`` (no norms).
* ``checkpoint`` (concrete only): ``saggs_jax.checkpoint.save`` / ``restore`` of the chain's
  state (which canonicalises, ``tx=`` a chain built afresh as a restart builds it, so that
  restore measures its degrees) against Orbax's ``StandardSave`` /
  ``StandardRestore`` of the same state (peak memory: ``bench/bench_checkpoint.py``).
* ``discover``: ``saggs.discover`` on a LLaMA forward pass (one sequence of 8 tokens): on
  abstract parameters traced only (``confirmation == "none"``), on the concrete model
  confirmed on its parameters, against tracing the forward pass alone.

Run (``--quick``: 1B and the concrete model, one round, scanned only):

  JAX_PLATFORMS=cpu python bench/bench_scale.py --sizes 1b,7b,70b,200m
  JAX_PLATFORMS=cpu python bench/bench_scale.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import common  # also puts the repository root on sys.path, for harness
import saggs_jax as saggs
from harness import shapes

CONCRETE = dict(d_model=1024, num_layers=8, num_kv_heads=8, mlp_hidden=2816)
SIZES = {**shapes.SIZES, "200m": CONCRETE}
ROWS = ("init", "update", "fsdp", "canonicalize", "checkpoint", "discover")


def adamw():
  return optax.adamw(1e-3)


def saggs_tx(size, stacked):
  pairs = saggs.presets.llama(num_kv_heads=SIZES[size]["num_kv_heads"], stacked=stacked)
  return saggs.chain(adamw(), saggs.saggs(pairs, every=100))


def peak_rss() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gib(n: float) -> str:
  return f"{n / 2**30:.2f} GiB"


def cpu_seconds(fn):
  start = time.process_time()
  out = fn()
  return out, time.process_time() - start


def alternating(fns: dict, rounds: int) -> dict:
  """``{name: (result, CPU seconds of each round)}`` over ``rounds`` alternating runs."""
  times = {name: [] for name in fns}
  results = {}
  names = list(fns)
  for r in range(rounds):
    for name in names[r % len(names) :] + names[: r % len(names)]:
      results[name], t = cpu_seconds(fns[name])
      times[name].append(t)
  return {name: (results[name], times[name]) for name in fns}


def versus(times, base) -> str:
  """Median seconds of ``times`` and its per-round ratio to ``base`` (median [quartiles])."""
  q1, q2, q3 = common.round_ratios(times, base)
  return f"{np.median(times):.2f} s ({q2:.2f}x [{q1:.2f}-{q3:.2f}])"


def compile_update(tx, params, state=None):
  """Temp memory and bytes accessed of the compiled step; ``state`` the abstract state, if
  the caller has it. A chain not yet updated measures its degrees in the lowering."""

  def step(p, s, g):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  state = jax.eval_shape(tx.init, params) if state is None else state
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()
  return compiled.memory_analysis().temp_size_in_bytes, compiled.cost_analysis()["bytes accessed"]


def first_degrees(params, tx, state):
  """The transport degrees of a chain, as its first update measures them from its ``state``
  (once per optimizer and layout)."""
  return tx.update.degrees(params, tx.update.stages[0].resolve(params), state)


# ----------------------------------------------------------------------------------
# Rows: each returns lines of its table.


def init_stages(size, scanned):
  """Builders of each optimizer whose init the init row measures, adamw first."""
  kv = SIZES[size]["num_kv_heads"]
  pairs = saggs.presets.llama(num_kv_heads=kv, stacked=1 if scanned else 0)
  return {
    "optax.adamw": adamw,
    "saggs": lambda: saggs.chain(adamw(), saggs.saggs(pairs, every=100)),
    "soft": lambda: saggs.chain(adamw(), saggs.soft(pairs, strength=0.5)),
    "qk_clip": lambda: saggs.chain(adamw(), saggs.qk_clip(pairs[:1], tau=100.0)),
    "stack": lambda: saggs.equivariant.symmetry_compatible(
      1e-3,
      preset="reference",
      decoder=saggs.equivariant.Decoder(num_kv_heads=kv, head_dim=128, stacked=scanned),
    ),
  }


def row_init(size, args):
  if size == "200m":  # concrete: tx.init(params) on arrays
    return row_init_concrete(size, args)
  # Abstract FSDP parameters (Explicit, each leaf along its largest axis) on 8 devices under
  # jax.set_mesh: eval_shape(tx.init), then jit(tx.init, out_shardings=...) lowered and
  # compiled, each optimizer built afresh (its degrees not yet measured). Peak memory is the
  # process's after each stage, adamw's first: a later stage's excess over it bounds its own.
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
  lines = []
  for layout in ("scanned",) if args.quick else ("scanned", "unrolled"):
    params = shapes.fsdp(shapes.llama(**SIZES[size], scanned=layout == "scanned"), mesh, "fsdp")
    for name, build in init_stages(size, layout == "scanned").items():
      with jax.set_mesh(mesh):
        start = time.perf_counter()
        state = jax.eval_shape(build().init, params)
        abstract = time.perf_counter() - start
        shardings = jax.tree.map(lambda x: x.sharding, state)
        start = time.perf_counter()
        jax.jit(build().init, out_shardings=shardings).lower(params).compile()
        sharded = time.perf_counter() - start
      lines.append(
        f"init {layout} {name}: eval_shape {abstract:.2f} s, jit(out_shardings) lower+compile"
        f" {sharded:.2f} s, peak host memory {gib(peak_rss())}"
      )
  return lines


def row_init_concrete(size, args):
  rng = np.random.default_rng(0)
  params = jax.tree.map(
    lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32) * 0.02),
    shapes.llama(**SIZES[size], scanned=True),
  )
  lines = []
  for name, tx in (("optax.adamw", adamw()), ("saggs.chain", saggs_tx(size, 1))):
    before = peak_rss()
    start = time.perf_counter()
    jax.block_until_ready(tx.init(params))
    seconds = time.perf_counter() - start
    lines.append(
      f"init {name}: {seconds:.2f} s, peak host memory +{gib(max(peak_rss() - before, 0))}"
    )
  return lines


def row_update(size, args):
  lines = []
  for layout in ("scanned",) if args.quick else ("scanned", "unrolled"):
    params = shapes.llama(**SIZES[size], scanned=layout == "scanned")
    stacked = 1 if layout == "scanned" else 0
    txs = {"adamw": adamw(), "saggs": saggs_tx(size, stacked)}
    states = {name: jax.eval_shape(tx.init, params) for name, tx in txs.items()}
    fns = {
      name: lambda tx=tx, state=states[name], params=params: compile_update(tx, params, state)
      for name, tx in txs.items()
    }
    first_degrees(params, txs["saggs"], states["saggs"])  # its timed compiles reuse them
    # A first update: a chain built afresh, whose lowering also measures its degrees.
    fns["first"] = lambda params=params, stacked=stacked, state=states["saggs"]: compile_update(
      saggs_tx(size, stacked), params, state
    )
    runs = alternating(fns, args.rounds)
    (temp_a, bytes_a), t_a = runs["adamw"]
    (temp_s, bytes_s), t_s = runs["saggs"]
    lines.append(
      f"update {layout}: temp {gib(temp_s)} (adamw {gib(temp_a)}, params"
      f" {gib(shapes.num_bytes(params))}); bytes accessed {bytes_s / bytes_a:.3f}x adamw;"
      f" lower+compile {versus(t_s, t_a)} CPU vs adamw {np.median(t_a):.2f} s; a first"
      f" update, measuring the degrees, {versus(runs['first'][1], t_a)}"
    )
  return lines


def row_fsdp(size, args):
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  params = shapes.fsdp(shapes.llama(**SIZES[size], scanned=True), mesh, "fsdp")
  shard = shapes.num_bytes(params) / 8
  with jax.set_mesh(mesh):
    temp_a, bytes_a = compile_update(adamw(), params)
    temp_s, bytes_s = compile_update(saggs_tx(size, 1), params)
  return [
    f"fsdp 8 devices, scanned: temp {gib(temp_s)} = {temp_s / shard:.2%} of a device's"
    f" {gib(shard)} shard (adamw {temp_a / shard:.2%}); bytes accessed"
    f" {bytes_s / bytes_a:.3f}x adamw"
  ]


def row_canonicalize(size, args):
  params = shapes.llama(**SIZES[size], scanned=True)
  pairs = saggs.presets.llama(num_kv_heads=SIZES[size]["num_kv_heads"], stacked=1)
  state = jax.eval_shape(adamw().init, params)
  variants = {
    "reparameterize(c=2)": lambda p, s: saggs.reparameterize(p, s, pairs, 2.0),
    "canonicalize": lambda p, s: saggs.canonicalize(p, s, pairs),
    "canonicalize(tx=adamw)": lambda p, s: saggs.canonicalize(p, s, pairs, tx=adamw()),
  }
  lines = []
  for name, fn in variants.items():
    before = peak_rss()
    try:
      compiled, t = cpu_seconds(lambda fn=fn: jax.jit(fn).lower(params, state).compile())
    except Exception as e:  # noqa: BLE001 (a row's failure is its result)
      lines.append(f"{name}: failed: {type(e).__name__}: {str(e)[:200]}")
      continue
    lines.append(
      f"{name}: jit lower+compile from abstract values {t:.1f} s CPU, temp"
      f" {gib(compiled.memory_analysis().temp_size_in_bytes)}, peak host memory"
      f" +{gib(max(peak_rss() - before, 0))}"
    )
  return lines


def row_checkpoint(size, args):
  if size != "200m":
    return ["checkpoint: n/a (abstract size: nothing to write)"]
  import orbax.checkpoint as ocp

  rng = np.random.default_rng(0)
  params = jax.tree.map(
    lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32) * 0.02),
    shapes.llama(**SIZES[size], scanned=True),
  )
  pairs = saggs.presets.llama(num_kv_heads=SIZES[size]["num_kv_heads"], stacked=1)
  opt_state = saggs_tx(size, 1).init(params)
  times = {}
  with tempfile.TemporaryDirectory() as root:
    for r in range(args.rounds):
      for name in ("orbax", "saggs"):
        manager = ocp.CheckpointManager(os.path.join(root, f"{name}{r}"))
        start = time.perf_counter()
        if name == "orbax":
          manager.save(0, args=ocp.args.StandardSave((params, opt_state)))
          manager.wait_until_finished()
        else:
          saggs.checkpoint.save(manager, 0, params, opt_state)
          manager.wait_until_finished()
        saving = time.perf_counter() - start
        if name == "orbax":
          start = time.perf_counter()
          out = manager.restore(0, args=ocp.args.StandardRestore((params, opt_state)))
        else:
          # As a restart: a chain built afresh and its target made by init; restore
          # measures its degrees and compiles its canonicalisation for it anew.
          tx = saggs_tx(size, 1)
          jax.eval_shape(tx.init, params)
          start = time.perf_counter()
          out = saggs.checkpoint.restore(manager, params, opt_state, pairs, tx=tx)
        jax.block_until_ready(out)
        times.setdefault(name, []).append((saving, time.perf_counter() - start))
        manager.close()
        del out
  (save_o, restore_o), (save_s, restore_s) = (
    np.median(times[n], axis=0) for n in ("orbax", "saggs")
  )
  return [
    f"checkpoint {shapes.num_params(params) / 1e6:.0f}M params + chain state: save"
    f" {save_s:.2f} s vs Orbax {save_o:.2f} s ({save_s / save_o:.2f}x), restore (canonicalised)"
    f" {restore_s:.2f} s vs Orbax {restore_o:.2f} s ({restore_s / restore_o:.2f}x)"
  ]


def llama_forward(params, tokens, num_kv_heads, head_dim=128):
  """A LLaMA-style forward pass over a :func:`harness.shapes.llama` tree (scanned),
  without RoPE (which commutes with the per-head scalings)."""

  def norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale

  def layer(x, p):
    a, m = p["attn"], p["mlp"]
    h = norm(x, p["input_norm"]["scale"])
    b, t, _ = h.shape
    q = (h @ a["q_proj"]["kernel"]).reshape(b, t, num_kv_heads, -1, head_dim)
    k = (h @ a["k_proj"]["kernel"]).reshape(b, t, num_kv_heads, 1, head_dim)
    v = (h @ a["v_proj"]["kernel"]).reshape(b, t, num_kv_heads, 1, head_dim)
    logits = jnp.einsum("bqgrd,bkgsd->bgrqk", q, k) / np.sqrt(head_dim)
    attn = jnp.einsum("bgrqk,bkgsd->bqgrd", jax.nn.softmax(logits, -1), v).reshape(b, t, -1)
    x = x + attn @ a["o_proj"]["kernel"]
    h = norm(x, p["post_attn_norm"]["scale"])
    x = (
      x
      + (jax.nn.silu(h @ m["gate_proj"]["kernel"]) * (h @ m["up_proj"]["kernel"]))
      @ m["down_proj"]["kernel"]
    )
    return x, None

  x = params["embed"]["embedding"][tokens]
  x, _ = jax.lax.scan(layer, x, params["layers"])
  return norm(x, params["norm"]["scale"]) @ params["lm_head"]["kernel"]


def row_discover(size, args):
  kv = SIZES[size]["num_kv_heads"]
  params = shapes.llama(**SIZES[size], scanned=True)
  if size == "200m":
    rng = np.random.default_rng(0)
    params = jax.tree.map(
      lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32) * 0.02), params
    )
  tokens = jnp.zeros((1, 8), jnp.int32) + jnp.arange(8)
  forward = lambda p, t: llama_forward(p, t, kv)  # noqa: E731
  start = time.perf_counter()
  jax.make_jaxpr(forward)(params, tokens)
  trace = time.perf_counter() - start
  start = time.perf_counter()
  try:
    found = saggs.discover(forward, params, tokens)
  except Exception as e:  # noqa: BLE001 (a row's failure is its result)
    return [
      f"discover: n/a on {type(params['embed']['embedding']).__name__} parameters:"
      f" {type(e).__name__}: {str(e)[:200]} (tracing the forward alone {trace:.2f} s)"
    ]
  seconds = time.perf_counter() - start
  return [
    f"discover: {seconds:.1f} s, {len(found.pairs)} pairs found, {len(found.rejected)}"
    f" candidates rejected, confirmation {found.confirmation!r}; tracing the forward alone"
    f" {trace:.2f} s"
  ]


# ----------------------------------------------------------------------------------


def child(row, size, args):
  if row != "checkpoint":  # (Orbax's threads cannot start under the cap; its row is 170M)
    limit = int(args.memory_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
  try:
    lines = globals()[f"row_{row}"](size, args)
  except MemoryError:
    lines = [f"{row}: failed: host memory over the {args.memory_gib:g} GiB cap"]
  except Exception as e:  # noqa: BLE001 (a row's failure is its result)
    lines = [f"{row}: failed: {type(e).__name__}: {str(e)[:300]}"]
  print("RESULT " + json.dumps(lines), flush=True)


def watched(command, env, args, cap_gib: float) -> tuple[str, str | None]:
  """Runs a row's child, killed past ``--timeout`` or when its resident memory passes
  ``cap_gib``; its output, and why it was killed."""
  with tempfile.TemporaryFile("w+") as log:
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    start, killed = time.monotonic(), None
    while proc.poll() is None:
      time.sleep(0.2)
      try:
        with open(f"/proc/{proc.pid}/status") as f:
          rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
      except (OSError, StopIteration):
        rss = 0
      if rss > cap_gib * 2**30:
        killed = f"killed: resident memory over the {cap_gib:g} GiB cap"
      elif time.monotonic() - start > args.timeout:
        killed = f"killed: over the {args.timeout:g} s timeout"
      if killed:
        proc.kill()
        proc.wait()
    log.seek(0)
    return log.read(), killed


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="1b,7b,70b,200m", help="of " + ",".join(SIZES))
  parser.add_argument("--rows", default=",".join(ROWS))
  parser.add_argument("--quick", action="store_true", help="1b and 200m, one round, scanned")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--memory-gib", type=float, default=3.5, help="host memory cap per row")
  parser.add_argument("--timeout", type=float, default=1800, help="seconds per row")
  parser.add_argument(
    "--checkpoint-memory-gib", type=float, default=12.0, help="resident memory cap, checkpoint"
  )
  parser.add_argument("--child", nargs=2, metavar=("ROW", "SIZE"), help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.quick:
    args.rounds = 1
    if args.sizes == parser.get_default("sizes"):
      args.sizes = "1b,200m"
  if args.child:
    return child(*args.child, args)

  sizes, rows = args.sizes.split(","), args.rows.split(",")
  print(f"jax {jax.__version__}, {jax.default_backend()}, {os.cpu_count()} CPUs")
  for size in sizes:
    n = shapes.num_params(shapes.llama(**SIZES[size]))
    print(f"\n## {size}: {n / 1e9:.2f}B float32 parameters ({gib(4 * n)})", flush=True)
    for row in rows:
      env = dict(os.environ, JAX_PLATFORMS="cpu")
      if row in ("init", "fsdp"):
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
      command = [sys.executable, __file__, "--child", row, size, "--rounds", str(args.rounds)]
      command += ["--memory-gib", str(args.memory_gib)] + (["--quick"] if args.quick else [])
      cap = args.checkpoint_memory_gib if row == "checkpoint" else args.memory_gib
      out, killed = watched(command, env, args, cap)
      found = [line for line in out.splitlines() if line.startswith("RESULT ")]
      if found:
        lines = json.loads(found[-1][len("RESULT ") :])
      else:
        tail = (out.strip().splitlines() or ["(no output)"])[-1]
        lines = [f"{row}: failed ({killed or 'no result'}): {tail[:300]}"]
      print("\n".join(f"  {line}" for line in lines), flush=True)
  print("\ncommand: JAX_PLATFORMS=cpu python bench/bench_scale.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
  main()
