"""saggs_jax._src.discovery.propagation: the axis bookkeeping (reshape blocks, every structural
primitive's axis map, dot_general output positions), the typed reasons and a factor followed
to the next linear, against hand-computed expectations. tests/test_discover*.py check the whole
pipeline on models."""

import jax
import jax.numpy as jnp
import pytest

from saggs_jax._src.discovery import propagation
from saggs_jax._src.discovery.program import Program
from saggs_jax._src.discovery.propagation import (
  RULES,
  Trace,
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
  "prim, shape, out_shape, params, expected",
  [
    # output axis k is input axis permutation[k]: input 2 -> 0, 0 -> 1, 1 -> 2
    ("transpose", (2, 3, 4), (4, 2, 3), {"permutation": (2, 0, 1)}, [[1], [2], [0]]),
    ("broadcast_in_dim", (3,), (2, 3), {"broadcast_dimensions": (1,)}, [[1]]),
    ("reshape", (6, 4), (2, 3, 4), {}, [[0, 1], [2]]),
    ("squeeze", (1, 4, 1), (4,), {"dimensions": (0, 2)}, [[], [0], []]),
    ("expand_dims", (4, 5), (1, 4, 5), {"dimensions": (0,)}, [[1], [2]]),
    ("scan_slice", (7, 4, 5), (4, 5), {}, [[], [0], [1]]),  # the layer axis is consumed
    ("scan_stack", (4, 5), (7, 4, 5), {}, [[1], [2]]),
    ("stack", (4, 5), (4, 2, 5), {"axis": 1}, [[0], [2]]),
    ("slice", (4, 6), (4, 2), {}, [[0], [1]]),
    ("convert_element_type", (4, 6), (4, 6), {}, [[0], [1]]),
  ],
)
def test_axis_maps(prim, shape, out_shape, params, expected):
  axes = RULES[prim].axes
  assert axes is not None
  assert axes(shape, out_shape, params) == expected


def test_only_axis_movers_have_axis_maps():
  assert {p for p, rule in RULES.items() if rule.axes is None} == {
    "add",
    "sub",
    "add_any",
    "mul",
    "div",
    "max",
    "min",
    "ge",
    "gt",
    "le",
    "lt",
    "abs",
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "argmax",
    "argmin",
    "dot_general",
    "select_n",
  }
  # an unknown primitive is a nonlinearity: it moves nothing
  assert propagation.rule_of("erf_inv").axes is None


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
  assert propagation.dot_out_axis(dims, shapes, side) == expected


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


def _trace(forward, params, x, leaf):
  """The trace of ``leaf``'s factor from its first use in ``forward(params, x)``."""
  leaves = list(params.values())
  closed = jax.make_jaxpr(lambda p, x: forward(dict(zip(params, p)), x))(leaves, x)
  flow = propagation.flow(Program(closed, len(leaves)))
  (use,) = flow.uses[leaf]
  eqn = flow.prog.eqns[use.eqn]
  start = propagation.tag({1: use.view.axes[1]})  # the kernel's output columns
  assert start is not None
  return propagation.follow(flow, use.eqn, eqn.outs[0], start, leaves[leaf].shape)


def test_follow_reaches_the_next_linear_with_what_it_passed_through():
  params = {"up": jnp.ones((3, 4)), "down": jnp.ones((4, 2))}
  x = jnp.ones((2, 3))
  relu = _trace(lambda p, x: jax.nn.relu(x @ p["up"]) @ p["down"], params, x, 0)
  (reach,) = relu.reaches
  assert reach.leaf == 1 and reach.amap == {1: {0}}  # up's columns meet down's rows
  assert not reach.reasons and reach.positive and propagation.Via.RELU in relu.through
  tanh = _trace(lambda p, x: jnp.tanh(x @ p["up"]) @ p["down"], params, x, 0)
  (reach,) = tanh.reaches
  assert reach.reasons == {nonlinear("tanh")} and not reach.positive
  residual = _trace(
    lambda p, x: (x @ p["up"] + x @ p["skip"]) @ p["down"],
    {**params, "skip": jnp.ones((3, 4))},
    x,
    0,
  )
  assert residual.breaks == {propagation.RESIDUAL} and not residual.reaches


def _block_of_concat(after, axis=-1):
  """The trace of ``q``'s columns concatenated (along ``axis``) with an activation that the
  factor does not reach (MLA's query: its non-rotary dims, then rotary ones), then
  ``after(q, k, params)``, ``k`` concatenated alike."""
  params = {"q": jnp.ones((3, 4)), "k": jnp.ones((3, 4)), "o": jnp.ones((6, 2))}
  x = jnp.ones((2, 3))

  def forward(p, x):
    rest = jnp.tanh(x[:, :2] if axis else x[:, :1] * jnp.ones((2, 4)))  # not reached
    q = jnp.concatenate([x @ p["q"], rest], axis)
    k = jnp.concatenate([x @ p["k"], rest], axis)
    return after(q, k, p)

  return _trace(forward, params, x, 0)


def test_a_concatenated_block_scales_its_span_only_and_meets_the_same_span():
  (meet,) = _block_of_concat(lambda q, k, p: q @ k.T).meets
  assert meet.span == (0, 0, 4) and not meet.reasons  # contracted dim 0, entries 0:4
  (meet,) = _block_of_concat(lambda q, k, p: (2.0 * q).T.T @ k.T).meets  # moved, scaled
  assert meet.span == (0, 0, 4) and not meet.reasons
  unlike = propagation.UNLIKE
  (meet,) = _block_of_concat(lambda q, k, p: jnp.flip(q, -1) @ k.T).meets  # entries moved
  assert unlike in meet.reasons
  (meet,) = _block_of_concat(lambda q, k, p: jnp.maximum(q, 0.0) @ k.T).meets  # no span rule
  assert unlike in meet.reasons
  (reach,) = _block_of_concat(lambda q, k, p: q @ p["o"]).reaches  # rows 0:4 of o only
  assert unlike in reach.reasons
  # a block of the tokens: o's rows would compensate the other tokens too
  (reach,) = _block_of_concat(lambda q, k, p: q @ p["o"][:4], axis=0).reaches
  assert unlike in reach.reasons
