"""Declaring exact symmetry pairs and resolving them against a parameter tree.

A :class:`Pair` says: scaling every group of ``a`` by ``c`` and the matching
group of ``b`` by ``1/c`` leaves the model's function unchanged. A side may be
several tensors (a norm gain against the input rows of every linear reading
the normalised activations). Resolution turns the declaration into
:class:`Slot` records, one per matched leaf and pair instance, that the
balancing and transport code index by path. A leaf may be in several pair
instances (overlapping symmetries); their factors are then solved jointly.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from saggs_jax import paths


def _as_tuple(x) -> tuple[str, ...]:
  return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _is_int(x) -> bool:
  """An int that is not a bool: ``True`` would silently read as 1."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class Pair:
  """An exact symmetry: ``a`` scaled by ``c`` per group, ``b`` by ``1/c``.

  Attributes:
    a: path pattern of the side scaled by ``c`` (see :mod:`saggs_jax.paths`),
      or a tuple of patterns when that side is several tensors: all of them
      are scaled by ``c``, and the side's norm is taken over all of them.
    b: path pattern(s) of the side scaled by ``1/c``. Matches pair up by
      equal wildcard captures; every match needs exactly one partner in
      every other pattern.
    axes: ``(axis_a, axis_b)``, the group axis on each side, or ``None`` for
      one group spanning the whole tensor. Axes count within one layer: after
      the ``stacked`` leading axes. Negative axes count from the end. On a
      side of several tensors an int applies to each, or a tuple gives one
      axis per pattern. All group axes of an instance have one size.
    groups: split the group axis into this many contiguous blocks (for GQA,
      the number of KV heads). Default: one group per index.
    stacked: leading axes present on both sides that index independent copies
      (scanned layers, experts). Factors then have shape
      ``stacked_shape + (groups,)``.
    follow_a: patterns of tensors that move with ``a`` (its biases) but do not
      count in its norm. A follower shares the trailing axes of the side's
      first tensor, so its group axis is that tensor's counted from the end.
    follow_b: likewise for ``b``.
    name: label used in errors (with the patterns) and in :func:`saggs_jax.describe`.

  Example::

    >>> import saggs_jax as saggs
    >>> qk = saggs.Pair("attn/q_proj/kernel", "attn/k_proj/kernel",
    ...                 axes=(1, 1), groups=2, follow_a="attn/q_proj/bias")
    >>> gain = saggs.Pair("attn_norm/scale", ("attn/q_proj/kernel", "attn/k_proj/kernel",
    ...                   "attn/v_proj/kernel"), axes=(0, 0), name="RMSNorm gain")
  """

  a: str | tuple[str, ...]
  b: str | tuple[str, ...]
  axes: tuple[int | tuple[int, ...], int | tuple[int, ...]] | None = None
  groups: int | None = None
  stacked: int = 0
  follow_a: str | Sequence[str] = ()
  follow_b: str | Sequence[str] = ()
  name: str | None = None

  def __post_init__(self):
    if self.name is not None and not isinstance(self.name, str):
      raise ValueError(f"Pair({self.a!r}, {self.b!r}): name must be a string or None, got"
                       f" {self.name!r}.")
    for side in ("a", "b"):  # one pattern stays a str, so reprs of plain pairs are unchanged
      value = getattr(self, side)
      if not isinstance(value, str):
        value = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        if not value:
          raise ValueError(f"{self._spelled}: side {side} needs at least one pattern.")
        object.__setattr__(self, side, value[0] if len(value) == 1 else value)
    object.__setattr__(self, "follow_a", _as_tuple(self.follow_a))
    object.__setattr__(self, "follow_b", _as_tuple(self.follow_b))
    for p in (*self.patterns(0), *self.patterns(1), *self.follow_a, *self.follow_b):
      if not isinstance(p, str):
        raise ValueError(f"{self._spelled}: patterns must be strings, got {p!r}.")
    if self.axes is not None:
      object.__setattr__(self, "axes", self._checked_axes())
    if self.groups is not None:
      if not _is_int(self.groups) or self.groups < 1:
        raise ValueError(f"{self._spelled}: groups must be a positive int, got {self.groups!r}.")
      if self.axes is None:
        raise ValueError(
            f"{self._spelled}: groups={self.groups!r} needs a group axis to split; pass"
            " axes=(axis_a, axis_b), or drop groups for one group per whole tensor.")
      object.__setattr__(self, "groups", int(self.groups))
    if not _is_int(self.stacked) or self.stacked < 0:
      raise ValueError(f"{self._spelled}: stacked must be an int >= 0 (the number of leading copy"
                       f" axes), got {self.stacked!r}.")
    object.__setattr__(self, "stacked", int(self.stacked))
    first = self.patterns(0)[0]
    n = paths.num_captures(first)
    for p in (*self.patterns(0)[1:], *self.patterns(1), *self.follow_a, *self.follow_b):
      if paths.num_captures(p) != n:
        raise ValueError(
            f"{self._spelled}: pattern {p!r} has a different number of wildcards than {first!r};"
            " matches are paired by their wildcard captures.")

  def patterns(self, side: int) -> tuple[str, ...]:
    """The patterns of side a (0) or b (1)."""
    return _as_tuple((self.a, self.b)[side])

  def side_axes(self, side: int) -> tuple[int | None, ...]:
    """The group axis of each pattern of side a (0) or b (1); None: the whole tensor."""
    ax = None if self.axes is None else self.axes[side]
    if ax is None:
      return (None,) * len(self.patterns(side))
    return (ax,) * len(self.patterns(side)) if _is_int(ax) else ax

  def _checked_axes(self):
    def valid(ax, n):  # an int, or one int per pattern of a side of several
      return _is_int(ax) or (isinstance(ax, (tuple, list)) and len(ax) == n > 1
                             and all(map(_is_int, ax)))

    if not (isinstance(self.axes, (tuple, list)) and len(self.axes) == 2 and all(
        valid(ax, len(self.patterns(side))) for side, ax in enumerate(self.axes))):
      raise ValueError(
          f"{self._spelled}: axes must be None or a pair of ints (axis_a, axis_b), got"
          f" {self.axes!r}; e.g. axes=(1, 1) groups axis 1 of both sides. On a side of several"
          " patterns the axis may also be a tuple of one int per pattern.")
    return tuple(int(ax) if _is_int(ax) else tuple(map(int, ax)) for ax in self.axes)

  @property
  def label(self) -> str:
    return self.name or f"Pair({self.a!r}, {self.b!r})"

  @property
  def _spelled(self) -> str:
    """The label with the patterns: errors name both."""
    plain = f"Pair({self.a!r}, {self.b!r})"
    return f"{self.name!r} = {plain}" if self.name else plain


