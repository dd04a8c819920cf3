"""saggs_jax._src.checksums: the hash against a NumPy re-implementation, every bit flip and
swap seen, and the compiled program's size (no full-size temporaries, one trace per shape and
dtype). tests/test_checkpoint.py checks that restore refuses corrupted files."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import saggs_jax as saggs
from saggs_jax._src import checksums
from test_checkpoint import _abstract_llama_state


def numpy_checksum(x):
  """The checkpoint hash re-implemented in NumPy: two sums mod 2**32 of
  fmix32(word ^ fmix32(position + seed)) over the little-endian 32-bit words of
  the array (narrower elements zero-extended to one word each)."""
  a = np.asarray(jax.random.key_data(x) if checksums.is_key(x) else x)
  if a.dtype == np.complex64:
    a = a.view(np.float32)  # (real, imag) interleaved
  if a.dtype == np.bool_:
    words = a.astype(np.uint32).ravel()
  else:
    words = a.view(f"uint{8 * a.itemsize}").astype(np.uint32).ravel()

  def fmix32(h):
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))

  positions = np.arange(words.size, dtype=np.uint32)
  with np.errstate(over="ignore"):
    return [
      int(np.sum(fmix32(words ^ fmix32(positions + np.uint32(seed))), dtype=np.uint64) % 2**32)
      for seed in (0x9E3779B9, 0x7F4A7C15)
    ]


def hash_inputs():
  rng = np.random.default_rng(3)

  def normal(shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)

  return {
    "f32": normal((3, 5), jnp.float32),
    "bf16": normal((4, 2, 2), jnp.bfloat16),
    "f16": normal((6,), jnp.float16),
    "i8": jnp.asarray(rng.integers(-128, 128, 7), jnp.int8),
    "u32": jnp.uint32(4_000_000_001),
    "bool": jnp.asarray([True, False, True]),
    "c64": jnp.asarray(
      rng.standard_normal((2, 3)) + 1j * rng.standard_normal((2, 3)), jnp.complex64
    ),
    "key": jax.random.split(jax.random.key(3), 4),
  }


def test_checksums_match_a_numpy_oracle():
  inputs = hash_inputs()
  assert checksums.checksums(inputs) == {k: numpy_checksum(v) for k, v in inputs.items()}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_checksum_sees_every_bit_flip_and_swap(dtype):
  x = np.asarray(jnp.asarray(np.random.default_rng(4).standard_normal(6), dtype))
  bits = 8 * x.itemsize
  unsigned = x.view(f"uint{bits}")
  variants = [x[[1, 0, 2, 3, 4, 5]], x[::-1]]  # swapped elements
  for i in (0, 3, 5):
    for b in range(bits):
      flipped = unsigned.copy()
      flipped[i] ^= np.array(1 << b).astype(unsigned.dtype)
      variants.append(flipped.view(x.dtype))
  sums = [checksums.checksums({"x": jnp.asarray(v)})["x"] for v in [x] + variants]
  assert len({tuple(s) for s in sums}) == len(sums)


def test_checksums_need_no_full_size_temporaries():
  """XLA's memory analysis of the compiled checksum program on a 7B AdamW state (81 GB,
  abstract) and on large arrays of every kind of dtype: its temporaries stay under 5% of
  the state (two full-size uint32 arrays per leaf, 2x the state, before)."""
  state = _abstract_llama_state()
  nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  n = 1 << 24
  others = [jax.ShapeDtypeStruct((n,), t) for t in (jnp.bfloat16, jnp.complex64, jnp.int8, bool)]
  others.append(jax.eval_shape(lambda: jax.random.split(jax.random.key(0), n)))
  leaves = dict(saggs._src.paths.arrays_with_paths((state, others)))
  compiled = checksums.checksum_all.lower(leaves).compile()
  assert nbytes > 80e9
  assert compiled.memory_analysis().temp_size_in_bytes <= 0.05 * nbytes


def test_checksums_trace_the_hash_once_per_shape_and_dtype():
  """A model's many leaves of one shape and dtype (its layers and their moments) share one
  traced hash: tracing a copy per leaf took 0.1-0.2 s of a 101M restore."""
  leaves = {f"layer{i}": jax.ShapeDtypeStruct((64, 32), jnp.float32) for i in range(6)}
  leaves["count"] = jax.ShapeDtypeStruct((), jnp.int32)
  (program,) = jax.make_jaxpr(checksums.checksum_all)(leaves).jaxpr.eqns
  calls = [e for e in program.params["jaxpr"].jaxpr.eqns if "jaxpr" in e.params]
  assert len(calls) == len(leaves)
  assert len({id(e.params["jaxpr"]) for e in calls}) == 2  # float32[64, 32] and int32[]
