r"""AdamW, Muon and the symmetry-compatible stack on the same small byte-level LM.

Lau & Su, "Symmetry-Compatible Principle for Optimizer Design: Embeddings,
LM Heads, SwiGLU MLPs, and MoE Routers" (2026), give every weight block an update that is
equivariant under that block's symmetry group and reports final
validation-loss gains over AdamW of about 0.01-0.06 nats on 0.6B-3.5B
parameter models. This script runs the comparison at toy scale: the LLaMA-style
LM of ``harness.lm`` (its default sizes: ~124k parameters) on bytes of the Python
standard library, trained with (built by ``harness.optimizers``, shared with the study)

* ``adamw``: ``optax.adamw`` on every parameter;
* ``muon``: ``optax.contrib.muon`` with its defaults (quintic Newton-Schulz on
  every 2-D parameter, embedding and LM head included; Adam on the norms);
* ``stack``: ``saggs_jax.equivariant.symmetry_compatible`` with the model's
  heads: polar per attention head, row-norm embedding, centred row-norm LM
  head, row-aware SwiGLU gate/up, column-aware down, AdamW on the norms;
* ``reference``: ``symmetry_compatible(preset="reference")``, Lau & Su's training
  scripts (Muon per head and on SwiGLU, row-norm embedding, centred row-norm
  LM head, their numerics) with their per-role rates, all scaled so that the
  hidden matrices get the swept rate (0.02 = the scripts' own) and AdamW gets
  its scripts' rate times the same factor.

Each optimizer runs a small learning-rate sweep (for Muon and the stack the rate
of the matrix rules; their Adam(W) part uses ``--aux-lr``; for the reference
preset the hidden matrices' rate, see above), every setting with
``--seeds`` seeds. A seed fixes the initialisation and the batch order, shared
by all optimizers, so differences between optimizers at one seed are paired.
Every run uses the same schedule: linear warm-up over the first 10% of the
steps, cosine decay to 10% of the peak.

It prints per-run progress bars, a table of the final validation loss (mean
± std over seeds, ``*`` marking each optimizer's best learning rate) and the
best settings' paired differences to AdamW, and writes to ``--out``:
``val_loss_vs_lr.png`` (final validation loss against the learning rate),
``best_curves.png`` (training and validation curves at each optimizer's best
rate, averaged over seeds) and ``results.json``.

What it shows. A few hundred steps on a 124k-parameter model is far from the
paper's regime, so the gaps here measure early training speed, not the
paper's final-loss gains, and are much larger than 0.01-0.06 nats. With 200
steps and seeds 0-2 on CPU (``--seeds 3``, stack and reference also at 0.1)
the best settings gave final validation losses of 2.253 ± 0.079 (AdamW, lr
1e-2), 2.081 ± 0.034 (stack, 0.05; 2.082 at 0.02), 1.720 ± 0.027 (Muon,
0.05) and 1.677 ± 0.026 (reference, 0.05): against AdamW, per seed, the stack
gained 0.172 ± 0.059 nats, Muon 0.534 ± 0.059 and the reference preset
0.576 ± 0.093, all on every seed. The stack's gap to Muon and the reference
comes from its row-norm SwiGLU rules at this scale: the reference preset
orthogonalises gate, up and down as Muon does. The spread of one setting over
seeds is up to ~0.1 nats; the per-seed differences, being paired, are
steadier. Use the flags for longer, larger runs before reading anything into
the ranking. The 36 runs of 200 steps took 17 minutes on two CPU cores shared
with other jobs; from the repository root::

  python examples/compare_optimizers.py --seeds 3
  python examples/compare_optimizers.py --steps 2000 --seeds 3 --d-model 256 \
      --num-layers 6 --num-heads 8 --num-kv-heads 4 --head-dim 32 --mlp-hidden 688 \
      --seq-len 256 --batch-size 64 --lrs-adamw 1e-3,3e-3,1e-2
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np
from matplotlib.figure import Figure

import common  # noqa: F401  (the repository root on sys.path, for harness)
from harness import lm
from harness.optimizers import DEFAULT_LRS, OPTIMIZERS, floats, make_optimizer


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 (default %(default)s)")
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument(
    "--optimizers", default=",".join(OPTIMIZERS), help="comma-separated subset of %(default)s"
  )
  for name in OPTIMIZERS:
    parser.add_argument(
      f"--lrs-{name}",
      type=floats,
      default=DEFAULT_LRS[name],
      help=f"comma-separated peak learning rates of {name} "
      f"(default {','.join(map(str, DEFAULT_LRS[name]))})",
    )
  parser.add_argument(
    "--aux-lr",
    type=float,
    default=1e-2,
    help="AdamW rate of the parameters muon and the stack leave to Adam(W): "
    "norm gains (default %(default)s)",
  )
  parser.add_argument(
    "--weight-decay",
    type=float,
    default=0.0,
    help="decoupled weight decay of every optimizer (default %(default)s: "
    "short runs, and lr x wd would tie the sweep to it)",
  )
  parser.add_argument("--warmup", type=float, default=0.1, help="warm-up fraction of the steps")
  parser.add_argument("--eval-every", type=int, default=50)
  parser.add_argument("--eval-batches", type=int, default=16)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/compare_optimizers"))
  lm.add_model_flags(parser)
  lm.smoke_defaults(
    parser,
    steps=4,
    seeds=1,
    batch_size=4,
    eval_every=2,
    eval_batches=2,
    **{f"lrs_{name}": DEFAULT_LRS[name][1:2] for name in OPTIMIZERS},
  )
  args = parser.parse_args()
  args.optimizers = [o for o in args.optimizers.split(",") if o]
  if unknown := set(args.optimizers) - set(OPTIMIZERS):
    parser.error(f"unknown optimizers {sorted(unknown)}; choose from {OPTIMIZERS}")
  return args


def mean_history(histories: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  """The seeds' histories averaged entry by entry (their steps agree)."""
  return {
    k: np.mean([h[k] for h in histories], axis=0) if "loss" in k else histories[0][k]
    for k in ("step", "loss", "eval_step", "eval_loss")
  }


