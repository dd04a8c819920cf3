"""Paired statistics for the study: mean ± std, 95% t-intervals and verdicts.

Runs that share a seed share the initialisation and the batches, so the
comparison of two arms is made on their per-seed differences ``d_i = x_i - y_i``
(a paired design): the interval is ``mean(d) ± t_{0.975, n-1} · std(d) / sqrt(n)``
with the sample standard deviation (``ddof=1``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from scipy import stats as scipy_stats

REPRODUCED = "reproduced"
NOT_REPRODUCED = "not reproduced"
INCONCLUSIVE = "inconclusive at this scale"


class Interval(NamedTuple):
  """Mean of ``n`` values, their sample std and a two-sided t confidence interval."""

  mean: float
  std: float
  low: float
  high: float
  n: int


def mean_std(values: Sequence[float]) -> tuple[float, float]:
  """``(mean, sample std)``; the std of a single value is 0."""
  values = np.asarray(values, np.float64)
  return float(values.mean()), float(values.std(ddof=1)) if values.size > 1 else 0.0


def paired_differences(arm: Sequence[float], control: Sequence[float]) -> np.ndarray:
  """``arm[i] - control[i]`` per seed; both sequences are ordered by the same seeds."""
  arm, control = np.asarray(arm, np.float64), np.asarray(control, np.float64)
  if arm.shape != control.shape or arm.ndim != 1:
    raise ValueError(f"paired values need two 1-D sequences of one length, got shapes "
                     f"{arm.shape} and {control.shape}")
  return arm - control


def t_quantile(probability: float, df: int) -> float:
  """The ``probability`` quantile of Student's t with ``df`` degrees of freedom."""
  return float(scipy_stats.t.ppf(probability, df))


def t_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
  """Two-sided t confidence interval of the mean of ``values`` (at least 2 of them)."""
  values = np.asarray(values, np.float64)
  if values.size < 2:
    raise ValueError(f"a t-interval needs at least 2 values, got {values.size}")
  mean, std = mean_std(values)
  half = t_quantile(0.5 + confidence / 2, values.size - 1) * std / np.sqrt(values.size)
  return Interval(mean, std, mean - half, mean + half, int(values.size))


def verdict(interval: Interval, direction: int, bound: float = 0.0) -> str:
  """Whether the claim "the difference lies on side ``direction`` of ``bound``" holds.

  ``direction`` is +1 (claimed above ``bound``) or -1 (claimed below). The
  claim is reproduced when the interval lies wholly on the claimed side of
  ``bound``, not reproduced when it lies wholly on the other side, and
  inconclusive when it contains ``bound``.
  """
  if direction not in (-1, 1):
    raise ValueError(f"direction must be +1 or -1, got {direction!r}")
  low, high = sorted(direction * (x - bound) for x in (interval.low, interval.high))
  if low > 0:
    return REPRODUCED
  if high < 0:
    return NOT_REPRODUCED
  return INCONCLUSIVE
