"""Resolving declared pairs (:mod:`saggs_jax._src.pairs`) against a parameter tree.

Resolution turns the declarations into :class:`Slot` records, one per matched
leaf (or block of it) and pair instance, that the balancing and transport code
index by path. A leaf may be in several pair instances (overlapping
symmetries); their factors are then solved jointly.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from saggs_jax._src import paths
from saggs_jax._src.pairs import (
  COPY_AXES_MSG,
  Block,
  Pair,
  Spec,
  absolute_axis,
  as_pairs,
  copy_positions,
  free_axes,
  pattern_of,
  per_copy_axis,
)

Span = tuple[int, int, int]  # (absolute axis, start, stop): a block of a leaf


@dataclasses.dataclass(frozen=True)
class Slot:
  """How one leaf moves under the factors of one resolved pair instance.

  Group g of the leaf is the block ``g * size // groups ... (g + 1) * size //
  groups`` along ``axis``; in the copy indexed by ``i`` along the ``stacked``
  axes it is multiplied by ``factors[i + (g,)] ** sign``. Statistics and factors
  put the copy axes first, in order, and the group axis last, wherever they are
  in the leaf; only those small arrays are transposed, never the leaf.
  With ``block`` only that part of the leaf moves, and a group axis equal to
  the block axis is tiled by the groups within the block alone. Nothing here
  reshapes the leaf itself, so a sharded group axis stays sharded (and
  Explicit-mode sharding needs no resharding).
  """

  key: str  # the pair instance whose factors apply
  sign: int  # +1 for the A side, -1 for the B side
  axis: int | None  # absolute group axis; None: whole tensor per copy
  groups: int
  stacked: tuple[int, ...]  # absolute copy axes, increasing
  block: Span | None = None  # the part of the leaf that moves; None: all of it

  def reduce_axes(self, ndim: int) -> tuple[int, ...]:
    """Axes summed to get one squared norm per stacked copy (and index of ``axis``)."""
    return tuple(i for i in range(ndim) if i not in self.stacked and i != self.axis)

  def broadcast_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the per-element multiplier before its block: stacked axes and ``axis`` kept,
    others 1."""
    return tuple(n if i in self.stacked or i == self.axis else 1 for i, n in enumerate(shape))

  @property
  def group_position(self) -> int:
    """Where ``axis`` sits among the kept axes (copy axes and ``axis``) in leaf order."""
    return 0 if self.axis is None else sum(c < self.axis for c in self.stacked)

  def copy_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The sizes of the copy axes of a leaf of ``shape``, in order."""
    return tuple(shape[i] for i in self.stacked)

  def tiled(self, size: int) -> tuple[int, int]:
    """``(start, stop)``: the range of ``axis`` (of length ``size``) that its groups tile."""
    if self.block is not None and self.block[0] == self.axis:
      return self.block[1:]
    return 0, size

  def per_index(self, size: int) -> bool:
    """Whether every index of ``axis`` (of length ``size``) is a group of its own."""
    return self.tiled(size) == (0, size) and self.groups == size

  def membership(self, size: int) -> np.ndarray:
    """(size, groups) one-hot matrix sending each index of ``axis`` to its group; indices
    outside the tiled range belong to none."""
    start, stop = self.tiled(size)
    index = np.arange(size) - start
    group = np.where(
      (index >= 0) & (index < stop - start), index // ((stop - start) // self.groups), -1
    )
    return np.equal.outer(group, np.arange(self.groups))


class Part(NamedTuple):
  """A member or follower of pair instances: a leaf, or a block of it."""

  path: str
  block: Span | None
  spec: Spec  # declares it alone: the path, or a Block on the path


class Piece(NamedTuple):
  """A declared leaf cut at every boundary of its blocks: all its entries move by the same
  slots, so its norms are taken at once (see :attr:`Plan.pieces`)."""

  path: str
  block: Span | None
  slots: tuple[Slot, ...]


@dataclasses.dataclass(frozen=True)
class Instance:
  """One resolved pair: the members of each side, whose norms are balanced, and their
  followers. Each is named by its path, followed by ``[part]`` for a block."""

  key: str
  pair: Pair
  members_a: tuple[str, ...]
  members_b: tuple[str, ...]
  followers_a: tuple[str, ...]
  followers_b: tuple[str, ...]
  factor_shape: tuple[int, ...]

  @property
  def a(self) -> str:
    """The first member of side a: names the instance in messages."""
    return self.members_a[0]

  @property
  def b(self) -> str:
    return self.members_b[0]

  def members(self, sign: int) -> tuple[str, ...]:
    """The members counted in the norm of side a (+1) or b (-1)."""
    return self.members_a if sign > 0 else self.members_b

  def followers(self, sign: int) -> tuple[str, ...]:
    return self.followers_a if sign > 0 else self.followers_b


@dataclasses.dataclass(frozen=True)
class Plan:
  """All instances resolved on one tree, the slots of every leaf path, and what each
  member's name stands for."""

  instances: tuple[Instance, ...]
  slots: dict[str, tuple[Slot, ...]]
  shapes: dict[str, tuple[int, ...]]
  parts: dict[str, Part] = dataclasses.field(default_factory=dict)

  def part(self, name: str) -> Part:
    """The leaf, or block of it, that a member or follower ``name`` stands for."""
    return self.parts.get(name) or Part(name, None, name)

  def slot(self, name: str, key: str) -> Slot:
    """How the member or follower ``name`` moves in the pair instance ``key``."""
    path, block, _ = self.part(name)
    return next(s for s in self.slots[path] if s.key == key and s.block == block)

  @functools.cached_property
  def pieces(self) -> dict[tuple[str, Span | None], Piece]:
    """The declared leaves, each cut along its block axis at every block boundary into the
    pieces some slot moves. A leaf without blocks is one piece."""
    out = {}
    for path, slots in self.slots.items():
      blocks = {s.block for s in slots if s.block is not None}
      if not blocks:
        out[path, None] = Piece(path, None, slots)
        continue
      (axis,) = {b[0] for b in blocks}  # resolution keeps a leaf's blocks on one axis
      size = self.shapes[path][axis]
      cuts = sorted({0, size}.union(*(b[1:] for b in blocks)))
      for start, stop in zip(cuts, cuts[1:]):
        mine = tuple(
          s for s in slots if s.block is None or s.block[1] <= start < stop <= s.block[2]
        )
        if mine:
          block = None if (start, stop) == (0, size) else (axis, start, stop)
          out[path, block] = Piece(path, block, mine)
    return out

  @functools.cached_property
  def _pieces_of(self) -> dict[tuple[str, Slot], tuple]:
    out = {}
    for k, piece in self.pieces.items():
      for s in piece.slots:
        out[piece.path, s] = out.get((piece.path, s), ()) + (k,)
    return out

  def pieces_of(self, name: str, key: str) -> tuple[tuple[str, Span | None], ...]:
    """The keys of the pieces that make up member or follower ``name`` of instance ``key``."""
    return self._pieces_of[self.part(name).path, self.slot(name, key)]

  @functools.cached_property
  def counted(self) -> frozenset[str]:
    """The leaves whose norms the balancing minimises: of members (not followers) of some
    instance, whole or in part."""
    return frozenset(self.part(n).path for i in self.instances for n in i.members_a + i.members_b)

  @functools.cached_property
  def overlapping(self) -> bool:
    """Whether some piece is in several instances, so that their factors must be solved
    jointly."""
    return any(len(p.slots) > 1 for p in self.pieces.values())