@dataclasses.dataclass(frozen=True)
class Slot:
  """How one leaf moves under the factors of one resolved pair instance.

  Group g of the leaf is the block ``g * size // groups ... (g + 1) * size //
  groups`` along ``axis``; it is multiplied by ``factors[..., g] ** sign``.
  Nothing here reshapes the leaf itself, so a sharded group axis stays
  sharded (and Explicit-mode sharding needs no resharding).
  """

  key: str  # the pair instance whose factors apply
  sign: int  # +1 for the A side, -1 for the B side
  axis: int | None  # absolute group axis; None: whole tensor per copy
  groups: int
  stacked: int

  def reduce_axes(self, ndim: int) -> tuple[int, ...]:
    """Axes summed to get one squared norm per stacked copy (and index of ``axis``)."""
    return tuple(i for i in range(self.stacked, ndim) if i != self.axis)

  def broadcast_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the per-element multiplier: stacked axes and ``axis`` kept, others 1."""
    return tuple(n if i < self.stacked or i == self.axis else 1 for i, n in enumerate(shape))

  def membership(self, size: int) -> np.ndarray:
    """(size, groups) one-hot matrix sending each index of ``axis`` to its group."""
    return np.equal.outer(np.arange(size) // (size // self.groups), np.arange(self.groups))


@dataclasses.dataclass(frozen=True)
class Instance:
  """One resolved pair: the leaves of each side, whose norms are balanced, and their followers."""

  key: str
  pair: Pair
  members_a: tuple[str, ...]
  members_b: tuple[str, ...]
  followers_a: tuple[str, ...]
  followers_b: tuple[str, ...]
  factor_shape: tuple[int, ...]

  @property
  def a(self) -> str:
    """The first leaf of side a: names the instance in messages."""
    return self.members_a[0]

  @property
  def b(self) -> str:
    return self.members_b[0]

  def members(self, sign: int) -> tuple[str, ...]:
    """The leaves counted in the norm of side a (+1) or b (-1)."""
    return self.members_a if sign > 0 else self.members_b


@dataclasses.dataclass(frozen=True)
class Plan:
  """All instances resolved on one tree, and the slots of every leaf path."""

  instances: tuple[Instance, ...]
  slots: dict[str, tuple[Slot, ...]]
  shapes: dict[str, tuple[int, ...]]

  def slot(self, path: str, key: str) -> Slot:
    """How the leaf at ``path`` moves in the pair instance ``key``."""
    return next(s for s in self.slots[path] if s.key == key)

  @functools.cached_property
  def counted(self) -> frozenset[str]:
    """The leaves whose norms the balancing minimises: members (not followers) of some instance."""
    return frozenset(p for i in self.instances for p in i.members_a + i.members_b)

  @functools.cached_property
  def overlapping(self) -> bool:
    """Whether some leaf is in several instances, so that their factors must be solved jointly."""
    return any(len(s) > 1 for s in self.slots.values())


def _leaf_specs(tree: Any) -> tuple[tuple[str, tuple[int, ...], Any], ...]:
  """``(path, shape, dtype)`` of every array leaf (the others are static, see
  :func:`saggs_jax.paths.is_array`): all that resolution reads, hence its cache key."""
  out = {}
  for path, leaf in paths.arrays_with_paths(tree):
    if path in out:
      raise ValueError(f"Two leaves share the path {path!r}; paths must be unique.")
    out[path] = (tuple(np.shape(leaf)), leaf.dtype)
  return tuple((path, *spec) for path, spec in out.items())


def _matches(pattern: str, dtypes: dict[str, Any], pair: Pair) -> dict[tuple, str]:
  found: dict[tuple, str] = {}
  for path in dtypes:
    caps = paths.match(pattern, path)
    if caps is None:
      continue
    if caps in found:
      raise ValueError(
          f"{pair._spelled}: pattern {pattern!r} matches both {found[caps]!r} and {path!r} with"
          " the same wildcard captures, so their partners are ambiguous. Make the pattern more"
          " specific.")
    if not jnp.issubdtype(dtypes[path], jnp.floating):
      raise ValueError(
          f"{pair._spelled}: pattern {pattern!r} matches {path!r} of dtype {dtypes[path]}; only"
          " floating-point leaves can be rescaled (an integer would be truncated). Narrow the"
          " pattern or store the leaf as floats.")
    found[caps] = path
  if not found:
    near = paths.nearest(pattern, dtypes)
    hint = f"; did you mean {', '.join(map(repr, near))}?" if near else "."
    raise ValueError(f"{pair._spelled}: pattern {pattern!r} matches no parameter path{hint}")
  return found


def _group_axis(pair: Pair, ax: int | None, path: str, shape: tuple[int, ...]) -> int | None:
  if len(shape) < pair.stacked:
    raise ValueError(
        f"{pair._spelled}: {path!r} has shape {shape}, fewer than stacked={pair.stacked} axes.")
  if ax is None:
    return None
  per_copy = len(shape) - pair.stacked
  if not -per_copy <= ax < per_copy:
    raise ValueError(
        f"{pair._spelled}: group axis {ax} is out of range for {path!r} with shape {shape}"
        f" ({per_copy} axes after stacked={pair.stacked}).")
  return pair.stacked + ax % per_copy


def _follower_slot(pair, key, sign, kernel_path, kernel_shape, kernel_axis, groups, path, shape):
  if tuple(shape[:pair.stacked]) != tuple(kernel_shape[:pair.stacked]):
    raise ValueError(f"{pair._spelled}: follower {path!r} {shape} does not share the stacked"
                     f" axes of {kernel_path!r} {kernel_shape}.")
  axis = None
  if kernel_axis is not None:
    axis = kernel_axis - (len(kernel_shape) - len(shape))
    if axis < pair.stacked or shape[axis] != kernel_shape[kernel_axis]:
      raise ValueError(
          f"{pair._spelled}: follower {path!r} with shape {shape} has no axis matching group axis"
          f" {kernel_axis} of {kernel_path!r} {kernel_shape}; a follower must share its kernel's"
          " trailing axes (a bias does).")
  return Slot(key, sign, axis, groups, pair.stacked)


def _resolve_pair(pair: Pair, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, Any]):
  """Yields each instance of ``pair`` with ``(path, slot, role)`` for each of its leaves."""
  sides = [[(pattern, ax, _matches(pattern, dtypes, pair))
            for pattern, ax in zip(pair.patterns(side), pair.side_axes(side))]
           for side in (0, 1)]
  matched = [(side, found) for side in (0, 1) for _, _, found in sides[side]]
  everywhere = set.intersection(*(set(found) for _, found in matched))
  for side, found in matched:
    for caps in sorted(set(found) - everywhere):
      other = next(p for s in sides for p, _, f in s if caps not in f)
      raise ValueError(f"{pair._spelled}: {found[caps]!r} (matched by {'ab'[side]}) has no partner"
                       f" matching {other!r} with the same wildcard captures.")
  follower_matches = [(+1, p, _matches(p, dtypes, pair)) for p in pair.follow_a]
  follower_matches += [(-1, p, _matches(p, dtypes, pair)) for p in pair.follow_b]
  for caps in sorted(everywhere):
    kernels = [[(found[caps], ax) for _, ax, found in sides[side]] for side in (0, 1)]
    key = "|".join("+".join(path for path, _ in side) for side in kernels)
    first = kernels[0][0][0]
    resolved = []  # (path, shape, absolute group axis, sign)
    for side, sign in zip(kernels, (+1, -1)):
      for path, ax in side:
        shape = shapes[path]
        if shape[:pair.stacked] != shapes[first][:pair.stacked]:
          raise ValueError(f"{pair._spelled}: stacked axes differ between {first!r}"
                           f" {shapes[first]} and {path!r} {shape}.")
        resolved.append((path, shape, _group_axis(pair, ax, path, shape), sign))
    if pair.axes is None:
      groups = 1
    else:
      sizes = {shape[axis] for _, shape, axis, _ in resolved}
      if pair.groups is None and len(sizes) > 1:
        listed = ", ".join(f"{path!r} {shape}" for path, shape, _, _ in resolved)
        raise ValueError(f"{pair._spelled}: group axes differ in size ({listed}); pass groups="
                         " to split all into the same number of blocks.")
      groups = pair.groups or sizes.pop()
      for path, shape, axis, _ in resolved:
        if shape[axis] % groups:
          raise ValueError(f"{pair._spelled}: {groups} groups do not divide axis of size"
                           f" {shape[axis]} of {path!r} with shape {shape}.")
    multi = len(resolved) > 2
    members = [(path, Slot(key, sign, axis, groups, pair.stacked),
                f"side {'a' if sign > 0 else 'b'}" + (f" (pattern {pattern!r})" if multi else ""))
               for (path, _, axis, sign), pattern in zip(
                   resolved, pair.patterns(0) + pair.patterns(1))]
    followers = {+1: [], -1: []}
    for sign, pattern, found in follower_matches:
      if caps not in found:
        raise ValueError(f"{pair._spelled}: follower pattern {pattern!r} has no match with the"
                         f" captures of {first!r}.")
      path = found[caps]
      kpath, _, kax, _ = next(r for r in resolved if r[3] == sign)
      slot = _follower_slot(pair, key, sign, kpath, shapes[kpath], kax, groups, path, shapes[path])
      members.append((path, slot, f"a follower of side {'a' if sign > 0 else 'b'}"
                      f" (pattern {pattern!r})"))
      followers[sign].append(path)
    fshape = tuple(shapes[first][:pair.stacked]) + ((groups,) if pair.axes is not None else ())
    yield Instance(key, pair, *(tuple(path for path, _ in side) for side in kernels),
                   tuple(followers[+1]), tuple(followers[-1]), fshape), members


def _claim(inst: Instance, members, declared: dict, roles: dict) -> None:
  """Records the leaves of ``inst``; raises if it is declared already or a leaf cannot join it.

  A leaf may be in several instances (their factors are then solved jointly),
  but in one instance once, and each of its axes grouped by one instance at
  most and not also a copy axis (``stacked``) of another: two groupings of
  one axis would need factors per combination of groups.
  """
  every = frozenset(inst.members_a + inst.members_b)
  if every in declared:
    raise ValueError(
        f"{declared[every].pair._spelled} and {inst.pair._spelled} both pair {inst.a!r} with"
        f" {inst.b!r}, so its factors would be applied twice. Declare each pair once.")
  declared[every] = inst
  for path, slot, role in members:
    for first_role, first, first_slot in roles.get(path, ()):
      if first.key == inst.key:
        raise ValueError(
            f"{inst.pair._spelled}: {path!r} is both {first_role} and {role} of the pair of"
            f" {inst.a!r} and {inst.b!r}; a leaf moves with one side of a pair only. Remove it"
            " from one of the patterns.")
      clash = next((f"axis {ax}" for ax, other in ((slot.axis, first_slot), (first_slot.axis, slot))
                    if ax is not None and (ax == other.axis or ax < other.stacked)), None)
      if clash:
        raise ValueError(
            f"{path!r} is {first_role} of {first.pair._spelled} (pairing {first.a!r} with"
            f" {first.b!r}) and {role} of {inst.pair._spelled} (pairing {inst.a!r} with"
            f" {inst.b!r}), both grouping or stacking its {clash}. Overlapping symmetries are"
            " balanced jointly when each groups a different axis of a shared leaf, outside the"
            " other's stacked axes.")
    roles.setdefault(path, []).append((role, inst, slot))


@functools.lru_cache(maxsize=256)
def _resolve_cached(pairs: tuple[Pair, ...], leaf_specs: tuple) -> Plan:
  shapes = {path: shape for path, shape, _ in leaf_specs}
  dtypes = {path: dtype for path, _, dtype in leaf_specs}
  instances, slots, declared, roles = [], {}, {}, {}
  for pair in pairs:
    for inst, members in _resolve_pair(pair, shapes, dtypes):
      _claim(inst, members, declared, roles)
      instances.append(inst)
      for path, slot, _ in members:
        slots[path] = slots.get(path, ()) + (slot,)
  return Plan(tuple(instances), slots, shapes)


def resolve(pairs: Sequence[Pair], tree: Any) -> Plan:
  """Resolves ``pairs`` on the leaves of ``tree``; raises ValueError on a bad declaration.

  Resolution looks only at paths, shapes and dtypes, so it runs once per tree
  structure at trace time and costs nothing inside a compiled step. Only
  floating-point leaves are declared.
  """
  return _resolve_cached(as_pairs(pairs), _leaf_specs(tree))


def as_pairs(pairs: Pair | Iterable[Pair]) -> tuple[Pair, ...]:
  """``pairs`` as a tuple; raises TypeError unless it is a Pair or a collection of them
  (a :func:`saggs_jax.discover` result is one; so is an empty list)."""
  if isinstance(pairs, Pair):
    return (pairs,)
  if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Iterable):
    raise TypeError(f"Expected a saggs_jax.Pair or a sequence of them, got {type(pairs).__name__}:"
                    f" {pairs!r}")
  for p in pairs:
    if not isinstance(p, Pair):
      raise TypeError(f"Expected saggs_jax.Pair, got {type(p).__name__}: {p!r}")
  return tuple(pairs)


def describe(pairs: Sequence[Pair], params: Any) -> str:
  """A readable table of what each declared pair resolved to on ``params``.

  Example::

    >>> import jax.numpy as jnp, saggs_jax as saggs
    >>> params = {"q": jnp.ones((8, 4)), "k": jnp.ones((8, 4))}
    >>> print(saggs.describe([saggs.Pair("q", "k", axes=(1, 1), groups=2)], params))
    pair            side  path  shape   group axis  factors
    --------------  ----  ----  ------  ----------  -------
    Pair('q', 'k')  a     q     (8, 4)  1           (2,)
    Pair('q', 'k')  b     k     (8, 4)  1           (2,)
    1 pair instance, 2 factors in all.
  """
  plan = resolve(pairs, params)
  rows = [("pair", "side", "path", "shape", "group axis", "factors")]
  for inst in plan.instances:
    for side, path in ([("a", p) for p in inst.members_a] + [("b", p) for p in inst.members_b]
                       + [("a+", p) for p in inst.followers_a]
                       + [("b+", p) for p in inst.followers_b]):
      slot = plan.slot(path, inst.key)
      axis = "whole" if slot.axis is None else str(slot.axis)
      rows.append((inst.pair.label, side, path, str(plan.shapes[path]), axis, str(inst.factor_shape)))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
  lines.insert(1, "  ".join("-" * w for w in widths))
  n_instances = len(plan.instances)
  n_factors = sum(math.prod(i.factor_shape) for i in plan.instances)
  lines.append(f"{n_instances} pair instance{'s' * (n_instances != 1)},"
               f" {n_factors} factor{'s' * (n_factors != 1)} in all.")
  shared = [path for path, slots in plan.slots.items() if len(slots) > 1]
  if shared:
    lines.append(f"In several pairs, so balanced jointly: {', '.join(shared)}.")
  # What saggs_jax.discover found to be no symmetry, and why.
  lines += [f"Rejected: {r.a!r} against {r.b!r}: {r.reason}" for r in getattr(pairs, "rejected", ())]
  return "\n".join(lines)
