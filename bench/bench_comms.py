"""What one update sends across devices, read from the compiled HLO.

Seven 256 x 256 float32 matrices, their rows sharded over every device (FSDP),
under ``jax.set_mesh`` (Auto axes). For each rule and each way of compiling the
step (:data:`FORMS`) the table gives the number of collectives in the compiled
update and the bytes of their outputs over the parameters' bytes.
Deterministic: it compiles, it does not time.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/bench_comms.py

On a machine with accelerators it uses them all (``bench/gpu_checks.sh``).
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from saggs_jax import equivariant as eqv

KINDS = (
  "all-reduce",
  "all-gather",
  "all-to-all",
  "collective-permute",
  "reduce-scatter",
  "collective-broadcast",
  "ragged-all-to-all",
)
_ITEMSIZE = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "bf16": 2,
  "f16": 2,
  "s16": 2,
  "u16": 2,
  "f32": 4,
  "s32": 4,
  "u32": 4,
  "f64": 8,
  "s64": 8,
  "u64": 8,
}
_OP = re.compile(r"\s*(?:ROOT )?%?[\w.\-]+ = (.*?) (" + "|".join(KINDS) + r")(-done)?\(")


def collectives(hlo: str) -> list[tuple[str, int]]:
  """``(kind, output bytes)`` of every collective in a compiled module's text.

  An asynchronous collective counts once, by its ``-done`` (whose shape is the
  output); a collective inside a loop body counts once.
  """
  found = []
  for line in hlo.splitlines():
    if m := _OP.match(line):
      size = sum(
        _ITEMSIZE[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
        for t, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", m.group(1))
      )
      found.append((m.group(2), size))
  return found


FORMS = {
  # the updates sharded as the parameters by jit's out_shardings
  "out_shardings": lambda tx, shardings: jax.jit(
    lambda g, s, p: tx.update(g, s, p)[0], out_shardings=shardings
  ),
  # a training step: the updates added to the parameters, the partitioner placing both
  "applied": lambda tx, _: jax.jit(lambda g, s, p: optax.apply_updates(p, tx.update(g, s, p)[0])),
  # the updates returned bare: nothing tells the partitioner where they go
  "bare": lambda tx, _: jax.jit(lambda g, s, p: tx.update(g, s, p)[0]),
}


def measure(tx: optax.GradientTransformation, params, shardings, form: str) -> tuple[int, float]:
  """Collectives of one jitted ``tx.update`` on sharded ``params`` (gradients
  alike), compiled in one of :data:`FORMS`, and their output bytes over the
  parameters' bytes."""
  p = jax.device_put(params, shardings)
  state = jax.jit(tx.init)(p)
  hlo = FORMS[form](tx, shardings).lower(p, state, p).compile().as_text() or ""
  found = collectives(hlo)
  return len(found), sum(b for _, b in found) / sum(x.nbytes for x in jax.tree.leaves(params))


def rules() -> dict[str, optax.GradientTransformation]:
  return {
    "scale_by_polar, 5 steps": eqv.scale_by_polar(),
    "scale_by_polar, 10 steps": eqv.scale_by_polar(newton_schulz=eqv.NewtonSchulz(steps=10)),
    "scale_by_hybrid": eqv.scale_by_hybrid(0),
    "scale_by_right_spectral": eqv.scale_by_right_spectral(0),
    "optax.contrib.muon, 5 steps": optax.contrib.muon(0.02),
    "adamw": optax.adamw(1e-3),
  }


def main():
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--count", type=int, default=7, help="matrices (default %(default)s)")
  parser.add_argument("--size", type=int, default=256, help="their side (default %(default)s)")
  args = parser.parse_args()
  mesh = jax.make_mesh((jax.device_count(),), ("x",), axis_types=(AxisType.Auto,))
  rng = np.random.default_rng(0)
  params = {
    f"w{i}": jnp.asarray(rng.standard_normal((args.size, args.size)), jnp.float32)
    for i in range(args.count)
  }
  shardings = {k: NamedSharding(mesh, P("x", None)) for k in params}
  print(
    f"{jax.device_count()} {jax.default_backend()} devices, rows sharded, {args.count} "
    f"{args.size}x{args.size} float32 matrices; jax {jax.__version__}, optax {optax.__version__}\n"
  )
  print(
    "Collectives in the compiled update, and their bytes / the parameters' bytes, by how the"
    " step is compiled\n(out_shardings: the updates sharded as the parameters; applied: added"
    " to them; bare: returned as they are).\n"
  )
  print("| rule | " + " | ".join(FORMS) + " |\n|---|" + "---|" * len(FORMS))
  with jax.set_mesh(mesh):
    for name, tx in rules().items():
      cells = (measure(tx, params, shardings, form) for form in FORMS)
      print(f"| `{name}` | " + " | ".join(f"{n}, {r:.2f}" for n, r in cells) + " |")


if __name__ == "__main__":
  main()