def _leaf_specs(tree: Any) -> tuple[tuple[str, tuple[int, ...], Any], ...]:
  """``(path, shape, dtype)`` of every array leaf (the others are static, see
  :func:`saggs_jax._src.paths.is_array`): all that resolution reads, hence its cache key."""
  out = {}
  for path, leaf in paths.arrays_with_paths(tree):
    if path in out:
      raise ValueError(f"Two leaves share the path {path!r}; paths must be unique.")
    out[path] = (tuple(np.shape(leaf)), leaf.dtype)
  return tuple((path, *spec) for path, spec in out.items())


def _matches(spec: Spec, dtypes: dict[str, Any], pair: Pair) -> dict[tuple, str]:
  pattern = pattern_of(spec)
  found: dict[tuple, str] = {}
  for path in dtypes:
    caps = paths.match(pattern, path)
    if caps is None:
      continue
    if caps in found:
      raise ValueError(
        f"{pair.spelled}: pattern {spec!r} matches both {found[caps]!r} and {path!r} with"
        " the same wildcard captures. Make the pattern more specific."
      )
    if not jnp.issubdtype(dtypes[path], jnp.floating):
      raise ValueError(
        f"{pair.spelled}: pattern {spec!r} matches {path!r} of dtype {dtypes[path]}; only"
        " floats rescale (an integer would be truncated). Narrow the pattern or store floats."
      )
    found[caps] = path
  if not found:
    near = paths.nearest(pattern, dtypes)
    hint = f"; did you mean {', '.join(map(repr, near))}?" if near else "."
    raise ValueError(f"{pair.spelled}: pattern {spec!r} matches no parameter path{hint}")
  return found