# Two decimals: the seeds spread by 0.01-0.07 nats, and the third decimal moves with the CPU
# model that XLA compiles for.
_FLOAT = ".2f"


def _mean_std(values: np.ndarray, fmt: str = _FLOAT) -> str:
  """``"mean ± std"`` (sample std), or the mean alone for one value."""
  if len(values) < 2:
    return format(values.mean(), fmt)
  return f"{values.mean():{fmt}} ± {values.std(ddof=1):{_FLOAT}}"


def report(args, results) -> dict:
  """Prints the tables, saves the plots and returns the summary."""
  final = {
    o: {lr: np.array([h["eval_loss"][-1] for h in hs]) for lr, hs in runs.items()}
    for o, runs in results.items()
  }
  best = {o: min(lrs, key=lambda lr: lrs[lr].mean()) for o, lrs in final.items()}
  rows = []
  for o, lrs in final.items():
    for lr, losses in lrs.items():
      rows.append(
        [
          o,
          f"{lr:g}",
          _mean_std(losses),
          "*" if lr == best[o] else "",
          float(losses.min()),
          float(losses.max()),
        ]
      )
  print(
    f"\nFinal validation loss (nats/byte) after {args.steps} steps, "
    f"mean ± std over {args.seeds} seed(s); * = best learning rate"
  )
  lm.results_table(rows, ["optimizer", "lr", "val loss", "best", "min", "max"], _FLOAT)

  for o, lr in best.items():
    lrs = sorted(final[o])
    if len(lrs) > 1 and lr in (lrs[0], lrs[-1]):
      print(f"note: {o}'s best lr {lr:g} is at the edge of its sweep; widen --lrs-{o}")

  summary = {
    "best_lr": {o: best[o] for o in final},
    "best_val_loss": {o: float(final[o][best[o]].mean()) for o in final},
  }
  if "adamw" in final:
    base = final["adamw"][best["adamw"]]
    rows = []
    for o in final:
      if o == "adamw":
        continue
      diff = final[o][best[o]] - base  # paired: same initialisation and batches per seed
      rows.append([o, _mean_std(diff, "+" + _FLOAT), int(np.sum(diff < 0)), len(diff)])
      summary[f"{o}_minus_adamw"] = diff.tolist()
    if rows:
      print(
        "\nBest settings against AdamW's best: val loss difference per seed "
        "(negative = better than AdamW), mean ± std"
      )
      lm.results_table(rows, ["optimizer", "minus adamw", "seeds better", "seeds"])

  args.out.mkdir(parents=True, exist_ok=True)
  fig = Figure(figsize=(7, 4.5))
  ax = fig.subplots()
  for i, (o, lrs) in enumerate(final.items()):
    xs = sorted(lrs)
    means = [lrs[lr].mean() for lr in xs]
    stds = [lrs[lr].std(ddof=1) if len(lrs[lr]) > 1 else 0.0 for lr in xs]
    ax.errorbar(xs, means, yerr=stds, fmt="o-", color=f"C{i}", capsize=3, label=o)
    ax.plot([best[o]], [lrs[best[o]].mean()], "*", color=f"C{i}", markersize=14)
  ax.set_xscale("log")
  ax.set(
    xlabel="peak learning rate (muon, stack: matrix rules)",
    ylabel="final validation loss (nats/byte)",
    title=f"{args.steps} steps, mean ± std over {args.seeds} seed(s); * best",
  )
  ax.grid(alpha=0.3)
  ax.legend()
  fig.savefig(args.out / "val_loss_vs_lr.png", dpi=120, bbox_inches="tight")

  curves = {f"{o} lr={best[o]:g}": mean_history(results[o][best[o]]) for o in final}
  lm.plot_curves(
    curves,
    args.out / "best_curves.png",
    title=f"Best learning rate per optimizer (mean of {args.seeds} seed(s))",
  )
  with open(args.out / "results.json", "w") as f:
    json.dump(
      {
        "args": {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()},
        "final_val_loss": {
          o: {f"{lr:g}": v.tolist() for lr, v in lrs.items()} for o, lrs in final.items()
        },
        "summary": summary,
      },
      f,
      indent=1,
    )
  print(
    f"\nSaved {args.out / 'val_loss_vs_lr.png'}, {args.out / 'best_curves.png'} "
    f"and {args.out / 'results.json'}"
  )
  return summary


