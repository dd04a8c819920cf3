"""saggs_jax._src.discovery.candidates: the groupings a candidate is tried at, and the blocks a
leaf is cut into (contiguous, or interleaved every ``period`` entries)."""

import numpy as np
import pytest

from saggs_jax._src.discovery.candidates import (
  Part,
  _partition,
  as_stacked,
  copy_axes,
  group_options,
  relative,
)
from saggs_jax._src.discovery.tags import Cut


@pytest.mark.parametrize(
  "sizes, splits, expected",
  [
    ([8, 8], {4}, [8, 4, 1]),  # per channel, per head of 2 (4 heads), one group
    ([8, 2], set(), [2, 1]),  # 8 query channels against 2 KV channels: at most 2 groups
    ([6, 6], {2, 3}, [6, 3, 2, 1]),
    ([8, 12], set(), [4, 1]),  # neither size divides the other: their common divisor
  ],
)
def test_group_options(sizes, splits, expected):
  assert group_options(sizes, splits) == expected


@pytest.mark.parametrize(
  "stacked, copies, stacked_back",
  [(0, (), 0), (2, (0, 1), 2), ((1,), (1,), (1,)), ((0, 2), (0, 2), (0, 2))],
)
def test_copy_axes_and_stacked_are_inverse_spellings(stacked, copies, stacked_back):
  assert copy_axes(stacked) == copies
  assert as_stacked(reversed(copies)) == stacked_back  # any order in, a count when they lead


def test_relative_counts_a_leaf_axis_among_the_axes_that_are_not_copies():
  # A (d, layers, F) MaxText kernel: its F axis is 2 of the leaf, 1 of a Pair's axes.
  assert [relative(a, (1,)) for a in (0, 2)] == [0, 1]
  assert [relative(a, 2) for a in (2, 3)] == [0, 1]  # two leading copy axes


def test_blocks_of_every_run_partition_the_run_and_index_every_run():
  # BLOOM's fused axis of 2 heads x (q, k, v) x 4 dims: q is [0, 4) of every run of 12
  cuts = {Cut(1, 0, 4, 12), Cut(1, 8, 12, 12)}
  assert _partition(cuts, (16, 24)) == (1, ((0, 4), (4, 8), (8, 12)), 12)  # k, a gap, is one
  assert _partition({Cut(1, 0, 4, 12), Cut(1, 0, 8)}, (16, 24)) is None  # two structures
  assert _partition({Cut(0, 2, 5)}, (8, 3)) == (0, ((0, 2), (2, 5), (5, 8)), 0)
  k = Part(1, 4, 8, ((0, 4), (4, 8), (8, 12)), 12)
  columns = np.arange(24).reshape(2, 3, 4)[:, 1].ravel()  # head by head, written here
  (_, index) = k.index(24)
  np.testing.assert_array_equal(index, columns)
  assert k.size(24) == 8 and Part(0, 2, 5, ((0, 2), (2, 5), (5, 8))).size(8) == 3
  assert Part(0, 2, 5, ((0, 2), (2, 5), (5, 8))).index(8) == (slice(2, 5),)
