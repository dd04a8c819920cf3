"""The study's statistics, verdicts and resumable runner (harness.stats, study).

The end-to-end check runs ``examples/gpu_study.py --tiny`` twice in
subprocesses: the second run must train nothing, leave the JSONL byte for byte
and print the same tables. Without ``--tiny`` and a GPU the script must stop.
"""

import inspect
import json
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from harness import stats, study
from xla_env import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPU_STUDY_SEEDS = 4  # examples/gpu_study.py's --seeds, which --tiny keeps

# Published two-sided 95% quantiles t_{0.975, df} (e.g. NIST/SEMATECH e-Handbook, table 1.3.6.7.2).
T_975 = {1: 12.706205, 3: 3.182446, 7: 2.364624, 9: 2.262157}


@pytest.mark.parametrize("df", sorted(T_975))
def test_t_quantile_matches_published_table(df):
  assert stats.t_quantile(0.975, df) == pytest.approx(T_975[df], abs=1e-6)


@pytest.mark.parametrize(
  "values",
  [
    [0.12, -0.03, 0.31, 0.08, 0.19, 0.02, 0.27, -0.11],  # n = 8: df 7
    [-1.5, -0.4, -2.2, -0.9],  # n = 4: df 3
    [3.0, 5.0],  # n = 2: df 1
  ],
)
def test_t_interval_against_hand_computation(values):
  n = len(values)
  mean = sum(values) / n
  std = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5
  half = T_975[n - 1] * std / n**0.5  # the table has 6 decimals: atol 1e-6 below
  interval = stats.t_interval(values)
  np.testing.assert_allclose(
    [interval.mean, interval.std, interval.low, interval.high],
    [mean, std, mean - half, mean + half],
    rtol=0,
    atol=1e-6,
  )
  assert interval.n == n
  assert stats.mean_std(values) == pytest.approx((mean, std), rel=1e-12)


def test_paired_differences_and_their_errors():
  np.testing.assert_array_equal(stats.paired_differences([3.0, 1.0], [1.0, 2.0]), [2.0, -1.0])
  with pytest.raises(ValueError, match=r"shapes \(3,\) and \(2,\)"):
    stats.paired_differences([1.0, 2.0, 3.0], [1.0, 2.0])
  with pytest.raises(ValueError, match="at least 2 values, got 1"):
    stats.t_interval([1.0])
  assert stats.mean_std([2.5]) == (2.5, 0.0)


def _interval(low, high):
  return stats.Interval((low + high) / 2, 1.0, low, high, 8)


@pytest.mark.parametrize(
  "low, high, direction, expected",
  [
    (-0.8, -0.2, -1, stats.REPRODUCED),
    (-0.8, -0.2, 1, stats.NOT_REPRODUCED),
    (0.2, 0.8, 1, stats.REPRODUCED),
    (0.2, 0.8, -1, stats.NOT_REPRODUCED),
    (-0.2, 0.8, -1, stats.INCONCLUSIVE),
    (-0.2, 0.8, 1, stats.INCONCLUSIVE),
    (0.0, 0.5, 1, stats.INCONCLUSIVE),  # touching 0 is not excluding it
  ],
)
def test_verdict_rule(low, high, direction, expected):
  assert stats.verdict(_interval(low, high), direction) == expected


def test_verdict_rejects_a_bad_direction():
  with pytest.raises(ValueError, match="direction must be"):
    stats.verdict(_interval(0.1, 0.2), 0)


# Published one-sided 95% quantiles t_{0.95, df} (the same NIST table): TOST at α = 0.05.
T_95 = {3: 2.353363, 7: 1.894579}


@pytest.mark.parametrize(
  "values, margin, expected",
  [
    ([0.004, -0.002, 0.001, 0.003, -0.001, 0.002, 0.0, 0.001], 0.01, stats.EQUIVALENT),
    ([0.004, -0.002, 0.001, 0.003, -0.001, 0.002, 0.0, 0.001], 0.002, stats.INCONCLUSIVE),
    ([0.05, 0.04, 0.06, 0.05], 0.01, stats.NOT_EQUIVALENT),
    ([-0.05, -0.04, -0.06, -0.05], 0.01, stats.NOT_EQUIVALENT),
    ([0.012, -0.011, 0.013, -0.012], 0.01, stats.INCONCLUSIVE),  # mean ~0, too noisy
  ],
)
def test_tost_against_hand_computation(values, margin, expected):
  n = len(values)
  mean = sum(values) / n
  std = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5
  half = T_95[n - 1] * std / n**0.5
  # The two one-sided tests, each at 5%: t statistics against -margin and +margin.
  lower_rejected = (mean + margin) / (std / n**0.5) > T_95[n - 1]
  upper_rejected = (mean - margin) / (std / n**0.5) < -T_95[n - 1]
  assert (lower_rejected and upper_rejected) == (expected == stats.EQUIVALENT)
  interval, outcome = stats.equivalence(values, margin)
  np.testing.assert_allclose(
    [interval.low, interval.high], [mean - half, mean + half], rtol=0, atol=1e-6
  )
  assert outcome == expected