def main():
  args = parse_args()
  config = lm.config_from_flags(args)
  corpus = lm.load_corpus()
  inits = {seed: lm.init_model(config, seed=seed) for seed in range(args.seeds)}
  graphdef = inits[0][0]
  print(
    f"{lm.num_params(inits[0][1]):,} parameters, {corpus.train.size:,} training bytes, "
    f"{args.steps} steps of {args.batch_size}x{config.seq_len} bytes\n"
  )

  plan = [
    (o, lr, seed)
    for o in args.optimizers
    for lr in getattr(args, f"lrs_{o}")
    for seed in range(args.seeds)
  ]
  results = {o: {lr: [] for lr in getattr(args, f"lrs_{o}")} for o in args.optimizers}
  start = time.perf_counter()
  for i, (o, lr, seed) in enumerate(plan):
    _, params = inits[seed]
    _, _, history = lm.train(
      graphdef,
      params,
      make_optimizer(o, lr, config, args),
      corpus,
      steps=args.steps,
      batch_size=args.batch_size,
      seq_len=config.seq_len,
      seed=seed,
      eval_every=args.eval_every,
      eval_batches=args.eval_batches,
      desc=f"[{i + 1}/{len(plan)}] {o} lr={lr:g} seed={seed}",
    )
    results[o][lr].append(history)
  print(f"\n{len(plan)} runs in {time.perf_counter() - start:.0f} s")
  report(args, results)


if __name__ == "__main__":
  main()
