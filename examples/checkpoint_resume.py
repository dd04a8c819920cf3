r"""Resuming from equivalent checkpoints: AdamW versus SAGGS (Kim 2026's restart experiment, small).

Scaling one side of every exact symmetry pair (Q/K and V/O per KV head,
SwiGLU up/down per channel) by ``c`` and the other by ``1/c``, with AdamW's
moments transported alongside (``saggs.reparameterize``), gives a checkpoint
that computes the same function and holds the same optimizer information.
AdamW nevertheless continues it on a different trajectory: its steps have the
same size whatever the parameters' scale.

For each seed this script pretrains the LLaMA-style byte LM of ``harness.lm`` with
AdamW, saves the state with Orbax, saves the same state rescaled by
``--factor`` as a second checkpoint, and resumes from the checkpoints:

* ``control``: the checkpoint as saved, AdamW;
* ``rescaled``: the rescaled checkpoint, AdamW;
* ``rescaled + SAGGS`` / ``rescaled + soft SAGGS``: the rescaled checkpoint,
  AdamW chained with hard / soft SAGGS;
* ``rescaled, canonicalized``: the rescaled checkpoint restored with
  ``saggs.checkpoint.restore(..., pairs, tx=tx)`` (canonical form), AdamW. Restoring
  the control checkpoint this way gives the same state: the canonical form
  is the same for every member of the orbit.

All runs of a seed see the same batches. The script prints validation loss
at the restart and at the end (mean ± std over seeds), per-byte perplexity,
the final PPL minus the control's (paired per seed) and the pairs' remaining
imbalance, and saves ``val_loss.png`` in ``--out``. The defaults take a few
minutes on two CPU cores. Run from the repository root::

  python examples/checkpoint_resume.py
  python examples/checkpoint_resume.py --seeds 5 --pretrain-steps 1000 --steps 1000
"""

import argparse
import pathlib
import shutil

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp

import common  # noqa: F401  (the repository root on sys.path, for harness)
import saggs_jax as saggs
from harness import lm

ARMS = (
  "control",
  "rescaled",
  "rescaled + SAGGS",
  "rescaled + soft SAGGS",
  "rescaled, canonicalized",
)


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seeds", type=int, default=3, help="number of seeds (0, 1, ...)")
  parser.add_argument("--pretrain-steps", type=int, default=300)
  parser.add_argument("--steps", type=int, default=200, help="steps after the restart")
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--weight-decay", type=float, default=0.1)
  parser.add_argument(
    "--factor",
    type=float,
    default=8.0,
    help="A sides are scaled by this factor, B sides by its inverse",
  )
  parser.add_argument("--every", type=int, default=10, help="balance every this many updates")
  parser.add_argument("--strength", type=float, default=0.5, help="soft SAGGS strength in (0, 1]")
  parser.add_argument("--eval-every", type=int, default=25)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/checkpoint_resume"))
  lm.add_model_flags(parser)
  lm.smoke_defaults(parser, seeds=1, pretrain_steps=4, steps=4, batch_size=4, eval_every=2)
  return parser.parse_args()


def save_checkpoints(args, graphdef, corpus, pairs, seed):
  """Pretrains with AdamW; saves the state as is and rescaled. Returns the two managers."""
  _, params = lm.init_model(lm.config_from_flags(args), seed=seed)
  adamw = optax.adamw(args.lr, weight_decay=args.weight_decay)
  params, opt_state, _ = lm.train(
    graphdef,
    params,
    adamw,
    corpus,
    steps=args.pretrain_steps,
    batch_size=args.batch_size,
    seq_len=args.seq_len,
    seed=seed,
    eval_every=args.pretrain_steps,
    desc=f"seed {seed} pretrain",
  )
  managers = {}
  for name, state in (
    ("as_is", (params, opt_state)),
    ("rescaled", saggs.reparameterize(params, opt_state, pairs, args.factor)),
  ):
    directory = (args.out / f"seed_{seed}" / name).absolute()
    shutil.rmtree(directory, ignore_errors=True)  # a rerun replaces the previous run's checkpoints
    managers[name] = ocp.CheckpointManager(directory)
    saggs.checkpoint.save(managers[name], args.pretrain_steps, *state)
  return managers


