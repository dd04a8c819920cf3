"""Paired statistics for the study: mean ± std, t-intervals, direction and equivalence tests.

Runs that share a seed share the initialisation and the batches, so the
comparison of two arms is made on their per-seed differences ``d_i = x_i - y_i``
(a paired design): the interval is ``mean(d) ± t_{1-α/2, n-1} · std(d) / sqrt(n)``
with the sample standard deviation (``ddof=1``).

Two kinds of claim are tested at level ``α`` (0.05 unless a multiplicity
correction lowers it):

* a direction ("the arm lowers the loss"): the ``1 - α`` interval lies wholly
  on the claimed side of 0;
* an equivalence ("the arm costs nothing"), by two one-sided tests (TOST,
  Schuirmann 1987): both ``d > -m`` and ``d < m`` are shown at level ``α``, that
  is the ``1 - 2α`` interval (90% at ``α = 0.05``) lies inside ``(-m, m)`` for
  a margin ``m`` fixed before the data.

Used by the study (:mod:`harness.study`) and ``examples/qk_clip.py``;
like the rest of :mod:`harness`, not a stable API.

>>> from harness import stats
>>> d = stats.paired_differences([2.0, 2.1, 1.9, 2.0], [2.1, 2.3, 2.0, 2.2])
>>> interval = stats.t_interval(d)
>>> print(f"{interval.mean:+.3f} [{interval.low:+.3f}, {interval.high:+.3f}]")
-0.150 [-0.242, -0.058]
>>> stats.verdict(interval, -1)
'direction reproduced'
>>> stats.equivalence(d, margin=0.01)[1]
'not equivalent'
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats as scipy_stats

REPRODUCED = "direction reproduced"
NOT_REPRODUCED = "direction not reproduced"
EQUIVALENT = "equivalent within the margin"
NOT_EQUIVALENT = "not equivalent"
INCONCLUSIVE = "inconclusive at this scale"


class Interval(NamedTuple):
  """Mean of ``n`` values, their sample std and a two-sided t confidence interval."""

  mean: float
  std: float
  low: float
  high: float
  n: int


def mean_std(values: ArrayLike) -> tuple[float, float]:
  """``(mean, sample std)``; the std of a single value is 0."""
  values = np.asarray(values, np.float64)
  return float(values.mean()), float(values.std(ddof=1)) if values.size > 1 else 0.0


def paired_differences(arm: ArrayLike, control: ArrayLike) -> np.ndarray:
  """``arm[i] - control[i]`` per seed; both sequences are ordered by the same seeds."""
  arm, control = np.asarray(arm, np.float64), np.asarray(control, np.float64)
  if arm.shape != control.shape or arm.ndim != 1:
    raise ValueError(
      f"paired values need two 1-D sequences of one length, got shapes "
      f"{arm.shape} and {control.shape}"
    )
  return arm - control


def t_quantile(probability: float, df: int) -> float:
  """The ``probability`` quantile of Student's t with ``df`` degrees of freedom."""
  return float(scipy_stats.t.ppf(probability, df))


def t_interval(values: ArrayLike, confidence: float = 0.95) -> Interval:
  """Two-sided t confidence interval of the mean of ``values`` (at least 2 of them)."""
  values = np.asarray(values, np.float64)
  if values.size < 2:
    raise ValueError(f"a t-interval needs at least 2 values, got {values.size}")
  mean, std = mean_std(values)
  half = t_quantile(0.5 + confidence / 2, values.size - 1) * std / np.sqrt(values.size)
  return Interval(mean, std, float(mean - half), float(mean + half), int(values.size))


def verdict(interval: Interval, direction: int) -> str:
  """Whether the claim "the difference has the sign ``direction``" holds.

  ``direction`` is +1 (claimed positive) or -1 (claimed negative). The
  direction is reproduced when the interval lies wholly on the claimed side of
  0, not reproduced when it lies wholly on the other side, and inconclusive
  when it contains 0.
  """
  if direction not in (-1, 1):
    raise ValueError(f"direction must be +1 or -1, got {direction!r}")
  low, high = sorted(direction * x for x in (interval.low, interval.high))
  if low > 0:
    return REPRODUCED
  if high < 0:
    return NOT_REPRODUCED
  return INCONCLUSIVE


def equivalence(values: ArrayLike, margin: float, alpha: float = 0.05) -> tuple[Interval, str]:
  """TOST of "``|mean| < margin``" at level ``alpha``: the ``1 - 2 alpha`` interval and verdict.

  Equivalent when the interval lies inside ``(-margin, margin)``; not
  equivalent when it lies wholly outside (``d > margin`` or ``d < -margin`` is
  then shown at level ``alpha``); inconclusive otherwise.
  """
  if not margin > 0:
    raise ValueError(f"the equivalence margin must be positive, got {margin!r}")
  interval = t_interval(values, 1 - 2 * alpha)
  if -margin < interval.low and interval.high < margin:
    return interval, EQUIVALENT
  if interval.low >= margin or interval.high <= -margin:
    return interval, NOT_EQUIVALENT
  return interval, INCONCLUSIVE
