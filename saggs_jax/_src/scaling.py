"""Applying factors: multiplying the declared leaves of any parameter-shaped tree.

A leaf with blocks is multiplied by each block's factors padded with ones along
the block axis (a concatenation, no reshape), so a sharded block axis stays
sharded.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import DTypeLike

from saggs_jax._src import paths
from saggs_jax._src.numerics import Factors, compute_dtype, is_explicit, replicated
from saggs_jax._src.plan import Plan, Slot


class Shared(dict):
  """Factors whose expanded multipliers, once computed, are reused: one update scales the
  parameters, gradients and moments and lands on the result with the same few, which
  are then traced (and compiled) once rather than once per tree."""

  def __init__(self, factors: Factors):
    super().__init__(factors)
    self.multipliers: dict[tuple, jax.Array] = {}


def _multiplier(
  slot: Slot, shape: tuple[int, ...], factors: Factors, power: float, dtype: DTypeLike
) -> jax.Array:
  """``factors ** (sign * power)`` expanded to one entry per index of the group axis, and
  with a block, to its span of the block axis, padded with ones outside it."""
  shared = getattr(factors, "multipliers", None)
  if shared is None:
    return _power(_expanded(slot, shape, factors, dtype), slot.sign * power)
  key = (slot, tuple(shape), jnp.dtype(dtype).name)
  if key not in shared:
    shared[key] = _expanded(slot, shape, factors, dtype)
  if key + (power,) not in shared:
    shared[key + (power,)] = _power(shared[key], slot.sign * power)
  return shared[key + (power,)]


def _power(f: jax.Array, e: float) -> jax.Array:
  e = int(e) if float(e).is_integer() else e  # integer powers multiply exactly
  return 1 / f if e == -1 else f**e


def _expanded(slot: Slot, shape: tuple[int, ...], factors: Factors, dtype: DTypeLike) -> jax.Array:
  """The factors of ``slot`` in ``dtype``, expanded (see :func:`_multiplier`)."""
  f = factors[slot.key].astype(dtype)
  inner = shape  # the shape of what the factors tile: the block
  if slot.block is not None:
    axis, start, stop = slot.block
    inner = shape[:axis] + (stop - start,) + shape[axis + 1 :]
  if slot.axis is not None:  # (..., groups) -> (..., size): each factor over its group
    n = inner[slot.axis]
    f = jnp.broadcast_to(f[..., None], f.shape + (n // slot.groups,)).reshape(f.shape[:-1] + (n,))
  if slot.axis is not None:  # the group axis to its place among the copy axes: a small array
    f = jnp.moveaxis(f, -1, slot.group_position)
  f = f.reshape(slot.broadcast_shape(inner))
  if slot.block is not None:  # ones on either side of the block: a concatenation, no reshape
    axis, start, stop = slot.block
    f = jnp.broadcast_to(f, f.shape[:axis] + (stop - start,) + f.shape[axis + 1 :])
    pad = [(0, 0)] * len(shape)
    pad[axis] = (start, shape[axis] - stop)
    f = jnp.pad(f, pad, constant_values=1)
  return f


def _like(m: jax.Array, x: jax.Array) -> jax.Array:
  """``m`` (broadcastable to ``x``) laid out so that ``m * x`` is local: sharded as ``x``
  along its kept axes under Explicit sharding, replicated otherwise."""
  if not is_explicit(x):
    return replicated(m)
  sharding = jax.typeof(x).sharding  # its mesh: x is typed with it even outside jax.set_mesh
  spec = tuple(sharding.spec) + (None,) * x.ndim
  return jax.sharding.reshard(
    m,
    NamedSharding(
      sharding.mesh, PartitionSpec(*(s if n > 1 else None for s, n in zip(spec, m.shape)))
    ),
  )


def leaf_multiplier(
  slots: Sequence[Slot], x: jax.Array, factors: Factors, power: float, dtype: DTypeLike
) -> jax.Array:
  """What leaf ``x`` declared in ``slots`` is multiplied by, broadcastable to it."""
  m = functools.reduce(
    jnp.multiply, [_multiplier(s, x.shape, factors, power, dtype) for s in slots]
  )
  return _like(m, x)


def scale_leaf(x: jax.Array, slots: Sequence[Slot], factors: Factors, power: float) -> jax.Array:
  """``x`` times the multiplier of ``slots`` (see :func:`scale_tree`), in at least float32."""
  dtype = compute_dtype(x.dtype)
  return (x.astype(dtype) * leaf_multiplier(slots, x, factors, power, dtype)).astype(x.dtype)


def scale_tree(
  plan: Plan,
  tree: Any,
  factors: Factors,
  power: float,
  is_leaf: Callable[[Any], bool] | None = None,
) -> Any:
  """Multiplies each declared leaf of a parameter-shaped ``tree`` by ``c ** (sign * power)``.

  ``power`` is the transport degree: +1 for parameters (A*c, B/c), -1 for
  gradient-like state (momentum), -2 for squared gradients (Adam's ``nu``).
  Leaves that no pair declares are returned as they are (the same object).
  Paths are relative to ``tree``'s root, so this works on ``mu`` or ``nu``
  exactly as on the parameters; leaves absent from ``tree`` (``MaskedNode``)
  are simply not visited.
  """

  def visit(key_path, x):
    slots = plan.slots.get(paths.path_str(key_path))
    if (
      slots is None
      or not hasattr(x, "shape")
      or tuple(x.shape) != plan.shapes[paths.path_str(key_path)]
    ):
      return x
    return scale_leaf(x, slots, factors, power)

  return jax.tree_util.tree_map_with_path(visit, tree, is_leaf=is_leaf)


def land_on(params, updates, target, plan, factors):
  """Updates that move the declared leaves of ``params`` to ``target``; others untouched.

  Where the factor is 1 (which includes every group with a zero or non-finite
  norm) the inner update is kept bit for bit: ``target - params`` would
  perturb it by rounding, and turn an inf parameter into NaN (inf - inf).
  """

  def visit(key_path, u, p, t):
    slots = plan.slots.get(paths.path_str(key_path))
    if slots is None:
      return u
    dtype = compute_dtype(p.dtype)
    moved = (t.astype(dtype) - p.astype(dtype)).astype(u.dtype)
    return jnp.where(leaf_multiplier(slots, p, factors, 1.0, dtype) == 1, u, moved)

  return jax.tree_util.tree_map_with_path(visit, updates, params, target)
