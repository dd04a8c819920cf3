"""The proxy the degree probe runs on (:mod:`saggs_jax._src.degrees`): the parameters' tree,
dtypes and pairs with every axis cut to a few entries per run of indices along which no
multiplier changes (:func:`proxy`, :func:`proxy_params`), and the factors the probe moves them by
(:func:`probe_factors`). A degree is a property of the optimizer's structure, so the proxy
reads it whatever the parameters' sizes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from saggs_jax._src import paths
from saggs_jax._src.numerics import Factors
from saggs_jax._src.plan import Plan, Slot

KEEP = 2
"""Entries a proxy keeps of each run of indices along which no multiplier changes."""

GROUPS = 3
"""Groups a proxy keeps of each pair instance (factors alternate above and below 1)."""

PROXIES = ((False, GROUPS), (True, GROUPS), (True, None))
"""The arguments ``(whole, most)`` of the proxies tried in turn, until the optimizer runs on
one: a rule that splits a grouped axis into pieces of a fixed size (heads of ``head_dim``)
fails on :data:`KEEP` entries per group, one that splits it into a fixed number of pieces
(``num_heads``) may need all the groups."""


def probe_factors(plan: Plan) -> Factors:
  """Factors ``2**(±0.6 .. ±1)``, alternating in sign from group to group: far from 1
  and from each other's powers, so that two degrees never give the same multiplier.

  Example:
    >>> import jax, jax.numpy as jnp, saggs_jax as saggs
    >>> from saggs_jax._src.plan import resolve
    >>> params = {"q": jax.ShapeDtypeStruct((4, 8), jnp.float32),
    ...           "k": jax.ShapeDtypeStruct((4, 8), jnp.float32)}
    >>> c = probe_factors(resolve(saggs.Pair("q", "k", axes=(1, 1), groups=2), params))
    >>> [round(float(x), 3) for x in c["q|k"]]  # above 1, then below
    [1.516, 0.556]
  """
  out = {}
  for inst in plan.instances:
    n = np.arange(math.prod(inst.factor_shape))
    e = np.where(n % 2 == 0, 1.0, -1.0) * (0.6 + 0.4 * ((n * 0.618) % 1))
    out[inst.key] = jnp.asarray(2.0 ** e.reshape(inst.factor_shape), jnp.float32)
  return out


def _group_of(slot: Slot, n: int) -> np.ndarray:
  """The group of each index of ``slot``'s axis (of length ``n``), -1 outside its tiling."""
  start, stop = slot.tiled(n)
  index = np.arange(n)
  inside = (index >= start) & (index < stop)
  return np.where(inside, (index - start) // max(1, (stop - start) // slot.groups), -1)


def _kept(
  n: int, axis: int, slots: tuple[Slot, ...], groups: dict[str, int], whole: bool
) -> np.ndarray:
  """The indices of ``axis`` (length ``n``) a proxy keeps: of each instance's first
  ``groups[key]`` groups (and stacked copies), the first :data:`KEEP` of every run of
  indices that all slots treat alike; with ``whole``, every index of those groups along an
  axis that a slot groups."""
  index = np.arange(n)
  keep = np.ones(n, bool)
  signature = []
  for s in slots:
    if axis in s.stacked:  # every copy has its own factors
      signature.append(index)
      keep &= index < KEEP
    if s.block is not None and s.block[0] == axis:
      signature.append((index >= s.block[1]) & (index < s.block[2]))
    if s.axis == axis:
      group = _group_of(s, n)
      signature.append(group)
      keep &= group < groups[s.key]
  if whole and any(s.axis == axis for s in slots):
    return np.flatnonzero(keep)
  if signature:
    sig = np.stack(signature, axis=1)
    starts = np.concatenate([[True], np.any(sig[1:] != sig[:-1], axis=1)])
  else:
    starts = index == 0
  run_start = np.maximum.accumulate(np.where(starts, index, 0))
  return np.flatnonzero(keep & (index - run_start < KEEP))


def proxy(plan: Plan, whole: bool = False, most: int | None = GROUPS) -> Plan:
  """A small plan with the layout of ``plan``: same paths, ranks, pairs and slots, every
  axis cut by :func:`_kept` (each instance to ``most`` groups, all if None, of at most
  :data:`KEEP` entries, or of all their entries with ``whole``, stacked axes to :data:`KEEP`
  copies, other axes to :data:`KEEP` entries); an undeclared leaf's axes as the grouped axes
  of their length, if any. ``whole`` keeps each split of a group that a rule may make (heads
  of a fixed size inside a KV head's group), and all groups each split of a grouped axis, for
  an optimizer that fails on the smaller proxies (:data:`PROXIES`).

  Raises:
    TypeError: a layout whose cut leaves some slot with unequal groups (a group axis cut
      inside its groups by another pair's blocks).

  Example:
    >>> import jax, jax.numpy as jnp, saggs_jax as saggs
    >>> from saggs_jax._src.plan import resolve
    >>> params = {"q": jax.ShapeDtypeStruct((4096, 4096), jnp.float32),
    ...           "k": jax.ShapeDtypeStruct((4096, 1024), jnp.float32)}
    >>> small = proxy(resolve(saggs.Pair("q", "k", axes=(1, 1), groups=8), params))
    >>> small.shapes, small.instances[0].factor_shape  # 3 of the 8 groups, 2 entries each
    ({'k': (2, 6), 'q': (2, 6)}, (3,))
  """
  groups = {  # factor_shape is stacked_shape + (groups,), or stacked_shape for axes=None
    i.key: (i.factor_shape[-1] if most is None else min(most, i.factor_shape[-1]))
    if len(i.factor_shape) > len(i.pair.copy_axes)
    else 1
    for i in plan.instances
  }
  kept = {
    path: [_kept(n, a, plan.slots.get(path, ()), groups, whole) for a, n in enumerate(shape)]
    for path, shape in plan.shapes.items()
  }
  # An undeclared leaf is cut along each axis as the grouped axes of its length are (the most
  # entries any keeps): the inner optimizer may tie it to a declared leaf (a row-aware rule
  # treats an undeclared gate_proj and a declared up_proj as one neuron's vector).
  grouped: dict[int, np.ndarray] = {}
  for path, found in plan.slots.items():
    for axis in {s.axis for s in found if s.axis is not None}:
      n, k = plan.shapes[path][axis], kept[path][axis]
      if len(k) > len(grouped.get(n, ())):
        grouped[n] = k
  for path, shape in plan.shapes.items():
    if not plan.slots.get(path):
      kept[path] = [grouped.get(n, k) for n, k in zip(shape, kept[path])]

  def span(path, block):
    if block is None:
      return None
    axis, start, stop = block
    k = kept[path][axis]
    return axis, int(np.sum(k < start)), int(np.sum(k < stop))

  slots = {}
  for path, found in plan.slots.items():
    new = []
    for s in found:
      cut = dataclasses.replace(s, groups=groups[s.key], block=span(path, s.block))
      if s.axis is not None:  # the cut groups must tile as the originals did
        k = kept[path][s.axis]
        if not np.array_equal(_group_of(s, plan.shapes[path][s.axis])[k], _group_of(cut, len(k))):
          raise TypeError(
            f"Cannot measure transport degrees for {path!r} {plan.shapes[path]}: the groups"
            f" of {s.key!r} along axis {s.axis} do not survive the small proxy. Split that axis"
            " by one pair's blocks only."
          )
      new.append(cut)
    slots[path] = tuple(new)
  instances = tuple(
    dataclasses.replace(
      i,
      factor_shape=tuple(min(d, KEEP) for d in i.factor_shape[: len(i.pair.copy_axes)])
      + (groups[i.key],) * (len(i.factor_shape) - len(i.pair.copy_axes)),
    )
    for i in plan.instances
  )
  return Plan(
    instances,
    slots,
    {path: tuple(len(k) for k in kept[path]) for path in plan.shapes},
    {name: part._replace(block=span(part.path, part.block)) for name, part in plan.parts.items()},
  )


def _probe_dtype(dtype):
  """16-bit floats probe in float32: their rounding, amplified where two probe gradients
  cancel in a moment, would hide the degree; a degree does not depend on the precision."""
  return jnp.float32 if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4 else dtype


def proxy_params(params: Any, small: Plan) -> Any:
  """``params`` as abstract leaves of the proxy's shapes (other leaves as they are)."""

  def leaf(key_path, x):
    shape = small.shapes.get(paths.path_str(key_path))
    if shape is None or not paths.is_array(x):
      return x
    return jax.ShapeDtypeStruct(shape, _probe_dtype(jnp.result_type(x)))

  return jax.tree_util.tree_map_with_path(leaf, params)
