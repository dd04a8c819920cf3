"""Checksums of saved arrays: two 32-bit hashes of every array's bits, computed on the
devices that hold them (one fused integer reduction per array, no gather), so a corrupted
file is found when it is read back rather than restored silently wrong."""

from __future__ import annotations

import collections
import concurrent.futures
from typing import Any

import jax
import jax.numpy as jnp

from saggs_jax._src import paths

Checksums = dict[str, list[int]]  # path -> two uint32 hashes
ANOTHER_STEP = " Nothing was restored; restore another step."


def is_key(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


# ---------------------------------------------------------------------------
# Checksums: two sums of mix(word ^ mix(position + seed)) over every 32-bit
# word of an array, mod 2**32. mix is a bijection of uint32, so changing any
# single word (any flipped bit or byte) changes exactly one term and therefore
# each sum; moving words around (swapped elements) changes their position
# keys, which two independent 32-bit sums miss with probability ~2**-64.
# Integer addition is exact and order-free, so XLA may reduce a sharded array
# in any order, across devices and processes, and get the same bits.

_SEEDS = (0x9E3779B9, 0x7F4A7C15)


def _mix(h: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finaliser: a bijection that spreads every input bit."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
  """The bits of ``x`` as uint32: one word per element, two per 64-bit or complex one."""
  if is_key(x):
    x = jax.random.key_data(x)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([x.real, x.imag], axis=-1)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  info = jnp.iinfo if jnp.issubdtype(x.dtype, jnp.integer) else jnp.finfo
  bits = info(x.dtype).bits
  if bits < 32:
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}")).astype(jnp.uint32)
  return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _positions(shape: tuple[int, ...]) -> jax.Array:
  """The row-major flat index of every element, mod 2**32 (iotas: no reshape of a sharded array)."""
  index, stride = jnp.zeros(shape, jnp.uint32), 1
  for axis in reversed(range(len(shape))):
    index += jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
    stride *= shape[axis]
  return index


# Jitted on its own, so that a program hashing many leaves of one shape and dtype (a
# model's layers and their moments) traces and lowers it once, not once per leaf.
@jax.jit
def _checksum(x: jax.Array) -> jax.Array:
  words = _words(x)
  positions = _positions(words.shape)
  terms = [_mix(words ^ _mix(positions + jnp.uint32(seed))) for seed in _SEEDS]
  # Both sums in one variadic reduction, into which XLA fuses the terms: two jnp.sums
  # each wrote their terms to a full-size uint32 temporary first (XLA:CPU splits a
  # long sum into a reduce-window that no producer fuses into), 2x the state in all.
  zeros = [jnp.uint32(0)] * len(terms)
  sums = jax.lax.reduce(
    terms, zeros, lambda a, b: [x + y for x, y in zip(a, b)], tuple(range(words.ndim))
  )
  return jnp.stack(sums)


checksum_all = jax.jit(lambda leaves: {path: _checksum(x) for path, x in leaves.items()})


def _devices(leaf) -> frozenset | None:
  placed = isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct))
  sharding = getattr(leaf, "sharding", None) if placed else None
  return None if sharding is None else frozenset(sharding.device_set)


def _groups(tree: Any) -> dict:
  """``tree``'s array leaves by path, grouped by the devices they lie on."""
  groups = collections.defaultdict(dict)
  for path, leaf in paths.arrays_with_paths(tree):
    groups[_devices(leaf)][path] = leaf
  return groups


def checksums(tree: Any) -> Checksums:
  """``{path: [h0, h1]}``: two 32-bit hashes of every array leaf's bits (JSON-ready).

  Computed where the arrays live, sharded or spread over processes; every
  process gets the same result.

  Example:
    >>> import jax.numpy as jnp, saggs_jax as saggs
    >>> x = jnp.arange(4.0)
    >>> sums = saggs._src.checkpoint.checksums
    >>> sums({"x": x}) == sums({"x": x[::-1]}), sums({"x": x}) == sums({"x": x + 0})
    (False, True)
  """
  return checksums_with(tree, {})


def checksums_with(tree: Any, programs: dict) -> Checksums:
  """:func:`checksums`, by ``programs`` (compiled ``checksum_all`` by device set) where
  given."""
  # One program per set of devices, each waited for: one small program per
  # leaf, all in flight at once, deadlocked a 2-process job on CPU (gloo).
  hashes = {}
  for devices, leaves in _groups(tree).items():
    hashes.update(jax.device_get(programs.get(devices, checksum_all)(leaves)))
  return {path: [int(h) for h in hashes[path]] for path, _ in paths.arrays_with_paths(tree)}


def hashers(abstract: Any, pool: concurrent.futures.Executor) -> dict:
  """The checksum programs of the arrays Orbax will restore from ``abstract``, by device
  set: lowered now and compiled on the restore's thread while Orbax reads. Empty when a
  leaf has no sharding (where Orbax places it is not known yet): those compile at use."""
  groups = _groups(abstract)
  if None in groups:
    return {}
  return {d: pool.submit(checksum_all.lower(leaves).compile) for d, leaves in groups.items()}


def verify(saved: Checksums, restored: Any, what: str, hashers: dict) -> None:
  read = checksums_with(restored, {d: f.result() for d, f in hashers.items()})
  unchecked = [p for p in read if p not in saved]
  if unchecked:
    raise ValueError(
      f"{what} has no checksum for the array at {unchecked[0]!r}: its checksums file was"
      " edited or truncated." + ANOTHER_STEP
    )
  corrupted = [p for p in saved if read.get(p) != saved[p]]
  if corrupted:
    others = f" (and {len(corrupted) - 1} more arrays)" if len(corrupted) > 1 else ""
    raise ValueError(
      f"{what} is corrupted: the array at {corrupted[0]!r}{others} does not match the checksum"
      " saved with it." + ANOTHER_STEP
    )
