r"""The papers' claims, measured with enough seeds to tell signal from noise.

Four experiments on the byte-level LLaMA-style LM of ``saggs_jax.testing.lm``. Within a seed
every arm starts from the same initialisation (up to an exact symmetry
transform) and sees the same batches, so arms are compared on their per-seed
differences (``stats.py``: mean ± std, 95% t-interval, seeds in favour):

* ``imbalance`` (Kim 2026): every ``presets.llama`` pair (Q/K, V/O per KV head,
  SwiGLU up/down) reparameterised by ``--factor`` (A sides times 8, B sides
  over 8) at initialisation, then AdamW, AdamW + hard SAGGS, AdamW + soft SAGGS.
* ``resume`` (Kim 2026's restart): AdamW pretraining, then the state
  (parameters and moments) reparameterised by ``--factor`` and training
  continued: control (not rescaled), rescaled, rescaled + hard SAGGS,
  rescaled + soft SAGGS, rescaled then canonicalised (``saggs.canonicalize``).
* ``balanced``: the ``imbalance`` arms without the imbalance: does SAGGS cost
  anything when there is nothing to balance?
* ``optimizers`` (Lau & Su 2026): AdamW, ``optax.contrib.muon`` and the
  symmetry-compatible stack (``compare_optimizers.make_optimizer``), each
  tuned over the same multiplier grid around its default rate on
  ``--tune-seeds`` seeds (seeds 100, 101, ...), then run at its best rate on
  ``--opt-seeds`` other seeds.

Every finished run is appended to ``--out/runs.jsonl`` as one JSON line keyed
by (experiment, arm, seed, config); a rerun skips the runs already there, so an
interrupted study resumes where it stopped. The tables, verdicts and plots are
built from that file. Standard output holds only what the seeds determine
(progress bars and skip counts go to standard error). Plots: per experiment
``<experiment>_differences.png`` (per-seed paired differences, mean and 95%
interval) and ``<experiment>_curves.png`` (validation loss, mean ± std band
over seeds).

Verdicts. A claim is a sign of a paired difference (or a bound on it): it is
"reproduced" when the 95% interval lies wholly on the claimed side, "not
reproduced" when it lies wholly on the other side, and "inconclusive at this
scale" when it straddles the bound. Kim's claims are judged in perplexity per
byte, Lau & Su's in nats per byte.

The defaults (152 runs and 10 pretrainings) took 25 minutes on two CPU cores
shared with other jobs; a rerun that finds every run in the JSONL prints the
same output in seconds. From the repository root::

  python examples/study.py
  python examples/study.py --experiments imbalance --seeds 4 --steps 1000
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from matplotlib.figure import Figure

import compare_optimizers
import saggs_jax as saggs
import stats
from saggs_jax.testing import lm

EXPERIMENTS = ("imbalance", "resume", "balanced", "optimizers")
IMBALANCE_ARMS = ("AdamW", "hard SAGGS", "soft SAGGS")
RESUME_ARMS = ("control", "rescaled", "rescaled + hard SAGGS", "rescaled + soft SAGGS",
               "rescaled, canonicalized")
OPTIMIZER_ARMS = ("adamw", "muon", "stack")
# A recovery (resume) or a cost (balanced) counts as negligible below this
# fraction of the penalty SAGGS is there to remove, measured in the same study.
NEGLIGIBLE_FRACTION = 0.2


def build_parser(description: str) -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=description.split("\n")[0])
  parser.add_argument("--experiments", default=",".join(EXPERIMENTS),
                      help="comma-separated subset of %(default)s")
  parser.add_argument("--seeds", type=int, default=10,
                      help="seeds 0..N-1 of imbalance, resume and balanced")
  parser.add_argument("--steps", type=int, default=300, help="steps of imbalance and balanced")
  parser.add_argument("--pretrain-steps", type=int, default=300, help="resume: AdamW before")
  parser.add_argument("--resume-steps", type=int, default=200, help="resume: steps after")
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--lr", type=float, default=3e-3, help="AdamW rate (all but optimizers)")
  parser.add_argument("--warmup", type=int, default=0, help="linear warm-up steps of that rate")
  parser.add_argument("--weight-decay", type=float, default=0.1)
  parser.add_argument("--factor", type=float, default=8.0,
                      help="A sides are scaled by this factor, B sides by its inverse")
  parser.add_argument("--every", type=int, default=10, help="balance every this many updates")
  parser.add_argument("--strength", type=float, default=0.5, help="soft SAGGS strength")
  parser.add_argument("--opt-steps", type=int, default=200, help="steps of optimizers")
  parser.add_argument("--tune-seeds", type=int, default=2, help="optimizers: seeds per rate")
  parser.add_argument("--opt-seeds", type=int, default=6, help="optimizers: seeds at the best")
  parser.add_argument("--lr-multipliers", type=compare_optimizers._floats,
                      default=(0.25, 0.5, 1.0, 2.0),
                      help="optimizers: rates swept, times each optimizer's default rate")
  parser.add_argument("--eval-every", type=int, default=25)
  parser.add_argument("--eval-batches", type=int, default=16)
  parser.add_argument("--corpus-bytes", type=int, default=4_000_000)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/study"))
  lm.add_model_flags(parser)
  return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None):
  args = parser.parse_args(argv)
  args.experiments = [e for e in args.experiments.split(",") if e]
  if unknown := set(args.experiments) - set(EXPERIMENTS):
    parser.error(f"unknown experiments {sorted(unknown)}; choose from {EXPERIMENTS}")
  return args


# ----------------------------------------------------------------------------
# Runs and their record
# ----------------------------------------------------------------------------


class Spec(NamedTuple):
  """One training run: its key and ``train(desc) -> lm.train history``."""

  experiment: str
  arm: str
  seed: int
  config: dict
  train: Callable[[str], dict]


def _key(experiment: str, arm: str, seed: int, config: dict) -> str:
  return json.dumps([experiment, arm, seed, config], sort_keys=True)


class Store:
  """Finished runs, one JSON line each in ``path``, appended as each run ends."""

  def __init__(self, path: pathlib.Path):
    self.path = path
    self.records = {}
    if path.exists():
      for line in path.read_text().splitlines():
        record = json.loads(line)
        self.records[_key(record["experiment"], record["arm"], record["seed"],
                          record["config"])] = record

  def get(self, spec: Spec) -> dict | None:
    return self.records.get(_key(spec.experiment, spec.arm, spec.seed, spec.config))

  def add(self, spec: Spec, history: dict) -> dict:
    record = {"experiment": spec.experiment, "arm": spec.arm, "seed": spec.seed,
              "config": spec.config, "val_loss": float(history["eval_loss"][-1]),
              "eval_step": history["eval_step"].tolist(),
              "eval_loss": history["eval_loss"].tolist()}
    self.path.parent.mkdir(parents=True, exist_ok=True)
    with open(self.path, "a") as f:  # one write per run: an interruption loses at most it
      f.write(json.dumps(record, sort_keys=True) + "\n")
    self.records[_key(spec.experiment, spec.arm, spec.seed, spec.config)] = record
    return record


def run_specs(store: Store, specs: Sequence[Spec]) -> list[dict]:
  """Runs the specs not in ``store`` yet, recording each as it ends; all their records."""
  pending = [spec for spec in specs if store.get(spec) is None]
  if len(pending) < len(specs):
    print(f"{len(specs) - len(pending)} of {len(specs)} runs already in {store.path}: skipped",
          file=sys.stderr)
  for i, spec in enumerate(pending):
    store.add(spec, spec.train(f"[{i + 1}/{len(pending)}] {spec.experiment} {spec.arm} "
                               f"seed {spec.seed}"))
  return [store.get(spec) for spec in specs]


# ----------------------------------------------------------------------------
# Experiments
# ----------------------------------------------------------------------------


class Setup(NamedTuple):
  """What every run of a study shares."""

  args: argparse.Namespace
  config: lm.ModelConfig
  graphdef: Any
  corpus: lm.Corpus
  pairs: list


def base_config(setup: Setup, **extra) -> dict:
  """What a run's result depends on, besides its experiment, arm and seed."""
  a = setup.args
  return {"model": dataclasses.asdict(setup.config), "batch_size": a.batch_size,
          "eval_batches": a.eval_batches, "eval_every": a.eval_every,
          "corpus_bytes": a.corpus_bytes, **extra}


