"""What SAGGS checks inside ``shard_map``: an axis name to sum its norms over, and shards
that hold whole groups, against the global shapes ``init`` saw (docs/multi_host.md).
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class GlobalShapes:
  """The shapes of the parameters ``init`` saw outside ``shard_map`` (None inside it), against
  which an update inside ``shard_map`` checks that its shards hold whole groups. A pytree
  without leaves: static, so it costs nothing, is the same in every update's trace and goes
  with the state wherever the state goes (a restored one, another instance of the optimizer).

  Attributes:
    shapes: ``(path, shape)`` per parameter leaf, or None where ``init`` saw shards.
  """

  shapes: tuple[tuple[str, tuple[int, ...]], ...] | None = None

  def get(self, path: str) -> tuple[int, ...] | None:
    return dict(self.shapes or ()).get(path)


def check_axis_name(axis_name) -> None:
  if not (
    axis_name is None
    or isinstance(axis_name, str)
    or (isinstance(axis_name, (tuple, list)) and all(isinstance(a, str) for a in axis_name))
  ):
    raise ValueError(
      f"axis_name must be None, a mesh axis name or a tuple of them, got {axis_name!r}."
    )


# Inside shard_map a leaf is a shard, and a group may be split over devices: docs/multi_host.md
# says which axis_name sums its norms over them, and where the global shapes come from.
SHARD_MAP_AXIS_MSG = (
  "SAGGS is traced inside shard_map (manual axes {manual}) with axis_name=None: each device"
  " would balance its shard alone. Pass axis_name= the mesh axes that split the groups, or ()."
)
SHARD_MAP_SHAPES_MSG = (
  "{pair}: groups={groups} along axis {axis} of {path!r} inside shard_map, where"
  " axis_name={axis_name!r} sums its norms, need the global shapes. Call tx.init outside"
  " shard_map."
)
SHARD_MAP_SPLITS_MSG = (
  "{pair}: groups={groups} along axis {axis} of {path!r}, which shard_map splits ({size}"
  " entries, {local} per device). Keep that axis whole on each device, or balance outside"
  " shard_map."
)


def check_global(axis_name) -> None:
  """Inside ``shard_map`` a leaf is a shard: its norms alone would balance per shard."""
  manual = jax.sharding.get_abstract_mesh().manual_axes
  if manual and axis_name is None:
    raise ValueError(SHARD_MAP_AXIS_MSG.format(manual=manual))


def check_whole_groups(plan, global_shapes, axis_name) -> None:
  """Inside ``shard_map`` a pair is resolved on each device's shard. Declared ``groups``
  along an axis that the shards split would resolve there to smaller groups (and the
  psum over ``axis_name`` would add different groups together): refuse it. The global
  shapes are those ``init`` saw outside ``shard_map``, from the state; without them, a psum over
  ``axis_name`` could add pieces of different groups, and nothing inside ``shard_map``
  says which axes the shards split: refuse that too."""
  if not jax.sharding.get_abstract_mesh().manual_axes:
    return
  for inst in plan.instances:
    if inst.pair.groups is None:
      continue
    for name in inst.members_a + inst.members_b + inst.followers_a + inst.followers_b:
      axis, path = plan.slot(name, inst.key).axis, plan.part(name).path
      local, whole = plan.shapes[path], global_shapes.get(path)
      if axis is None:
        continue
      groups = inst.pair.groups
      if whole is None and axis_name:
        raise ValueError(
          SHARD_MAP_SHAPES_MSG.format(
            pair=inst.pair.label, groups=groups, axis=axis, path=path, axis_name=axis_name
          )
        )
      if whole is not None and local[axis] != whole[axis]:
        raise ValueError(
          SHARD_MAP_SPLITS_MSG.format(
            pair=inst.pair.label,
            groups=groups,
            axis=axis,
            path=path,
            size=whole[axis],
            local=local[axis],
          )
        )
