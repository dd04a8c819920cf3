r"""QK-clip (MuonClip) on the example LM: max attention logits held to τ, and the loss it costs.

At a high learning rate the largest pre-softmax attention logit of the small
LLaMA-style LM of ``harness.lm`` grows far past its initial scale, under AdamW and
under the Muon-style ``saggs_jax.equivariant.symmetry_compatible`` stack alike.
``saggs.qk_clip`` rescales, after each step, the query rows of every head whose
max logit on the step's batch exceeded τ (and its KV head's key rows, the
split's gauge transported like a Q/K symmetry), as Kimi K2 does. Each
optimizer is trained in two arms from the same initialisations and batches
(three with ``--saggs``):

* ``none``: the optimizer alone;
* ``clip``: ``saggs.chain(opt, saggs.qk_clip(qk, tau))``;
* ``clip+SAGGS``: ``saggs.chain(opt, saggs.saggs(qk), saggs.qk_clip(qk, tau))``,
  hard SAGGS on the Q/K pairs choosing the gauge the clip leaves open.

The logits are measured in the training forward pass itself
(``lm.loss_and_max_logits``: each attention layer sows ``saggs.max_logits``;
``lm.make_max_logits_step`` hands them to the clip), so the clip costs one
more ``q·kᵀ`` per layer and no second forward pass.

It prints a table (peak and final max logit on the training batches, as the
clip sees them before each update, final validation loss, and the per-seed paired difference to ``none`` with its 95%
t-interval, see ``harness.stats``) and writes ``max_logit.png`` (the max logit over
training, mean over seeds) to ``--out``.

τ is set by the logit scale of this tiny model: at initialisation its max
logits are about 4 (head_dim 16, unit-RMS inputs), and at ``--lr`` they grow
to 15-30 within a few hundred steps; K2's τ = 100 is for a model whose logits
start and live at a much larger scale. τ = 8 is twice the initial scale: a
bound that binds here.

The defaults (3 seeds, 150 steps, batch 16) take about two minutes of CPU time
on two cores. Run from the repository root::

  python examples/qk_clip.py
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import numpy as np
import optax
from tqdm import tqdm

import common  # noqa: F401  (the repository root on sys.path, for harness)
import saggs_jax as saggs
from harness import lm, stats
from saggs_jax import equivariant as eqv


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. seeds-1")
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--saggs", action="store_true", help="add the clip+SAGGS arm")
  parser.add_argument("--tau", type=float, default=8.0, help="the logit bound τ")
  parser.add_argument("--adamw-lr", type=float, default=1e-2)
  parser.add_argument(
    "--stack-lr",
    type=float,
    default=0.05,
    help="learning rate of the stack's matrix rules (its AdamW part: --adamw-lr)",
  )
  parser.add_argument("--weight-decay", type=float, default=0.0)
  parser.add_argument("--eval-batches", type=int, default=8)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/qk_clip"))
  lm.add_model_flags(parser)
  lm.smoke_defaults(parser, steps=4, seeds=1, batch_size=4, eval_batches=2)
  return parser.parse_args(argv)


def optimizers(args, config: lm.ModelConfig) -> dict[str, optax.GradientTransformation]:
  return {
    "AdamW": optax.adamw(args.adamw_lr, weight_decay=args.weight_decay),
    "Muon stack": eqv.symmetry_compatible(
      args.stack_lr,
      weight_decay=args.weight_decay,
      learning_rates={"adamw": args.adamw_lr},
      decoder=saggs.equivariant.Decoder(config.num_heads, config.num_kv_heads, config.head_dim),
    ),
  }


def with_arm(opt, arm: str, config: lm.ModelConfig, tau: float):
  qk = saggs.presets.llama(config.num_kv_heads, mlp=False)[:1]  # the Q/K pair of every layer
  if arm == "none":
    return opt
  if arm == "clip":
    return saggs.chain(opt, saggs.qk_clip(qk, tau))
  return saggs.chain(opt, saggs.saggs(qk), saggs.qk_clip(qk, tau))


def train(graphdef, params, step, tx, corpus, args, seed, bar):
  """``(max logit per step, final validation loss)`` of one run."""
  params = lm.donatable_copy(params)
  state = lm.donatable_copy(tx.init(params))
  data_key, eval_key = jax.random.split(jax.random.key(seed))
  tops = []
  for s in range(1, args.steps + 1):
    batch = lm.sample_batch(
      jax.random.fold_in(data_key, s), corpus.train, args.batch_size, args.seq_len
    )
    params, state, _, top = step(params, state, batch)
    tops.append(top)  # stays on device until the end of the run
    bar.update()
  val = lm.sample_batches(eval_key, corpus.val, args.eval_batches, args.batch_size, args.seq_len)
  return np.asarray(jax.device_get(tops)), float(lm.make_evaluate(graphdef)(params, val))


def run(args, corpus, progress: bool = True):
  """``{optimizer: {arm: (tops (seeds, steps), val losses (seeds,))}}``."""
  config = lm.config_from_flags(args)
  graphdef, _ = lm.init_model(config, seed=0)
  inits = [lm.init_model(config, seed=s)[1] for s in range(args.seeds)]
  results = {}
  arms = ("none", "clip") + ("clip+SAGGS",) * args.saggs
  total = len(arms) * 2 * args.seeds * args.steps
  with tqdm(total=total, disable=not progress, dynamic_ncols=True) as bar:
    for name, opt in optimizers(args, config).items():
      results[name] = {}
      for arm in arms:
        tx = with_arm(opt, arm, config, args.tau)
        step = lm.make_max_logits_step(graphdef, tx)  # one compilation per optimizer and arm
        bar.set_description(f"{name} / {arm}")
        runs = [
          train(graphdef, inits[s], step, tx, corpus, args, s, bar) for s in range(args.seeds)
        ]
        results[name][arm] = (np.stack([t for t, _ in runs]), np.array([v for _, v in runs]))
  return results


def report(args, results) -> str:
  rows = []
  for name, arms in results.items():
    base = arms["none"][1]
    for arm, (tops, vals) in arms.items():
      mean, std = stats.mean_std(vals)
      if arm == "none" or len(vals) < 2:
        diff = "-"
      else:
        ci = stats.t_interval(list(stats.paired_differences(vals, base)))
        diff = f"{ci.mean:+.2f} [{ci.low:+.2f}, {ci.high:+.2f}]"
      rows.append(
        (
          name,
          arm,
          float(tops.max(axis=1).mean()),
          float(tops[:, -1].mean()),
          f"{mean:.2f} ± {std:.2f}",
          diff,
        )
      )
  table = lm.results_table(
    rows,
    [
      "optimizer",
      "arm",
      "peak max logit",
      "final max logit",
      "val loss",
      "Δ val loss vs none (95% CI)",
    ],
    floatfmt=".1f",
  )
  steps = np.arange(1, args.steps + 1)
  args.out.mkdir(parents=True, exist_ok=True)
  lm.plot_metric_curves(
    {
      f"{name} / {arm}": (steps, tops.mean(axis=0))
      for name, arms in results.items()
      for arm, (tops, _) in arms.items()
    },
    args.out / "max_logit.png",
    ylabel=f"max attention logit (τ = {args.tau:g})",
    title=f"max logit on the training batch, mean of {args.seeds} seeds",
  )
  return table


def main():
  args = parse_args()
  corpus = lm.load_corpus()
  results = run(args, corpus)
  print(
    f"{args.seeds} seeds, {args.steps} steps, τ = {args.tau:g}, AdamW lr {args.adamw_lr:g},"
    f" stack lr {args.stack_lr:g}"
  )
  report(args, results)
  print(f"plot: {args.out / 'max_logit.png'}")


if __name__ == "__main__":
  main()