def _part(
  pair: Pair, spec: Spec, path: str, shape: tuple[int, ...]
) -> tuple[str, Part, tuple[int, ...]]:
  """``(name, part, shape in the block's coordinates)`` of the leaf at ``path`` as ``spec``
  declares it."""
  if not isinstance(spec, Block):
    return path, Part(path, None, path), shape
  block = spec.span(pair.spelled, path, shape, pair.copy_axes)
  axis, start, stop = block
  name = f"{path}[{spec.names[spec.index]}]"
  return (
    name,
    Part(path, block, dataclasses.replace(spec, pattern=path)),
    shape[:axis] + (stop - start,) + shape[axis + 1 :],
  )


def _copy_shape(pair: Pair, path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
  """The sizes of the copy axes of the leaf at ``path``; raises if it has too few axes."""
  copy = pair.copy_axes
  if copy and max(copy) >= len(shape):
    raise ValueError(COPY_AXES_MSG.format(where=pair.spelled, path=path, shape=shape, copy=copy))
  return tuple(shape[i] for i in copy)


def _check_ndim(pair: Pair, side: int, path: str, shape: tuple[int, ...]) -> None:
  want = None if pair.ndim is None else pair.ndim[side]
  per_copy = len(shape) - len(pair.copy_axes)
  if want is not None and per_copy != want:
    raise ValueError(
      f"{pair.spelled}: {path!r} {shape} has {per_copy} axes besides the copy axes, the"
      f" declaration {want}. Declare copy axes with stacked=, or use this layout's preset."
    )


def _group_axis(pair: Pair, ax: int | None, path: str, shape: tuple[int, ...]) -> int | None:
  _copy_shape(pair, path, shape)
  if ax is None:
    return None
  return absolute_axis(pair.spelled, "group axis", ax, path, shape, pair.copy_axes)


def follower_axis(
  kernel_ndim: int, kernel_axis: int, ndim: int, stacked: int | tuple[int, ...]
) -> int:
  """The absolute group axis of a follower with ``ndim`` axes whose kernel, of ``kernel_ndim``
  axes, is grouped on absolute axis ``kernel_axis``; both have their copy axes at
  ``stacked`` (a number of leading axes, or their positions).

  A bias vector (one axis per copy) is grouped on that axis, whatever the kernel's layout
  ((in, out) or (out, in)); a follower of more axes shares its kernel's trailing axes.
  """
  copy = copy_positions(stacked)
  free = free_axes(ndim, copy)
  per_copy = per_copy_axis(kernel_axis, copy) - (kernel_ndim - ndim)
  if len(free) == 1:
    return free[0]
  return free[per_copy] if 0 <= per_copy < len(free) else -1


def _follower_slot(pair, key, sign, kernel, kernel_shape, kernel_axis, groups, name, shape, block):
  if _copy_shape(pair, name, shape) != _copy_shape(pair, kernel, kernel_shape):
    raise ValueError(
      f"{pair.spelled}: follower {name!r} {shape} does not share the stacked"
      f" axes of {kernel!r} {kernel_shape}."
    )
  axis = None
  if kernel_axis is not None:
    axis = follower_axis(len(kernel_shape), kernel_axis, len(shape), pair.stacked)
    if axis < 0 or shape[axis] != kernel_shape[kernel_axis]:
      raise ValueError(
        f"{pair.spelled}: follower {name!r} with shape {shape} has no axis matching group axis"
        f" {kernel_axis} of {kernel!r} {kernel_shape}. Follow a bias of that axis's size."
      )
  return Slot(key, sign, axis, groups, pair.copy_axes, block)


class _Member(NamedTuple):
  name: str
  part: Part
  shape: tuple[int, ...]  # in the block's coordinates
  axis: int | None  # absolute group axis
  sign: int


def _resolve_pair(pair: Pair, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, Any]):
  """Yields each instance of ``pair`` with ``(name, part, slot, role)`` for each member and
  follower."""
  sides = [
    [
      (spec, ax, _matches(spec, dtypes, pair))
      for spec, ax in zip(pair.patterns(side), pair.side_axes(side))
    ]
    for side in (0, 1)
  ]
  for spec, _, found in (s for side in sides for s in side):
    wild = "*" in pattern_of(spec).rsplit("/", 1)[-1]
    bias = next((q for q in found.values() if wild and q.rsplit("/", 1)[-1] == "bias"), None)
    if bias is not None:  # a wildcard caught it: a bias alone never carries a factor
      raise ValueError(
        f"{pair.spelled}: pattern {spec!r} matches the bias {bias!r} by its wildcard. Name"
        " the kernel's leaf in the pattern, the bias in follow_a= (LlamaNames(qk_norm_bias=))."
      )
  matched = [(side, found) for side in (0, 1) for _, _, found in sides[side]]
  everywhere = set.intersection(*(set(found) for _, found in matched))
  for side, found in matched:
    for caps in sorted(set(found) - everywhere):
      other = next(p for s in sides for p, _, f in s if caps not in f)
      raise ValueError(
        f"{pair.spelled}: {found[caps]!r} (matched by {'ab'[side]}) has no partner"
        f" matching {other!r} with the same wildcard captures."
      )
  follower_matches = [(+1, p, _matches(p, dtypes, pair)) for p in pair.followers(0)]
  follower_matches += [(-1, p, _matches(p, dtypes, pair)) for p in pair.followers(1)]
  specs = pair.patterns(0) + pair.patterns(1)
  for caps in sorted(everywhere):
    resolved = []
    for side, sign in zip(sides, (+1, -1)):
      for spec, ax, found in side:
        path = found[caps]
        name, part, shape = _part(pair, spec, path, shapes[path])
        first = resolved[0].part.path if resolved else path
        if _copy_shape(pair, path, shapes[path]) != _copy_shape(pair, first, shapes[first]):
          raise ValueError(
            f"{pair.spelled}: stacked axes differ between {first!r}"
            f" {shapes[first]} and {path!r} {shapes[path]}."
          )
        _check_ndim(pair, (0 if sign > 0 else 1), name, shape)
        resolved.append(_Member(name, part, shape, _group_axis(pair, ax, name, shape), sign))
    key = "|".join("+".join(m.name for m in resolved if m.sign == sign) for sign in (+1, -1))
    if pair.axes is None:
      groups = 1
    else:
      sizes = {m.shape[m.axis] for m in resolved}
      if pair.groups is None and len(sizes) > 1:
        listed = ", ".join(f"{m.name!r} {m.shape}" for m in resolved)
        raise ValueError(
          f"{pair.spelled}: group axes differ in size ({listed}); pass groups="
          " to split all into the same number of blocks."
        )
      groups = pair.groups or sizes.pop()
      for m in resolved:
        if m.shape[m.axis] % groups:
          raise ValueError(
            f"{pair.spelled}: {groups} groups do not divide axis of size"
            f" {m.shape[m.axis]} of {m.name!r} with shape {m.shape}."
          )
    multi = len(resolved) > 2
    members = [
      (
        m.name,
        m.part,
        Slot(key, m.sign, m.axis, groups, pair.copy_axes, m.part.block),
        f"side {'a' if m.sign > 0 else 'b'}" + (f" (pattern {spec!r})" if multi else ""),
      )
      for m, spec in zip(resolved, specs)
    ]
    followers = {+1: [], -1: []}
    for sign, spec, found in follower_matches:
      if caps not in found:
        raise ValueError(
          f"{pair.spelled}: follower pattern {spec!r} has no match with the"
          f" captures of {resolved[0].name!r}."
        )
      path = found[caps]
      name, part, shape = _part(pair, spec, path, shapes[path])
      kernel = next(m for m in resolved if m.sign == sign)
      slot = _follower_slot(
        pair, key, sign, kernel.name, kernel.shape, kernel.axis, groups, name, shape, part.block
      )
      members.append(
        (name, part, slot, f"a follower of side {'a' if sign > 0 else 'b'} (pattern {spec!r})")
      )
      followers[sign].append(name)
    first = resolved[0].part.path
    fshape = _copy_shape(pair, first, shapes[first]) + ((groups,) if pair.axes is not None else ())
    names_a, names_b = (tuple(m.name for m in resolved if m.sign == sign) for sign in (+1, -1))
    yield (
      Instance(key, pair, names_a, names_b, tuple(followers[+1]), tuple(followers[-1]), fshape),
      members,
    )


