"""What balancing's norms, solver and scaling share: types, the compute dtype, dtype limits,
and the replicated layout of per-group values on a mesh."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import DTypeLike

Factors = dict[str, jax.Array]
AxisName = str | Sequence[str] | None


def compute_dtype(dtype: DTypeLike) -> jnp.dtype:
  """At least float32, float64 when the leaf already is."""
  return jnp.promote_types(dtype, jnp.float32)


def is_explicit(x: jax.Array) -> bool:
  """Whether ``x`` is typed with an Explicit-mode sharding (its shardings must then agree)."""
  return jax.typeof(x).sharding.mesh._any_axis_explicit


def replicated(x: jax.Array) -> jax.Array:
  """``x`` (small: one value per group) pinned replicated on its mesh, so that XLA neither
  shards nor gathers it: the mesh of its Explicit-mode type (even outside
  ``jax.set_mesh``), else the current one; nothing to do without a mesh or inside
  ``shard_map``."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.manual_axes:
    return x
  if is_explicit(x):
    return jax.sharding.reshard(x, NamedSharding(jax.typeof(x).sharding.mesh, PartitionSpec()))
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, PartitionSpec())


def ordered_control_flow() -> bool:
  """Whether collectives inside ``lax.cond`` or ``lax.while_loop`` keep their order with the
  collectives outside them, on every device of every process.

  Not on XLA:CPU across processes (gloo or MPI collectives): its runtime orders two
  collectives only by when they *start*, and a conditional or loop starts before its body
  issues its collectives, so a later collective outside it can overtake them on some
  devices and not others; the job then aborts ("collective mismatch"). There, no
  collective may sit inside control flow. The answer is the same on every process.
  """
  return jax.process_count() == 1 or jax.default_backend() != "cpu"


def log_dtype_max(dtype: DTypeLike) -> float:
  """log of the largest value a leaf of ``dtype`` may be scaled to, with a rounding margin."""
  return float(np.log(float(jnp.finfo(dtype).max)) + np.log1p(-(2.0**-8)))