def resume(args, arm, managers, target, pairs):
  """Restores the arm's checkpoint into ``target`` and builds its optimizer and state."""
  adamw = optax.adamw(args.lr, weight_decay=args.weight_decay)
  manager = managers["as_is" if arm == "control" else "rescaled"]
  params, opt_state, _ = saggs.checkpoint.restore(
    manager, *target, pairs=pairs, canonicalize=arm.endswith("canonicalized"), tx=adamw
  )
  stage = {
    "rescaled + SAGGS": saggs.saggs(pairs, every=args.every),
    "rescaled + soft SAGGS": saggs.soft(pairs, strength=args.strength, every=args.every),
  }.get(arm)
  if stage is None:
    return params, adamw, opt_state
  # SAGGS joins at the restart: AdamW's restored state is kept, the stage starts afresh
  # and its first update balances the parameters and transports AdamW's moments.
  tx = saggs.chain(adamw, stage)
  return params, tx, tx.init_from(params, opt_state)


def mean_std(values, digits: int = 2) -> str:
  # Two decimals by default: the seeds spread by 0.01-0.03 nats, and the third decimal moves
  # with the CPU model that XLA compiles for.
  return f"{np.mean(values):.{digits}f} ± {np.std(values):.{digits}f}"


def report(results, out: pathlib.Path) -> None:
  """Prints the table and saves the validation-loss plot.

  ``results[arm]`` is a list over seeds of ``(history, mean |imbalance|)``.
  """
  control_ppl = np.exp([h["eval_loss"][-1] for h, _ in results["control"]])
  rows = []
  for arm, runs in results.items():
    restart, end = (np.array([h["eval_loss"][i] for h, _ in runs]) for i in (0, -1))
    rows.append(
      [
        arm,
        mean_std(restart),
        mean_std(end),
        mean_std(np.exp(end)),
        mean_std(np.exp(end) - control_ppl),
        mean_std([imb for _, imb in runs], 3),
      ]
    )
  print()
  lm.results_table(
    rows,
    [
      "run",
      "val loss @restart",
      "val loss @end",
      "val PPL @end",
      "ΔPPL vs control",
      "|imbalance| @end",
    ],
  )
  print(
    f"mean ± std over {len(control_ppl)} seeds; PPL per byte; |imbalance|: mean of"
    " |log(||A_g|| / ||B_g||)| over all pairs, layers and groups."
  )
  path = out / "val_loss.png"
  lm.plot_metric_curves(
    {
      arm: (runs[0][0]["eval_step"], np.stack([h["eval_loss"] for h, _ in runs], -1))
      for arm, runs in results.items()
    },
    path,
    ylabel="validation loss (nats/byte)",
    title="Resumed from equivalent checkpoints, one line per seed",
  )
  print(f"\nSaved {path}")


def mean_abs_imbalance(params, pairs) -> float:
  return float(
    np.mean(np.concatenate([np.abs(np.ravel(x)) for x in saggs.imbalance(params, pairs).values()]))
  )


def main():
  args = parse_args()
  # The runs of every seed compile the same steps: keep the executables on disk.
  jax.config.update("jax_compilation_cache_dir", str((args.out / "jax_cache").absolute()))
  config = lm.config_from_flags(args)
  corpus = lm.load_corpus()
  graphdef, params = lm.init_model(config, seed=0)
  pairs = saggs.presets.llama(num_kv_heads=config.num_kv_heads)
  print(f"{lm.num_params(params):,} parameters, {corpus.train.size:,} training bytes\n")

  results = {arm: [] for arm in ARMS}
  for seed in range(args.seeds):
    managers = save_checkpoints(args, graphdef, corpus, pairs, seed)
    # A fresh model and optimizer state only lend the restore its structure.
    _, fresh = lm.init_model(config, seed=10_000 + seed)
    target = (fresh, optax.adamw(args.lr).init(fresh))
    for arm in ARMS:
      params, tx, opt_state = resume(args, arm, managers, target, pairs)
      # Batches after the restart differ from the pretraining ones.
      params, _, history = lm.train(
        graphdef,
        params,
        tx,
        corpus,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=config.seq_len,
        seed=1_000 + seed,
        opt_state=opt_state,
        eval_every=args.eval_every,
        desc=f"seed {seed} {arm}",
      )
      results[arm].append((history, mean_abs_imbalance(params, pairs)))
    for manager in managers.values():
      manager.close()
  report(results, args.out)


if __name__ == "__main__":
  main()