def _overlap(a: Span | None, b: Span | None) -> bool:
  """Whether two blocks of one leaf (None: all of it) share entries."""
  return a is None or b is None or a[0] != b[0] or (a[1] < b[2] and b[1] < a[2])


def _claim(inst: Instance, members, declared: dict, roles: dict, parts: dict) -> None:
  """Records the members of ``inst``; raises if it is declared already or one cannot join it.

  A leaf may be in several instances (their factors are then solved jointly),
  but each entry in one instance once: disjoint blocks of a leaf may be on
  both sides of one. Where entries are shared, each axis is grouped by one
  instance at most and not also a copy axis (``stacked``) of another: two
  groupings of one axis would need factors per combination of groups.
  """
  every = frozenset(inst.members_a + inst.members_b)
  if every in declared:
    raise ValueError(
      f"{declared[every].pair.spelled} and {inst.pair.spelled} both pair {inst.a!r} with"
      f" {inst.b!r}, so its factors would be applied twice. Declare each pair once."
    )
  declared[every] = inst
  for name, part, slot, role in members:
    if parts.setdefault(name, part).block != part.block:
      raise ValueError(
        f"{inst.pair.spelled}: {name!r} names two blocks of {part.path!r},"
        f" {parts[name].spec!r} and {part.spec!r}; name their parts apart."
      )
    for first_role, first, first_slot in roles.get(part.path, ()):
      if slot.block and first_slot.block and slot.block[0] != first_slot.block[0]:
        raise ValueError(
          f"{part.path!r} is split along axis {first_slot.block[0]} by {first.pair.spelled}"
          f" and along axis {slot.block[0]} by {inst.pair.spelled}. Split one axis of it."
        )
      if not _overlap(slot.block, first_slot.block):
        continue  # disjoint blocks of one leaf move independently
      if first.key == inst.key:
        raise ValueError(
          f"{inst.pair.spelled}: {part.path!r} is both {first_role} and {role}, overlapping;"
          " a leaf moves with one side of a pair only. Remove it from one of the patterns."
        )
      clash_axis = next(
        (
          ax
          for ax, other in ((slot.axis, first_slot), (first_slot.axis, slot))
          if ax is not None and (ax == other.axis or ax in other.stacked)
        ),
        None,
      )
      if clash_axis is not None:
        raise ValueError(
          f"{part.path!r} is {first_role} of {first.pair.spelled} and {role} of"
          f" {inst.pair.spelled}, both grouping or stacking its axis {clash_axis}. Group"
          " another axis in one."
        )
    roles.setdefault(part.path, []).append((role, inst, slot))