def saggs_config(setup: Setup, **extra) -> dict:
  a = setup.args
  return base_config(setup, **{"lr": a.lr, "warmup": a.warmup, "weight_decay": a.weight_decay,
                               "factor": a.factor, "every": a.every, "strength": a.strength,
                               **extra})


def adamw(args) -> optax.GradientTransformation:
  lr = args.lr if args.warmup == 0 else optax.linear_schedule(0.0, args.lr, args.warmup)
  return optax.adamw(lr, weight_decay=args.weight_decay)


def with_stage(arm: str, args, pairs) -> optax.GradientTransformation | None:
  """The SAGGS stage an arm chains after AdamW, or None."""
  if arm.endswith("hard SAGGS"):
    return saggs.saggs(pairs, every=args.every)
  if arm.endswith("soft SAGGS"):
    return saggs.soft(pairs, strength=args.strength, every=args.every)
  return None


def train(setup: Setup, params, tx, *, steps: int, seed: int, desc: str, opt_state=None):
  a = setup.args
  _, _, history = lm.train(
      setup.graphdef, params, tx, setup.corpus, steps=steps, batch_size=a.batch_size,
      seq_len=setup.config.seq_len, seed=seed, opt_state=opt_state, eval_every=a.eval_every,
      eval_batches=a.eval_batches, desc=desc)
  return history