def test_tost_rejects_a_bad_margin():
  with pytest.raises(ValueError, match="margin must be positive"):
    stats.equivalence([0.1, 0.2], 0.0)


def _records(arm, losses):
  return [
    {"arm": arm, "seed": study.FIRST_SEED + i, "val_loss": loss} for i, loss in enumerate(losses)
  ]


CONTROL = [2.0, 2.1, 1.9, 2.05, 1.95, 2.02]
NOISE = [0.001, -0.002, 0.0015, -0.001, 0.0005, 0.0]  # |Δ| far below the margin


def _arms(**offsets):
  """AdamW (the control) and arms whose per-seed losses are CONTROL + offsets."""
  arms = {"AdamW": _records("AdamW", CONTROL)}
  for arm, offset in offsets.items():
    arms[arm.replace("_", " ")] = _records(arm, [x + d for x, d in zip(CONTROL, offset)])
  return arms


def _verdicts(judged):
  return [study.verdict_row(j)[-1] for j in judged]


def test_direction_claims_are_judged_on_the_paired_nats():
  arms = _arms(hard_SAGGS=[-0.05 + e for e in NOISE], soft_SAGGS=[0.1, -0.1] * 3)
  judged = study.judged_claims("imbalance", arms)
  assert [j.claim.arm for j in judged] == ["hard SAGGS", "soft SAGGS"]
  np.testing.assert_allclose(judged[0].diffs, [-0.05 + e for e in NOISE], atol=1e-12)
  assert _verdicts(judged) == [stats.REPRODUCED, stats.INCONCLUSIVE]
  row = study.verdict_row(judged[0])
  assert row[1] == "Δ < 0" and "(95%)" in row[2]
  assert row[3] == f"{100 * np.mean(np.expm1(judged[0].diffs)):+.2f}%"  # ΔPPL/PPL
  assert "Kim 2026, abstract" in row[4] and "not comparable" in row[4]


def test_balanced_alone_tests_costs_nothing_not_an_improvement():
  """The bug: without the imbalance run the claim turned into "SAGGS improves"."""
  equal = _arms(hard_SAGGS=NOISE, soft_SAGGS=[e + 0.05 for e in NOISE])
  judged = study.judged_claims("balanced", equal)  # no penalties: balanced run alone
  assert [j.claim.test for j in judged] == ["equivalence", "equivalence"]
  assert _verdicts(judged) == [stats.EQUIVALENT, stats.NOT_EQUIVALENT]
  row = study.verdict_row(judged[0])
  assert row[1] == f"TOST ±{study.MARGIN:g}" and "(90%)" in row[2]
  assert "no penalty measured" in row[2]
  # A clear improvement is not "costs nothing" within the margin either.
  better = study.judged_claims("balanced", _arms(hard_SAGGS=[e - 0.05 for e in NOISE]))
  assert _verdicts(better) == [stats.NOT_EQUIVALENT]


def test_equivalence_reports_its_upper_end_as_a_share_of_the_penalty():
  arms = _arms(hard_SAGGS=[e + 0.002 for e in NOISE])
  penalty = np.array([0.1, 0.12, 0.08, 0.11, 0.09, 0.1])
  judged = study.judged_claims("balanced", arms, {"hard SAGGS": (penalty, "the penalty")})
  interval, _ = stats.equivalence(judged[0].diffs, study.MARGIN)
  share = f"upper end {100 * interval.high / penalty.mean():+.0f}% of the penalty (+0.1000"
  assert share in study.verdict_row(judged[0])[2]


