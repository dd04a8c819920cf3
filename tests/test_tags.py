"""saggs_jax._src.discovery.tags: reshape blocks, dot_general output positions, the typed
reasons and the merging of a trace's parts, against hand-computed expectations."""

import pytest

from saggs_jax._src.discovery.tags import (
  Trace,
  dot_out_axis,
  explain,
  inexact,
  nonlinear,
  reshape_map,
)


@pytest.mark.parametrize(
  "old, new, axes, sizes",
  [
    # a channel axis of 6 split into 2 heads of 3: both new axes hold it
    ((6, 4), (2, 3, 4), [[0, 1], [2]], [[2, 3], [4]]),
    # heads merged back: old axes 0 and 1 land on new axis 0 of size 6
    ((2, 3, 4), (6, 4), [[0], [0], [1]], [[6], [6], [4]]),
    # size-1 axes map nowhere, on either side
    ((1, 6), (6, 1), [[], [0]], [[], [6]]),
    # (4, 6) -> (2, 12): no axis maps alone, one block of two axes on each side
    ((4, 6), (2, 12), [[0, 1], [0, 1]], [[2, 12], [2, 12]]),
    # unchanged
    ((3, 5), (3, 5), [[0], [1]], [[3], [5]]),
  ],
)
def test_reshape_map(old, new, axes, sizes):
  assert reshape_map(old, new) == (axes, sizes)


@pytest.mark.parametrize(
  "dims, shapes, side, expected",
  [
    # x(m, k) @ y(k, n) -> (m, n)
    ((((1,), (0,)), ((), ())), [(2, 3), (3, 5)], 0, {0: 0}),
    ((((1,), (0,)), ((), ())), [(2, 3), (3, 5)], 1, {1: 1}),
    # batched x(b, m, k) @ y(b, k, n) -> (b, m, n)
    ((((2,), (1,)), ((0,), (0,))), [(4, 2, 3), (4, 3, 5)], 0, {0: 0, 1: 1}),
    ((((2,), (1,)), ((0,), (0,))), [(4, 2, 3), (4, 3, 5)], 1, {0: 0, 2: 2}),
    # x(k, m) contracted on its leading axis against y(n, k): (m, n)
    ((((0,), (1,)), ((), ())), [(3, 2), (5, 3)], 1, {0: 1}),
  ],
)
def test_dot_out_axis(dims, shapes, side, expected):
  assert dot_out_axis(dims, shapes, side) == expected


def test_reasons_are_told_apart_by_kind_not_by_their_text():
  assert explain(frozenset({nonlinear("tanh"), inexact("an added constant")}), "here") == (
    "not positively homogeneous: tanh here"
  )
  # a one-word phrase is no primitive name
  assert explain(frozenset({inexact("clipped"), inexact("a division by it")}), "here") == (
    "not exact: a division by it; clipped here"
  )
  assert nonlinear("x") != inexact("x")


def test_trace_parts_merge_in_order():
  a = Trace(reaches=("r1",), breaks=frozenset({"x"}))  # type: ignore[arg-type]
  b = Trace(reaches=("r2",), breaks=frozenset({"x", "y"}), splits=frozenset({2}))  # type: ignore[arg-type]
  merged = Trace.merge([a, b])
  assert merged.reaches == ("r1", "r2") and merged.breaks == {"x", "y"}
  assert merged.splits == {2} and Trace.merge([]) == Trace()