def imbalance_specs(setup: Setup, experiment: str) -> list[Spec]:
  """AdamW, + hard SAGGS, + soft SAGGS from an init rescaled by ``--factor`` (or 1)."""
  a = setup.args
  factor = a.factor if experiment == "imbalance" else 1.0
  config = saggs_config(setup, steps=a.steps, factor=factor)

  def run(seed, arm, desc):
    _, params = lm.init_model(setup.config, seed=seed)
    params, _ = saggs.reparameterize(params, None, setup.pairs, factor)  # same function
    stage = with_stage(arm, a, setup.pairs)
    tx = adamw(a) if stage is None else saggs.chain(adamw(a), stage)
    return train(setup, params, tx, steps=a.steps, seed=seed, desc=desc)

  return [Spec(experiment, arm, seed, config, functools.partial(run, seed, arm))
          for seed in range(a.seeds) for arm in IMBALANCE_ARMS]


def resume_specs(setup: Setup) -> list[Spec]:
  """AdamW pretraining, then the five restarts of ``RESUME_ARMS``."""
  a = setup.args
  config = saggs_config(setup, pretrain_steps=a.pretrain_steps, steps=a.resume_steps)

  @functools.lru_cache(maxsize=1)  # the arms of a seed run one after another
  def pretrained(seed):
    _, params = lm.init_model(setup.config, seed=seed)
    params, opt_state, _ = lm.train(
        setup.graphdef, params, adamw(a), setup.corpus, steps=a.pretrain_steps,
        batch_size=a.batch_size, seq_len=setup.config.seq_len, seed=seed,
        eval_every=a.pretrain_steps, eval_batches=a.eval_batches, desc=f"seed {seed} pretrain")
    return params, opt_state

  def run(seed, arm, desc):
    params, opt_state = pretrained(seed)
    if arm != "control":
      params, opt_state = saggs.reparameterize(params, opt_state, setup.pairs, a.factor)
    if arm.endswith("canonicalized"):
      params, opt_state = saggs.canonicalize(params, opt_state, setup.pairs)
    tx, stage = adamw(a), with_stage(arm, a, setup.pairs)
    if stage is not None:  # SAGGS joins at the restart
      tx, opt_state = saggs.chain(tx, stage), (opt_state, stage.init(params))
    # Batches after the restart differ from the pretraining ones.
    return train(setup, params, tx, steps=a.resume_steps, seed=1_000 + seed, desc=desc,
                 opt_state=opt_state)

  return [Spec("resume", arm, seed, config, functools.partial(run, seed, arm))
          for seed in range(a.seeds) for arm in RESUME_ARMS]


