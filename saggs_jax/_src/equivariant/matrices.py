"""How a rule sees a parameter: a stack of matrices ``(batch..., rows, cols)``.

A :class:`MatrixPlan` moves a leaf's axes into that layout and back; the unit planner takes
the rows from the units a symmetry permutes (``UnitDimensionNumbers``), the polar planner from
the reduction axes (and splits a fused head axis, ``Heads``); leaves declared jointly are
concatenated into one matrix per block and cut apart after (:func:`stacked_map`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from optax.contrib import MuonDimensionNumbers

from saggs_jax._src.equivariant.dimension_numbers import (
  Heads,
  UnitDimensionNumbers,
  muon_axes,
  partition,
)
from saggs_jax._src.equivariant.dimension_numbers import as_tuple as _as_tuple
from saggs_jax._src.equivariant.dimension_numbers import normalize as _normalize
from saggs_jax._src.paths import match


class MatrixPlan(NamedTuple):
  """How one parameter is viewed as ``(batch..., rows, cols)`` matrices."""

  split_shape: tuple[int, ...]  # the shape after splitting heads out of one axis
  perm: tuple[int, ...]  # transpose of the split array to batch + rows + cols
  matrix_shape: tuple[int, ...]


def to_matrix(x: jax.Array, plan: MatrixPlan) -> jax.Array:
  return x.reshape(plan.split_shape).transpose(plan.perm).reshape(plan.matrix_shape)


def from_matrix(y: jax.Array, plan: MatrixPlan, shape: tuple[int, ...]) -> jax.Array:
  permuted = tuple(plan.split_shape[a] for a in plan.perm)
  return y.reshape(permuted).transpose(np.argsort(plan.perm)).reshape(shape)


def make_plan(shape, batch, rows, cols) -> MatrixPlan:
  if sorted(batch + rows + cols) != list(range(len(shape))):
    raise ValueError(
      f"batch axes {batch}, row axes {rows} and column axes {cols} must partition the axes"
    )
  perm = tuple(sorted(batch)) + rows + cols
  matrix_shape = tuple(shape[a] for a in sorted(batch)) + (
    math.prod(shape[a] for a in rows),
    math.prod(shape[a] for a in cols),
  )
  return MatrixPlan(tuple(shape), perm, matrix_shape)


def split_axis(shape, axis: int, count: int, interleaved: bool):
  """Splits ``axis`` into ``count`` pieces, contiguous or interleaved (piece k
  holds indices k, k + count, ...). Returns the split shape, the axis that
  indexes the pieces, and a map from the other axes to their new positions
  (``axis`` itself goes to the axis within a piece)."""
  n = shape[axis]
  split = (
    shape[:axis] + ((n // count, count) if interleaved else (count, n // count)) + shape[axis + 1 :]
  )
  piece, within = (axis + 1, axis) if interleaved else (axis, axis + 1)
  return split, piece, lambda axes: tuple(within if a == axis else a + (a > axis) for a in axes)


def unit_planner(dims: UnitDimensionNumbers):
  """Rows: the unit axis (holding ``fused`` branches per unit); columns: the
  feature axes, then the branch index."""

  def plan(shape):
    unit, features, batch = dims.axes(len(shape))
    if dims.fused == 1:
      return make_plan(shape, batch, (unit,), features)
    if dims.fused < 1 or shape[unit] % dims.fused:
      raise ValueError(
        f"unit axis {unit} of size {shape[unit]} does not hold {dims.fused} fused branches"
      )
    split, piece, move = split_axis(shape, unit, dims.fused, dims.interleaved)
    return make_plan(split, move(batch), move((unit,)), move(features) + (piece,))

  return plan


def polar_planner(reduction_axes, output_axes, batch_axes, heads: Heads | None):
  """Rows: reduction axes; columns: output axes; ``heads.axis`` optionally split into heads.

  ``reduction_axes`` may be a ``MuonDimensionNumbers``: then every other axis
  is batched, whatever the rank."""
  if heads is not None and not isinstance(heads, Heads):
    raise TypeError(f"heads must be a saggs_jax.equivariant.Heads, got {heads!r}.")
  if heads is not None and (heads.num is None) == (heads.dim is None):
    raise ValueError(f"{heads}: give Heads(num=...) or Heads(dim=...), exactly one of them.")
  if isinstance(reduction_axes, MuonDimensionNumbers):
    if (output_axes, batch_axes) != (-1, ()):
      raise ValueError(
        f"{reduction_axes} names the matrix axes (the others are batched): "
        f"give neither output_axes nor batch_axes with it."
      )
    axes_of = functools.partial(muon_axes, reduction_axes)
  else:
    rank = sum(len(_as_tuple(a)) for a in (reduction_axes, output_axes, batch_axes))

    def axes_of(ndim):
      if ndim != rank:
        raise ValueError(
          f"expected rank {rank} (reduction axes {reduction_axes}, "
          f"output axes {output_axes}, batch axes {batch_axes})"
        )
      return partition(rank, [reduction_axes, output_axes], batch_axes)

  def plan(shape):
    rows, cols, batch = axes_of(len(shape))
    if heads is None:
      return make_plan(shape, batch, rows, cols)
    (h,) = _normalize(heads.axis, len(shape))
    count = heads.num or shape[h] // heads.dim
    if h in batch or count < 1 or shape[h] % count:
      raise ValueError(
        f"axis {h} of size {shape[h]} does not split into "
        f"{f'{heads.num} heads' if heads.num else f'heads of size {heads.dim}'}"
      )
    # The head index joins the batch axes.
    split, piece, move = split_axis(shape, h, count, heads.interleaved)
    return make_plan(split, move(batch) + (piece,), move(rows), move(cols))

  return plan


def joint_blocks(paths: Sequence[str], joint: Sequence[str]) -> list[tuple[int, ...]]:
  """Leaf indices per block: each group that ``joint`` pairs up, then every other leaf alone."""
  groups: dict[tuple[str, ...], dict[int, int]] = {}
  singles = []
  for i, path in enumerate(paths):
    hits = [(k, caps) for k, p in enumerate(joint) if (caps := match(p, path)) is not None]
    if len(hits) > 1:
      raise ValueError(
        f"Parameter {path!r} matches several joint patterns {[joint[k] for k, _ in hits]}."
      )
    if hits:
      groups.setdefault(hits[0][1], {})[hits[0][0]] = i
    else:
      singles.append((i,))
  for slot in groups.values():
    if len(slot) < len(joint):
      missing = [p for k, p in enumerate(joint) if k not in slot]
      raise ValueError(
        f"Parameter {paths[next(iter(slot.values()))]!r} has no partner "
        f"matching {missing} among the joint patterns {list(joint)}."
      )
  return singles + [tuple(slot[k] for k in range(len(joint))) for slot in groups.values()]


def stacked_map(direction, xs: list[jax.Array]) -> list[jax.Array]:
  """``direction`` on every matrix stack of ``xs``, one call per distinct
  ``(rows, cols, dtype)``: same-sized matrices of different leaves (the layers
  of a model, each with its heads) are stacked along one batch axis.

  One batched Newton-Schulz (or ``eigh``) instead of one per leaf: on an
  accelerator, a few large kernels rather than many tiny ones.
  """
  groups: dict[tuple, list[int]] = {}
  for k, x in enumerate(xs):
    groups.setdefault((x.shape[-2:], x.dtype), []).append(k)
  out: list = [None] * len(xs)
  for ks in groups.values():
    if len(ks) == 1:
      out[ks[0]] = direction(xs[ks[0]])
      continue
    flat = [xs[k].reshape((-1,) + xs[k].shape[-2:]) for k in ks]
    result = direction(jnp.concatenate(flat, axis=0))
    for k, piece in zip(ks, jnp.split(result, np.cumsum([f.shape[0] for f in flat])[:-1])):
      out[k] = piece.reshape(xs[k].shape)
  return out