@functools.lru_cache(maxsize=256)
def _resolve_cached(pairs: tuple[Pair, ...], leaf_specs: tuple, _ndims: tuple) -> Plan:
  """``_ndims``: the pairs' rank checks, which their equality leaves out, in the key."""
  shapes = {path: shape for path, shape, _ in leaf_specs}
  dtypes = {path: dtype for path, _, dtype in leaf_specs}
  instances, slots, declared, roles, parts = [], {}, {}, {}, {}
  for pair in pairs:
    for inst, members in _resolve_pair(pair, shapes, dtypes):
      _claim(inst, members, declared, roles, parts)
      instances.append(inst)
      for _, part, slot, _ in members:
        slots[part.path] = slots.get(part.path, ()) + (slot,)
  return Plan(tuple(instances), slots, shapes, parts)


def resolve(pairs: Sequence[Pair], tree: Any) -> Plan:
  """Resolves ``pairs`` on the leaves of ``tree``; raises ValueError on a bad declaration.

  Resolution looks only at paths, shapes and dtypes, so it runs once per tree
  structure at trace time and costs nothing inside a compiled step. Only
  floating-point leaves are declared.
  """
  pairs = as_pairs(pairs)
  return _resolve_cached(pairs, _leaf_specs(tree), tuple(p.ndim for p in pairs))