def optimizer_specs(setup: Setup, rates: dict[str, float], seeds: Sequence[int]) -> list[Spec]:
  """Each optimizer at ``rates[optimizer]`` on ``seeds``, as ``compare_optimizers`` runs it."""
  a = setup.args
  # compare_optimizers' defaults: 10% warm-up, cosine decay, no weight decay, Adam(W) at 1e-2.
  opt_args = argparse.Namespace(steps=a.opt_steps, warmup=0.1, weight_decay=0.0, aux_lr=1e-2)

  def run(seed, name, lr, desc):
    _, params = lm.init_model(setup.config, seed=seed)
    tx = compare_optimizers.make_optimizer(name, lr, setup.config, opt_args)
    return train(setup, params, tx, steps=a.opt_steps, seed=seed, desc=desc)

  return [Spec("optimizers", name, seed,
               base_config(setup, lr=rates[name], **vars(opt_args)),
               functools.partial(run, seed, name, rates[name]))
          for seed in seeds for name in rates]


def lr_grid(args) -> dict[str, list[float]]:
  """Each optimizer's rates: the multipliers times its default (``compare_optimizers``)."""
  return {name: [m * compare_optimizers.DEFAULT_LRS[name][1] for m in args.lr_multipliers]
          for name in OPTIMIZER_ARMS}


def run_optimizers(setup: Setup, store: Store) -> tuple[list[dict], dict[str, float], list, list]:
  """Tunes each optimizer on the tuning seeds, then runs its best rate on the others."""
  a = setup.args
  grid = lr_grid(a)
  tune_seeds = [100 + i for i in range(a.tune_seeds)]  # disjoint from the evaluation seeds
  tuning = [(name, lr, run_specs(store, optimizer_specs(setup, {name: lr}, tune_seeds)))
            for name in OPTIMIZER_ARMS for lr in grid[name]]
  mean = {(name, lr): np.mean([r["val_loss"] for r in records]) for name, lr, records in tuning}
  best = {name: min(grid[name], key=lambda lr: mean[name, lr]) for name in OPTIMIZER_ARMS}
  records = run_specs(store, optimizer_specs(setup, best, range(a.opt_seeds)))
  rows = [[name, f"{lr:g}", mean[name, lr], "*" if lr == best[name] else ""]
          for name, lr, _ in tuning]
  edges = [name for name in OPTIMIZER_ARMS if best[name] in (min(grid[name]), max(grid[name]))]
  return records, best, rows, edges


# ----------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------


class Claim(NamedTuple):
  """A paper's claim about ``arm - control`` in ``metric`` ("ppl" or "nats")."""

  experiment: str
  arm: str
  control: str
  metric: str
  direction: int  # the claimed sign of arm - control relative to `bound`
  paper: str


CLAIMS = (
    Claim("imbalance", "hard SAGGS", "AdamW", "ppl", -1,
          "Kim (2026), hard SAGGS under scale imbalance: -0.374 ± 0.026 PPL "
          "(101M params, WikiText-103)"),
    Claim("imbalance", "soft SAGGS", "AdamW", "ppl", -1,
          "Kim (2026), soft SAGGS under scale imbalance: -0.780 ± 0.040 PPL (31M params)"),
    Claim("resume", "rescaled", "control", "ppl", 1,
          "Kim (2026), resuming a rescaled checkpoint costs +3.78 ± 0.42 PPL"),
    Claim("resume", "rescaled + hard SAGGS", "control", "ppl", -1,
          "Kim (2026), SAGGS recovers the rescaled restart (to within 0.02 PPL)"),
    Claim("resume", "rescaled + soft SAGGS", "control", "ppl", -1,
          "soft SAGGS recovers the rescaled restart"),
    Claim("resume", "rescaled, canonicalized", "control", "ppl", -1,
          "a canonicalised restore recovers the rescaled restart"),
    Claim("balanced", "hard SAGGS", "AdamW", "ppl", -1,
          "hard SAGGS costs nothing on a balanced model"),
    Claim("balanced", "soft SAGGS", "AdamW", "ppl", -1,
          "soft SAGGS costs nothing on a balanced model"),
    Claim("optimizers", "stack", "adamw", "nats", -1,
          "Lau & Su (2026), the symmetry-compatible stack beats AdamW by 0.01-0.06 nats "
          "(0.6B-3.5B params)"),
)


