"""saggs_jax._src.discovery.primitives: every structural primitive's axis map, and which
primitives move axes at all, against hand-computed expectations."""

import pytest

from saggs_jax._src.discovery.primitives import RULES, rule_of


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
  assert rule_of("erf_inv").axes is None
