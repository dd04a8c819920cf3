"""The study's statistics, verdicts and resumable runner (examples/stats.py, study.py).

The end-to-end check runs ``examples/gpu_study.py --tiny`` twice in
subprocesses: the second run must train nothing, leave the JSONL byte for byte
and print the same tables.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import stats  # noqa: E402
import study  # noqa: E402

# Published two-sided 95% quantiles t_{0.975, df} (e.g. NIST/SEMATECH e-Handbook, table 1.3.6.7.2).
T_975 = {1: 12.706205, 3: 3.182446, 7: 2.364624, 9: 2.262157}


@pytest.mark.parametrize("df", sorted(T_975))
def test_t_quantile_matches_published_table(df):
  assert stats.t_quantile(0.975, df) == pytest.approx(T_975[df], abs=1e-6)


@pytest.mark.parametrize("values", [
    [0.12, -0.03, 0.31, 0.08, 0.19, 0.02, 0.27, -0.11],  # n = 8: df 7
    [-1.5, -0.4, -2.2, -0.9],  # n = 4: df 3
    [3.0, 5.0],  # n = 2: df 1
])
def test_t_interval_against_hand_computation(values):
  n = len(values)
  mean = sum(values) / n
  std = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5
  half = T_975[n - 1] * std / n ** 0.5  # the table has 6 decimals: atol 1e-6 below
  interval = stats.t_interval(values)
  np.testing.assert_allclose([interval.mean, interval.std, interval.low, interval.high],
                             [mean, std, mean - half, mean + half], rtol=0, atol=1e-6)
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


@pytest.mark.parametrize("low, high, direction, bound, expected", [
    (-0.8, -0.2, -1, 0.0, stats.REPRODUCED),
    (-0.8, -0.2, 1, 0.0, stats.NOT_REPRODUCED),
    (0.2, 0.8, 1, 0.0, stats.REPRODUCED),
    (0.2, 0.8, -1, 0.0, stats.NOT_REPRODUCED),
    (-0.2, 0.8, -1, 0.0, stats.INCONCLUSIVE),
    (-0.2, 0.8, 1, 0.0, stats.INCONCLUSIVE),
    (0.01, 0.03, -1, 0.05, stats.REPRODUCED),  # below the bound though above 0
    (0.01, 0.03, -1, 0.005, stats.NOT_REPRODUCED),
    (0.01, 0.03, -1, 0.02, stats.INCONCLUSIVE),
    (0.0, 0.5, 1, 0.0, stats.INCONCLUSIVE),  # touching the bound is not excluding it
])
def test_verdict_rule(low, high, direction, bound, expected):
  assert stats.verdict(_interval(low, high), direction, bound) == expected


def test_verdict_rejects_a_bad_direction():
  with pytest.raises(ValueError, match="direction must be"):
    stats.verdict(_interval(0.1, 0.2), 0)


def _records(arm, losses):
  return [{"arm": arm, "seed": seed, "val_loss": loss} for seed, loss in enumerate(losses)]


def test_judge_uses_the_claimed_direction_and_penalty():
  control = [2.0, 2.1, 1.9, 2.05]
  arms = {"AdamW": _records("AdamW", control),
          "hard SAGGS": _records("hard SAGGS", [x - 0.05 for x in control]),
          "soft SAGGS": _records("soft SAGGS", [x + d for x, d in zip(control, [.1, -.1, .1, -.1])])}
  lines = study.report_claims("imbalance", arms)
  assert lines[0].startswith(stats.REPRODUCED + ": Kim (2026), hard SAGGS")
  assert lines[1].startswith(stats.INCONCLUSIVE + ": Kim (2026), soft SAGGS")
  # Balanced: hard SAGGS - AdamW must stay below 0.2 x the (positive) imbalance penalty.
  gain = np.exp(control) - np.exp(np.array(control) - 0.05)  # PPL hard SAGGS gains per seed
  lines = study.report_claims("balanced", arms, {"hard SAGGS": (gain, "penalty")})
  assert lines[0].startswith(stats.REPRODUCED)
  worse = {"AdamW": arms["AdamW"], "hard SAGGS": _records("hard SAGGS", [x + 0.05 for x in control])}
  lines = study.report_claims("balanced", worse, {"hard SAGGS": (gain, "penalty")})
  assert lines[0].startswith(stats.NOT_REPRODUCED)
  lines = study.report_claims("balanced", arms, {"hard SAGGS": (-gain, "penalty")})
  assert lines[0].startswith(stats.INCONCLUSIVE) and "nothing to recover" in lines[0]


def test_store_skips_finished_runs_and_resumes(tmp_path):
  calls = []

  def fake_train(seed, desc):
    calls.append(seed)
    return {"eval_step": np.array([0, 5]), "eval_loss": np.array([5.0, 2.0 + seed])}

  specs = [study.Spec("e", "a", seed, {"lr": 1e-3}, lambda desc, s=seed: fake_train(s, desc))
           for seed in range(3)]
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


def _gpu_study_tiny(out):
  return subprocess.run(
      [sys.executable, str(ROOT / "examples" / "gpu_study.py"), "--tiny", "--out", str(out)],
      cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
      timeout=300, check=True)


def test_gpu_study_tiny_runs_then_resumes_without_training(tmp_path):
  first = _gpu_study_tiny(tmp_path)
  jsonl = (tmp_path / "runs.jsonl").read_text()
  records = [json.loads(line) for line in jsonl.splitlines()]
  assert sorted((r["experiment"], r["arm"], r["seed"]) for r in records) == sorted(
      ("imbalance", arm, seed) for arm in study.IMBALANCE_ARMS for seed in (0, 1))
  # The table holds the JSONL's numbers: each arm's mean ± sample std of the val loss.
  for arm in study.IMBALANCE_ARMS:
    losses = np.array([r["val_loss"] for r in records if r["arm"] == arm])
    assert f"{losses.mean():.4f} ± {losses.std(ddof=1):.4f}" in first.stdout
  assert first.stdout.count("Kim (2026)") == 2
  for name in ("imbalance_differences.png", "imbalance_curves.png"):
    assert (tmp_path / name).stat().st_size > 10_000

  second = _gpu_study_tiny(tmp_path)
  assert "6 of 6 runs already in" in second.stderr
  assert "imbalance AdamW seed 0" not in second.stderr  # no progress bar: nothing trained
  assert (tmp_path / "runs.jsonl").read_text() == jsonl
  assert second.stdout == first.stdout