def by_arm(records: Sequence[dict]) -> dict[str, list[dict]]:
  """Records grouped by arm, each list ordered by seed."""
  arms = {}
  for record in sorted(records, key=lambda r: r["seed"]):
    arms.setdefault(record["arm"], []).append(record)
  return arms


def final(records: Sequence[dict], metric: str) -> np.ndarray:
  losses = np.array([r["val_loss"] for r in records])
  return np.exp(losses) if metric == "ppl" else losses


def differences(arms: dict[str, list[dict]], arm: str, control: str, metric: str) -> np.ndarray:
  return stats.paired_differences(final(arms[arm], metric), final(arms[control], metric))


def _pm(mean: float, std: float, fmt: str = ".4f") -> str:
  return f"{mean:{fmt}} ± {std:.4f}"


def experiment_table(arms: dict[str, list[dict]], control: str, metric: str) -> list[list]:
  """Rows: arm, val loss, val PPL, difference to the control, its 95% interval, seeds."""
  rows = []
  for arm, records in arms.items():
    losses = final(records, "nats")
    row = [arm, _pm(*stats.mean_std(losses)), _pm(*stats.mean_std(np.exp(losses)))]
    if arm == control:
      rows.append(row + ["", "", ""])
      continue
    interval = stats.t_interval(differences(arms, arm, control, metric))
    favour = int(np.sum(differences(arms, arm, control, metric) < 0))
    rows.append(row + [_pm(interval.mean, interval.std, "+.4f"),
                       f"[{interval.low:+.4f}, {interval.high:+.4f}]",
                       f"{favour}/{interval.n}"])
  return rows


def print_experiment(title: str, scale: str, arms: dict[str, list[dict]], control: str,
                     metric: str) -> None:
  unit = "PPL" if metric == "ppl" else "nats"
  print(f"\n{title}\n{scale}")
  lm.results_table(experiment_table(arms, control, metric),
                   ["arm", "val loss", "val PPL", f"Δ{unit} vs {control}", "95% CI",
                    "seeds favour arm"])
  print(f"mean ± std over seeds (sample std); per byte; Δ paired per seed, 95% t-interval;"
        f" 'seeds favour arm': seeds where the arm's val loss is below {control}'s.")


def judge(claim: Claim, arms: dict[str, list[dict]], penalty: tuple | None = None) -> str:
  """The claim's verdict line: measured difference, interval, verdict.

  With ``penalty = (per-seed penalties, name)`` the claim is "arm - control is
  below ``NEGLIGIBLE_FRACTION`` of the mean penalty" (which must be positive).
  """
  interval = stats.t_interval(differences(arms, claim.arm, claim.control, claim.metric))
  unit = "PPL/byte" if claim.metric == "ppl" else "nats/byte"
  here = (f"Here {claim.arm} - {claim.control} = {interval.mean:+.4f} {unit}, "
          f"95% CI [{interval.low:+.4f}, {interval.high:+.4f}]")
  if penalty is None:
    return f"{stats.verdict(interval, claim.direction)}: {claim.paper}. {here}."
  values, name = penalty
  if np.mean(values) <= 0:
    return (f"{stats.INCONCLUSIVE}: {claim.paper}. {here}; {name} is not positive "
            f"({np.mean(values):+.4f}): nothing to recover.")
  bound = NEGLIGIBLE_FRACTION * float(np.mean(values))
  return (f"{stats.verdict(interval, claim.direction, bound)}: {claim.paper}. {here}; "
          f"claim: below {NEGLIGIBLE_FRACTION:g} x {name} ({np.mean(values):+.4f}) = {bound:+.4f}.")