def test_bonferroni_says_whether_a_verdict_changes():
  # t = 3.5 on 5 df: p ≈ 0.017, under 0.05 but over 0.05 / 10.
  diffs = np.array([-1.0, -2.0, -3.0, -1.5, -2.5, -0.4])
  t = diffs.mean() / (diffs.std(ddof=1) / np.sqrt(6))
  assert -4.8 < t < -2.6  # between t_{1-0.005/2, 5} = 4.77 and t_{0.975, 5} = 2.57
  arms = _arms(hard_SAGGS=list(diffs), soft_SAGGS=[-1.0 + e for e in NOISE])
  judged = study.judged_claims("imbalance", arms)
  assert study.bonferroni(judged) == (
    "Bonferroni over the 2 claims (each at α = 0.0250): changes no verdict."
  )
  ten = judged[:1] * 5 + judged[1:] * 5
  assert study.bonferroni(ten).startswith(
    "Bonferroni over the 10 claims (each at α = 0.0050): changes 5 verdict(s): "
    f"hard SAGGS lowers the loss under scale imbalance: {stats.REPRODUCED} -> "
    f"{stats.INCONCLUSIVE}"
  )


def test_source_hash_follows_the_sources(tmp_path):
  file = tmp_path / "model.py"
  file.write_text("x = 1\n")
  before = study.source_hash([file], [study.adamw], ["jax 1"])
  assert study.source_hash([file], [study.adamw], ["jax 1"]) == before
  assert study.source_hash([file], [study.adamw], ["jax 2"]) != before
  assert study.source_hash([file], [study.with_stage], ["jax 1"]) != before
  file.write_text("x = 2\n")
  assert study.source_hash([file], [study.adamw], ["jax 1"]) != before
  # The run code covers the whole library package, the example model and the optimizers,
  # not the study's report and statistics.
  files = study.run_files()
  names = [f.name for f in files]
  assert {"__init__.py", "transform.py", "lm.py", "optimizers.py", "moe.py"} <= set(names)
  assert not {"study.py", "stats.py"} & set(names) and len(set(files)) == len(files)
  assert len(study.code_version()) == 12
  # The study's functions are read from the file as imported, which is unedited here.
  assert [study.function_source(f) for f in study.RUN_FUNCTIONS] == [
    inspect.getsource(f) for f in study.RUN_FUNCTIONS
  ]


def test_store_skips_finished_runs_and_resumes(tmp_path):
  calls = []

  def fake_train(seed, desc):
    calls.append(seed)
    return {"eval_step": np.array([0, 5]), "eval_loss": np.array([5.0, 2.0 + seed])}

  specs = [
    study.Spec("e", "a", seed, {"lr": 1e-3}, lambda desc, s=seed: fake_train(s, desc))
    for seed in range(3)
  ]
  path = tmp_path / "runs.jsonl"
  first = study.run_specs(study.Store(path), specs[:2])  # "interrupted" after two runs
  assert calls == [0, 1] and [r["val_loss"] for r in first] == [2.0, 3.0]
  records = study.run_specs(study.Store(path), specs)  # a fresh process reads the file
  assert calls == [0, 1, 2]
  assert [json.loads(line)["seed"] for line in path.read_text().splitlines()] == [0, 1, 2]
  assert records[:2] == first
  changed = specs[0]._replace(config={"lr": 2e-3})  # another config is another run
  study.run_specs(study.Store(path), [changed])
  assert calls == [0, 1, 2, 0]
  other_code = specs[1]._replace(config={"lr": 1e-3, "code": "0123456789ab"})
  study.run_specs(study.Store(path), [other_code])  # so is a run of other code
  assert calls == [0, 1, 2, 0, 1]


def test_store_keeps_the_moe_metrics_and_nothing_else(tmp_path):
  moe_history = {  # per-step metrics of 2 steps, 2 layers, as moe.train returns them
    "eval_step": np.array([0, 2]),
    "eval_loss": np.array([5.0, 2.0]),
    "cv": np.array([[0.5, 0.4], [0.3, 0.2]]),
    "flip": np.array([[0.25, 0.5], [0.0, 0.125]]),
    "logit_max": np.array([1.0, 3.0, 4.0]),
    "seconds": np.asarray(1.5),
    "params": {"w": np.ones(3)},  # the trained parameters are not recorded
  }
  dense_history = {"eval_step": np.array([0, 5]), "eval_loss": np.array([5.0, 2.5])}
  path = tmp_path / "runs.jsonl"
  store = study.Store(path)
  store.add(study.Spec("moe", "a", 0, {}, None), moe_history)  # pyright: ignore[reportArgumentType]
  store.add(study.Spec("imbalance", "a", 0, {}, None), dense_history)  # pyright: ignore[reportArgumentType]
  moe_record, dense_record = (json.loads(line) for line in path.read_text().splitlines())
  assert moe_record["metrics"] == {
    "cv": [[0.5, 0.4], [0.3, 0.2]],
    "flip": [[0.25, 0.5], [0.0, 0.125]],
    "logit_max": [1.0, 3.0, 4.0],
  }
  assert set(moe_record) == {*dense_record, "metrics"}
  assert "metrics" not in dense_record  # the dense runs' records are as before
  assert study.Store(path).records == store.records