def _is_declaration(x: Any) -> bool:
  """Whether ``x`` is a Pair or a non-empty collection of Pairs (a list, a discover result)."""
  if isinstance(x, Pair):
    return True
  if isinstance(x, (str, bytes, dict)) or not isinstance(x, Sequence) or not x:
    return False
  return all(isinstance(p, Pair) for p in x)


def describe(params: Any, pairs: Sequence[Pair]) -> str:
  """A readable table of what each declared pair resolved to on ``params``.

  ``params`` first, as :func:`saggs_jax.imbalance` and optax take it; a declaration first
  is a TypeError naming that order.

  Example:
    >>> import jax.numpy as jnp, saggs_jax as saggs
    >>> params = {"q": jnp.ones((8, 4)), "k": jnp.ones((8, 4))}
    >>> print(saggs.describe(params, [saggs.Pair("q", "k", axes=(1, 1), groups=2)]))
    pair            side  path  shape   group axis  factors
    --------------  ----  ----  ------  ----------  -------
    Pair('q', 'k')  a     q     (8, 4)  1           (2,)
    Pair('q', 'k')  b     k     (8, 4)  1           (2,)
    1 pair instance, 2 factors in all.
  """
  if _is_declaration(params) and not _is_declaration(pairs):
    raise TypeError(
      "describe got the pairs where the parameters go. Write saggs_jax.describe(params, pairs),"
      " as imbalance(params, pairs)."
    )
  plan = resolve(pairs, params)
  blocks = any(part.block for part in plan.parts.values())  # a column only when some are
  rows = [("pair", "side", "path", "shape") + (("block",) * blocks + ("group axis", "factors"))]
  for inst in plan.instances:
    for side, name in (
      [("a", n) for n in inst.members_a]
      + [("b", n) for n in inst.members_b]
      + [("a+", n) for n in inst.followers_a]
      + [("b+", n) for n in inst.followers_b]
    ):
      slot, (path, block, _) = plan.slot(name, inst.key), plan.part(name)
      axis = "whole" if slot.axis is None else str(slot.axis)
      where = (f"axis {block[0]} [{block[1]}:{block[2]}]" if block else "all",) * blocks
      rows.append(
        (inst.pair.label, side, name, str(plan.shapes[path]))
        + where
        + (axis, str(inst.factor_shape))
      )
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
  lines.insert(1, "  ".join("-" * w for w in widths))
  n_instances = len(plan.instances)
  n_factors = sum(math.prod(i.factor_shape) for i in plan.instances)
  lines.append(
    f"{n_instances} pair instance{'s' * (n_instances != 1)},"
    f" {n_factors} factor{'s' * (n_factors != 1)} in all."
  )
  shared = list(dict.fromkeys(p.path for p in plan.pieces.values() if len(p.slots) > 1))
  if shared:
    lines.append(f"In several pairs, so balanced jointly: {', '.join(shared)}.")
  # What saggs_jax.discover found to be no symmetry, and why.
  lines += [
    f"Rejected: {r.a!r} against {r.b!r}: {r.reason}" for r in getattr(pairs, "rejected", ())
  ]
  return "\n".join(lines)