def scale_text(setup: Setup, steps: str, tokens: int, seeds: int) -> str:
  _, params = lm.init_model(setup.config, seed=0)
  return (f"{lm.num_params(params):,} parameters, {steps} of {setup.args.batch_size}x"
          f"{setup.config.seq_len} bytes ({tokens:,} training bytes per run), {seeds} seeds")


def plot_differences(path: pathlib.Path, title: str, diffs: dict[str, np.ndarray],
                     unit: str) -> None:
  """Per-seed paired differences (dots) and their mean with its 95% t-interval (bar)."""
  fig = Figure(figsize=(1.8 + 1.6 * len(diffs), 4.5))
  ax = fig.subplots()
  for i, d in enumerate(diffs.values()):
    interval = stats.t_interval(d)
    ax.plot(np.full(len(d), i) + np.linspace(-0.15, 0.15, len(d)), d, "o", color=f"C{i}",
            alpha=0.5, markersize=4)
    ax.errorbar([i + 0.3], [interval.mean], yerr=[[interval.mean - interval.low],
                                                  [interval.high - interval.mean]],
                fmt="s", color=f"C{i}", capsize=4)
  ax.axhline(0, color="black", linewidth=0.8)
  ax.set_xticks(range(len(diffs)), list(diffs), rotation=15, fontsize="small")
  ax.set(ylabel=unit, title=f"{title}\n(dots: seeds; square and bar: mean, 95% t-interval)")
  ax.grid(alpha=0.3, axis="y")
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120, bbox_inches="tight")


def plot_curves(path: pathlib.Path, title: str, arms: dict[str, list[dict]], control: str,
                from_init: bool) -> None:
  """Left: validation loss per arm; right: arm minus control, paired per seed.

  Lines are means over seeds, bands ± 1 sample std. Runs ``from_init`` start
  near ln 256, which would squash the differences: their step 0 is left out.
  """
  fig = Figure(figsize=(12, 4.5))
  ax, gap = fig.subplots(1, 2)
  control_losses = np.array([r["eval_loss"] for r in arms[control]])
  for i, (arm, records) in enumerate(arms.items()):
    steps, losses = np.array(records[0]["eval_step"]), np.array([r["eval_loss"] for r in records])
    first = int(from_init)
    for axis, values in ((ax, losses), (gap, losses - control_losses)):
      mean, std = values.mean(0)[first:], values.std(0, ddof=1)[first:]
      axis.plot(steps[first:], mean, "o-", color=f"C{i}", markersize=3, label=arm)
      axis.fill_between(steps[first:], mean - std, mean + std, color=f"C{i}", alpha=0.2)
  band = f"mean over {len(control_losses)} seeds, band ± 1 sample std"
  ax.set(xlabel="step", ylabel="validation loss (nats/byte)", title=f"{title}\n({band})")
  gap.set(xlabel="step", ylabel=f"val loss - {control} val loss (nats/byte)",
          title=f"Paired difference to {control}\n({band})")
  for axis in (ax, gap):
    axis.grid(alpha=0.3)
    axis.legend(fontsize="small")
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120, bbox_inches="tight")


def plot_experiment(out: pathlib.Path, experiment: str, title: str, arms, control, metric):
  unit = "Δ val PPL per byte" if metric == "ppl" else "Δ val loss (nats/byte)"
  plot_differences(out / f"{experiment}_differences.png", f"{title}: arm - {control}",
                   {arm: differences(arms, arm, control, metric) for arm in arms
                    if arm != control}, unit)
  plot_curves(out / f"{experiment}_curves.png", title, arms, control,
              from_init=experiment != "resume")


TITLES = {
    "imbalance": "Induced imbalance: Q/K, V/O, up/down scaled by {factor:g} and 1/{factor:g}",
    "resume": "Resume from a checkpoint rescaled by {factor:g} and 1/{factor:g}",
    "balanced": "Balanced initialisation",
    "optimizers": "Optimizers at their best learning rates",
}


def report_claims(experiment: str, arms, penalties: dict | None = None) -> list[str]:
  """Verdict lines of the experiment's claims; ``penalties[arm]`` as in ``judge``."""
  return [judge(claim, arms, (penalties or {}).get(claim.arm))
          for claim in CLAIMS if claim.experiment == experiment and claim.arm in arms]