def test_every_run_config_carries_the_code_version():
  args = study.parse_args(study.build_parser(""), [])
  # The configs read neither the graph nor the corpus.
  setup = study.Setup(args, study.lm.ModelConfig(), None, None, [], "0123456789ab")  # pyright: ignore[reportArgumentType]
  assert study.base_config(setup)["code"] == "0123456789ab"
  assert study.saggs_config(setup)["code"] == "0123456789ab"
  (moe,) = study.moe_specs(setup, {"muon": 0.025}, [200])
  assert (moe.experiment, moe.arm, moe.seed) == ("moe", "muon", 200)
  assert moe.config["code"] == "0123456789ab" and moe.config["lr"] == 0.025
  assert moe.config["steps"] == args.moe_steps and moe.config["model"]["num_experts"] == 8


def _gpu_study(*flags, check=True):
  return subprocess.run(
    [sys.executable, str(ROOT / "examples" / "gpu_study.py"), *flags],
    cwd=ROOT,
    env=cpu_env(),
    capture_output=True,
    text=True,
    timeout=300,
    check=check,
  )


def _gpu_study_tiny(out):
  return _gpu_study("--tiny", "--out", str(out))


def test_gpu_study_tiny_runs_then_resumes_without_training(tmp_path):
  first = _gpu_study_tiny(tmp_path)
  jsonl = (tmp_path / "runs.jsonl").read_text()
  records = [json.loads(line) for line in jsonl.splitlines()]
  seeds = range(study.FIRST_SEED, study.FIRST_SEED + GPU_STUDY_SEEDS)
  assert sorted((r["experiment"], r["arm"], r["seed"]) for r in records) == sorted(
    ("imbalance", arm, seed) for arm in study.IMBALANCE_ARMS for seed in seeds
  )
  # The runs are keyed by the code and by the matmul precision gpu_study sets.
  jax.config.update("jax_default_matmul_precision", "tensorfloat32")
  try:
    code = study.code_version()
  finally:
    jax.config.update("jax_default_matmul_precision", None)
  assert {r["config"]["code"] for r in records} == {code} and code != study.code_version()
  # The table holds the JSONL's numbers: each arm's mean ± sample std of the val loss.
  for arm in study.IMBALANCE_ARMS:
    losses = np.array([r["val_loss"] for r in records if r["arm"] == arm])
    assert f"{losses.mean():.4f} ± {losses.std(ddof=1):.4f}" in first.stdout
  assert first.stdout.count("Kim 2026, abstract") == 2
  for name in ("imbalance_differences.png", "imbalance_curves.png"):
    assert (tmp_path / name).stat().st_size > 10_000
  # The last line is the JSON summary, as written to summary.json.
  *tables, line = first.stdout.splitlines()
  summary = json.loads(line)
  assert summary == json.loads((tmp_path / "summary.json").read_text())
  assert summary["matmul_precision"] == "tensorfloat32" and summary["seeds"] == len(seeds)
  assert [v["arm"] for v in summary["verdicts"]] == ["hard SAGGS", "soft SAGGS"]
  hard = np.array([r["val_loss"] for r in records if r["arm"] == "hard SAGGS"])
  adamw = np.array([r["val_loss"] for r in records if r["arm"] == "AdamW"])
  assert summary["verdicts"][0]["delta_nats"] == pytest.approx(np.mean(hard - adamw), abs=1e-12)

  second = _gpu_study_tiny(tmp_path)
  assert f"{len(records)} of {len(records)} runs already in" in second.stderr
  assert "imbalance AdamW seed" not in second.stderr  # no progress bar: nothing trained
  assert (tmp_path / "runs.jsonl").read_text() == jsonl
  *second_tables, second_line = second.stdout.splitlines()
  assert second_tables == tables
  assert {**json.loads(second_line), "wall_s": 0} == {**summary, "wall_s": 0}


def test_gpu_study_stops_without_a_gpu():
  proc = _gpu_study("--out", "/nonexistent/never-written", check=False)  # JAX on the CPU
  assert proc.returncode == 1 and proc.stdout == ""
  assert re.search(r"needs a GPU, but JAX's backend is 'cpu'.*jax\[cuda12\]", proc.stderr)
