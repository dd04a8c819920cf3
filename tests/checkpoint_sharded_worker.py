"""Sharded save and restore on 8 CPU devices, run by test_checkpoint_sharded.py.

Prints ``<axis type> OK`` for each mesh whose checks pass, else raises.
"""

import re
import sys
import tempfile

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
import saggs_jax as saggs
from saggs_jax._src import checkpoint, checksums, paths
from saggs_jax._src.pairs import as_pairs

PAIRS = models.llama_pairs()
TX = saggs.chain(optax.adamw(1e-2), saggs.saggs(PAIRS, every=100))
# What a program may send between devices: per-group norms and the checksums' sums.
SMALL = 64


def spec(shape):
  """A 2-D ('data', 'model') layout: the last two axes split where they divide evenly."""
  axes = [None] * len(shape)
  for axis, (name, size) in zip(range(len(shape) - 2, len(shape)), (("data", 2), ("model", 4))):
    if axis >= 0 and shape[axis] % size == 0:
      axes[axis] = name
  return P(*axes)


def collectives(compiled) -> list[str]:
  """Every collective of a compiled program whose result has more than SMALL elements
  (the partial sums of a sharded reduction are gathered or all-reduced: a few words)."""
  big = []
  for line in compiled.as_text().splitlines():
    op = re.search(
      r"= \S+\[([\d,]*)\]\S* (all-gather|all-to-all|collective-permute|all-reduce)\(", line
    )
    if op and np.prod([int(d) for d in op[1].split(",") if d]) > SMALL:
      big.append(line.strip()[:160])
  return big


def check(axis_type):
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)
  with jax.set_mesh(mesh):
    shard = lambda x: jax.device_put(x, NamedSharding(mesh, spec(x.shape)))  # noqa: E731
    params = jax.tree.map(shard, models.perturb(models.llama_init(0), PAIRS, seed=3))
    state = jax.tree.map(shard, models.random_like(TX.init(models.llama_init(0)), 6, positive=True))
    target = jax.tree.map(shard, (models.llama_init(1), TX.init(models.llama_init(1))))
    split = [x for x in jax.tree.leaves(target) if not x.sharding.is_fully_replicated]
    assert len(split) > 20, len(split)

    with tempfile.TemporaryDirectory() as directory, ocp.CheckpointManager(directory) as manager:
      assert checkpoint.save(manager, 1, params, state)
      got = checkpoint.restore(manager, *target, PAIRS, tx=TX)[:2]
      raw = checkpoint.restore(manager, *target, canonicalize=False)[:2]
    for g, r, t in zip(*(jax.tree.leaves(x) for x in (got, raw, target))):
      for x in (g, r):  # restored onto the target's devices and layout, shard by shard
        assert x.sharding.is_equivalent_to(t.sharding, t.ndim), (x.sharding, t.sharding)
        assert [s.data.shape for s in x.addressable_shards] == [
          s.data.shape for s in t.addressable_shards
        ]
    host = jax.tree.map(np.asarray, (params, state))
    np.testing.assert_equal(jax.tree.map(np.asarray, raw), host)
    want = saggs.canonicalize(host[0], host[1][:1], PAIRS, tx=TX.optimizer)
    for g, w in zip(jax.tree.leaves((got[0], got[1][:1])), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)

    # Neither the checksums nor the canonicalisation gather an array onto one device.
    leaves = dict(paths.arrays_with_paths(target))
    sums = checksums.checksum_all.lower(leaves).compile()
    assert not collectives(sums), collectives(sums)
    specs, treedef = jax.tree.flatten(jax.tree.map(checkpoint._spec, target))
    optimizer, n, made = checkpoint._made_by(TX, *target)
    program = checkpoint._canonicalizer(
      as_pairs(PAIRS), optimizer, n, made, treedef, tuple(specs)
    ).result()
    assert not collectives(program), collectives(program)
  print(f"{axis_type.name} OK", flush=True)


if __name__ == "__main__":
  assert jax.device_count() == 8, jax.devices()
  for name in sys.argv[1:]:
    check(getattr(jax.sharding.AxisType, name))