def main(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> None:
  """Runs the study; ``parser`` (default ``build_parser(__doc__)``) may change its defaults."""
  args = parse_args(parser or build_parser(__doc__), argv)
  # Every seed's runs compile the same steps: keep the executables on disk.
  jax.config.update("jax_compilation_cache_dir", str((args.out / "jax_cache").absolute()))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  config = lm.config_from_flags(args)
  graphdef, _ = lm.init_model(config, seed=0)
  setup = Setup(args, config, graphdef, lm.load_corpus(args.corpus_bytes),
                saggs.presets.llama(num_kv_heads=config.num_kv_heads))
  store = Store(args.out / "runs.jsonl")
  title = {e: t.format(factor=args.factor) for e, t in TITLES.items()}
  run_bytes = lambda steps: steps * args.batch_size * config.seq_len
  verdicts, results = [], {}

  for experiment in ("imbalance", "balanced"):
    if experiment in args.experiments:
      results[experiment] = arms = by_arm(run_specs(store, imbalance_specs(setup, experiment)))
      print_experiment(title[experiment], scale_text(
          setup, f"{args.steps} steps", run_bytes(args.steps), args.seeds), arms, "AdamW", "ppl")
      plot_experiment(args.out, experiment, title[experiment], arms, "AdamW", "ppl")
  if "imbalance" in results:
    verdicts += report_claims("imbalance", results["imbalance"])
  if "balanced" in results:
    penalties = {}
    if "imbalance" in results:  # paired: same seeds, batches and function
      penalty = differences({"imbalanced": results["imbalance"]["AdamW"],
                             "balanced": results["balanced"]["AdamW"]},
                            "imbalanced", "balanced", "ppl")
      penalties = dict.fromkeys(IMBALANCE_ARMS[1:], (penalty, "AdamW's imbalance penalty"))
      print(f"AdamW's imbalance penalty (imbalanced - balanced init): "
            f"{_pm(*stats.mean_std(penalty), '+.4f')} PPL/byte")
    verdicts += report_claims("balanced", results["balanced"], penalties)

  if "resume" in args.experiments:
    arms = by_arm(run_specs(store, resume_specs(setup)))
    print_experiment(title["resume"], scale_text(
        setup, f"{args.pretrain_steps} + {args.resume_steps} steps",
        run_bytes(args.pretrain_steps + args.resume_steps), args.seeds), arms, "control", "ppl")
    plot_experiment(args.out, "resume", title["resume"], arms, "control", "ppl")
    penalty = (differences(arms, "rescaled", "control", "ppl"), "the rescale penalty")
    verdicts += report_claims("resume", arms, dict.fromkeys(RESUME_ARMS[2:], penalty))

  if "optimizers" in args.experiments:
    records, best, tuning_rows, edges = run_optimizers(setup, store)
    arms = by_arm(records)
    print(f"\nLearning-rate sweep: final validation loss (nats/byte) after {args.opt_steps} "
          f"steps, mean over tuning seeds 100-{99 + args.tune_seeds}; * = best")
    lm.results_table(tuning_rows, ["optimizer", "lr", "val loss", "best"])
    if edges:
      print(f"note: the best rate of {', '.join(edges)} is at the edge of the grid")
    rates = ", ".join(f"{name} {lr:g}" for name, lr in best.items())
    print_experiment(f"{title['optimizers']}: {rates}",
                     scale_text(setup, f"{args.opt_steps} steps", run_bytes(args.opt_steps),
                                args.opt_seeds), arms, "adamw", "nats")
    plot_experiment(args.out, "optimizers", title["optimizers"], arms, "adamw", "nats")
    verdicts += report_claims("optimizers", arms)

  print("\nVerdicts (95% t-interval of the paired difference wholly on the claimed side of the"
        " bound: reproduced; wholly on the other side: not reproduced; else inconclusive):")
  print("\n".join(f"- {line}" for line in verdicts))
  print(f"Plots in {args.out}", file=sys.stderr)


if __name__ == "__main__":
  main()
