"""Whole matrices on each device for the Newton-Schulz and Gram rules.

A matrix sharded along its rows or columns makes every product ``X Xᵀ`` of an
iteration reach across devices, and the partitioner keeps each iterate sharded:
one all-gather per matmul, so the traffic grows with the number of steps.
Instead, a stack of same-sized matrices ``(B, rows, cols)`` is moved once so
that each device holds whole matrices, orthogonalised locally, and moved back:

* all-to-all: the batch axis is padded to a multiple of the ``n`` devices and
  sharded over them (``ceil(B / n)`` matrices each, in and out);
* all-gather: a single matrix (``B = 1``), for which the all-to-all would move
  it twice, is gathered whole onto every device; the way back is a local slice.

The mesh comes from the context (``jax.set_mesh``), else from the arrays' own types
(:func:`on_mesh`): under ``jit`` the type of an array placed by a ``NamedSharding``
carries its mesh, Auto or Explicit, also with the deprecated ``with mesh:`` or
``jit``'s ``in_shardings`` alone. Under an Explicit mesh the
types name the axes that shard the parameters: those carry the batch, and the
update gets the parameter's sharding back. Under an Auto mesh the types do not
say, so every mesh axis carries the batch and the partitioner places the update
from where it is used: added to the parameters, or ``jit``'s ``out_shardings``.
JAX 0.12 removed the one hint that could tie it to the gradient's sharding
(``shard_alike``); an update returned bare from ``jit`` under an Auto mesh
comes back replicated (bench/bench_comms.py counts the collectives of both
uses). Without a mesh in either (arrays on one device, or inside ``shard_map``)
nothing changes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P


def _names(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@contextlib.contextmanager
def on_mesh(leaves: Sequence[jax.Array]) -> Iterator[None]:
  """The context's mesh, or the mesh that types ``leaves`` when the context has none, made
  the abstract mesh of the block it guards (where :func:`spread_axes`, :func:`in_place` and
  :func:`locally` read it): without it, the iterations would all-gather their sharded
  iterates on every step, silently."""
  mesh = jax.sharding.get_abstract_mesh()
  typed = [m for m in (jax.typeof(x).sharding.mesh for x in leaves) if not m.empty]
  if not mesh.empty or not typed:
    yield
    return
  with jax.sharding.use_abstract_mesh(typed[0]):
    yield


def spread_axes(leaves: Sequence[jax.Array]) -> tuple[str, ...]:
  """The mesh axes over which the matrices of ``leaves`` are spread: under an
  Explicit mesh those that shard a leaf, under an Auto one every axis of size
  > 1; none without a mesh or inside ``shard_map`` (Manual axes)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  used = {a for x in leaves for entry in jax.typeof(x).sharding.spec for a in _names(entry)}
  # An Explicit axis in a type counts even of size 1: the matmuls need it gone from the types.
  return tuple(
    a
    for a, t in zip(mesh.axis_names, mesh.axis_types)
    if (t == AxisType.Auto and mesh.shape[a] > 1) or (t == AxisType.Explicit and a in used)
  )


def in_place(fn: Callable[[list], list], leaves: list, like: list, axes: tuple[str, ...]) -> list:
  """``fn(leaves)``, a list of arrays shaped like ``leaves``. Under an Explicit
  mesh ``fn`` runs with Auto axes (its reshapes and gathers are the
  partitioner's to place) and each array comes back in the sharding of its
  array in ``like`` (the gradients, typed as the parameters); under an Auto
  mesh the partitioner places them (``jit``'s ``out_shardings``, or the
  parameters they are added to, settle it)."""
  if not axes:
    return fn(leaves)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.explicit_axes:
    out_sharding = [jax.typeof(x).sharding for x in like]
    auto = cast(
      Callable[[list], list],
      jax.sharding.auto_axes(fn, axes=mesh.explicit_axes, out_sharding=out_sharding),
    )
    return auto(leaves)
  return fn(leaves)


def locally(
  direction: Callable[[jax.Array], jax.Array],
  x: jax.Array,
  axes: tuple[str, ...],
  batched: bool = True,
) -> jax.Array:
  """``direction(x)`` on ``(batch..., rows, cols)`` matrices, each held whole by
  one device (see the module docstring). With ``batched``, ``direction`` acts on
  each matrix of one leading axis on its own (zero matrices pad it); otherwise
  the matrix axes are gathered and the batch axes keep their sharding."""
  if not axes:
    return direction(x)
  constrain = jax.lax.with_sharding_constraint
  if not batched:
    spec = P(*(P.UNCONSTRAINED,) * (x.ndim - 2), None, None)
    return constrain(direction(constrain(x, spec)), spec)
  shape = x.shape
  x = x.reshape((-1,) + shape[-2:])
  mesh = jax.sharding.get_abstract_mesh()
  n = math.prod(mesh.shape[a] for a in axes)
  count = x.shape[0]
  per_device = -(-count // n)
  if 2 * per_device > count:  # the all-to-all would move more than an all-gather
    whole = P(None, None, None)
    return constrain(direction(constrain(x, whole)), whole).reshape(shape)
  spec = P(axes, None, None)
  padded = jnp.pad(x, ((0, per_device * n - count), (0, 0), (0, 0)))
  return constrain(direction(constrain(padded, spec)), spec)[:count].reshape(shape)
