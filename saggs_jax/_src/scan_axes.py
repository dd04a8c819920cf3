"""Copy axes read from Flax's scan metadata: where a scanned layer stack keeps its layer axis.

Flax records the axis a scan stacks its layers on in each boxed parameter's axis names:
linen's ``nn.scan(..., variable_axes={"params": 1}, metadata_params={nn.PARTITION_NAME:
"layers"})`` inserts ``"layers"`` at position 1 of every ``nn.Partitioned`` (and
``nn.LogicallyPartitioned``) box's ``names``, which is how MaxText marks its
``param_scan_axis``, and nnx's ``transform_metadata={nnx.PARTITION_NAME: "layers"}`` does the
same to a Variable's sharding names. :func:`copy_axes` reads those positions, for a
:class:`~saggs_jax.Pair`'s ``stacked``. Leaves without axis names (unboxed biases) carry no
such record: their copy axes are those of the kernel they follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from saggs_jax._src import paths

_NNX_NAMES = ("out_sharding", "sharding_names", "sharding")  # across Flax versions


def _axis_names(leaf: Any) -> tuple | None:
  """The axis names of a Flax box (linen ``Partitioned`` or an nnx Variable), else None."""
  names = getattr(leaf, "names", None)  # linen's Partitioned and LogicallyPartitioned
  if isinstance(names, tuple) and hasattr(leaf, "unbox"):
    return names
  metadata = getattr(leaf, "get_metadata", None)
  if callable(metadata) and hasattr(leaf, "get_value"):  # an nnx Variable
    found: Any = metadata()
    for key in _NNX_NAMES:
      if isinstance(found.get(key), tuple):
        return found[key]
  return None


def copy_axes(tree: Any, names: str | Sequence[str] = ("layers",)) -> dict[str, tuple[int, ...]]:
  """The positions of the axes named ``names`` in every boxed leaf of ``tree`` that has one.

  Args:
    tree: parameters as Flax builds them, boxes kept: linen's ``model.init(...)`` output
      (before ``nn.unbox``), or an ``nnx.State`` of Variables.
    names: the axis names that mark copy axes: the scan's ``PARTITION_NAME`` (MaxText's
      is ``"layers"``), and for MoE trees the expert axis's logical name.

  Returns:
    ``{path: positions}`` (paths as :mod:`saggs_jax._src.paths` spells them), positions increasing,
    for each leaf whose axis names include one of ``names``: a Pair's ``stacked``.

  Example:
    A linen scan that puts its layer axis at position 1, as MaxText does:

    >>> import jax, jax.numpy as jnp, flax.linen as nn, saggs_jax as saggs
    >>> class Block(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x, _):
    ...     init = nn.with_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
    ...     return nn.Dense(4, kernel_init=init, name="up")(x), None
    >>> scan = nn.scan(Block, variable_axes={"params": 1}, split_rngs={"params": True},
    ...                length=2, metadata_params={nn.PARTITION_NAME: "layers"})
    >>> boxed = scan().init(jax.random.key(0), jnp.ones((1, 4)), None)  # boxes kept
    >>> saggs.copy_axes(boxed)
    {'params/up/kernel': (1,)}
  """
  wanted = {names} if isinstance(names, str) else set(names)
  found = {}
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: _axis_names(x) is not None)
  for key_path, leaf in flat:
    axis_names = _axis_names(leaf)
    positions = tuple(i for i, n in enumerate(axis_names or ()) if n in wanted)
    if positions:
      found[paths.path_str(key_path)] = positions
  return found
