"""saggs_jax._src.equivariant.matrices: a leaf viewed as (batch..., rows, cols) matrices and
back, against NumPy transposes and reshapes written out by hand."""

import numpy as np
import pytest
from optax.contrib import MuonDimensionNumbers

from saggs_jax._src.equivariant import matrices
from saggs_jax.equivariant import Heads, UnitDimensionNumbers

X = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)


def test_a_plan_transposes_batch_rows_cols_and_back():
  plan = matrices.make_plan(X.shape, (0,), (2,), (1,))
  m = np.asarray(matrices.to_matrix(X, plan))
  np.testing.assert_array_equal(m, X.transpose(0, 2, 1))  # (batch, rows=axis 2, cols=axis 1)
  np.testing.assert_array_equal(np.asarray(matrices.from_matrix(m, plan, X.shape)), X)
  with pytest.raises(ValueError, match="must partition the axes"):
    matrices.make_plan(X.shape, (0,), (1,), (1,))


@pytest.mark.parametrize("interleaved", [False, True])
def test_heads_split_out_of_an_output_axis(interleaved):
  """A (d=3, 2 heads x 2) kernel: each head's 3 x 2 block is one matrix, its columns the
  head's entries: contiguous (0, 1 | 2, 3) or interleaved (0, 2 | 1, 3)."""
  w = np.arange(12, dtype=np.float32).reshape(3, 4)
  plan = matrices.polar_planner(0, 1, (), Heads(num=2, axis=1, interleaved=interleaved))(w.shape)
  m = np.asarray(matrices.to_matrix(w, plan))
  cols = [[0, 2], [1, 3]] if interleaved else [[0, 1], [2, 3]]
  np.testing.assert_array_equal(m, np.stack([w[:, c] for c in cols]))
  np.testing.assert_array_equal(np.asarray(matrices.from_matrix(m, plan, w.shape)), w)


def test_muon_dimension_numbers_batch_every_other_axis():
  plan = matrices.polar_planner(MuonDimensionNumbers(1, 2), -1, (), None)(X.shape)
  np.testing.assert_array_equal(np.asarray(matrices.to_matrix(X, plan)), X)
  with pytest.raises(ValueError, match="does not split into 5 heads"):
    matrices.polar_planner(0, 1, (), Heads(num=5, axis=1))((3, 4))


def test_fused_units_become_columns():
  """An up|gate kernel (d=2, 2 x 3 units), units on axis 1: each unit's row holds its
  feature entries, then its two branches."""
  w = np.arange(12, dtype=np.float32).reshape(2, 6)
  plan = matrices.unit_planner(UnitDimensionNumbers(unit_axis=1, fused=2))(w.shape)
  m = np.asarray(matrices.to_matrix(w, plan))
  want = np.stack([w[:, [u, 3 + u]] for u in range(3)])  # (units, d, branches)
  np.testing.assert_array_equal(m, want.reshape(3, 4))
  np.testing.assert_array_equal(np.asarray(matrices.from_matrix(m, plan, w.shape)), w)


def test_joint_blocks_pair_up_by_wildcard_and_need_every_partner():
  paths = ["l/0/q", "l/0/k", "l/1/q", "l/1/k", "emb"]
  assert matrices.joint_blocks(paths, ["l/*/q", "l/*/k"]) == [(4,), (0, 1), (2, 3)]
  with pytest.raises(ValueError, match="has no partner"):
    matrices.joint_blocks(paths[:3], ["l/*/q", "l/*/k"])
