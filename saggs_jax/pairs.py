"""Declaring exact symmetry pairs and resolving them against a parameter tree.

A :class:`Pair` says: scaling every group of ``a`` by ``c`` and the matching
group of ``b`` by ``1/c`` leaves the model's function unchanged. Resolution
turns the declaration into :class:`Slot` records, one per matched leaf, that the
balancing and transport code index by path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from saggs_jax import paths


def _as_tuple(x) -> tuple[str, ...]:
  return (x,) if isinstance(x, str) else tuple(x)


def _is_int(x) -> bool:
  """An int that is not a bool: ``True`` would silently read as 1."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class Pair:
  """An exact symmetry: ``a`` scaled by ``c`` per group, ``b`` by ``1/c``.

  Attributes:
    a: path pattern of the side scaled by ``c`` (see :mod:`saggs_jax.paths`).
    b: path pattern of the side scaled by ``1/c``. A- and B-matches pair up by
      equal wildcard captures; every match needs exactly one partner.
    axes: ``(axis_a, axis_b)``, the group axis on each side, or ``None`` for
      one group spanning the whole tensor. Axes count within one layer: after
      the ``stacked`` leading axes. Negative axes count from the end.
    groups: split the group axis into this many contiguous blocks (for GQA,
      the number of KV heads). Default: one group per index.
    stacked: leading axes present on both sides that index independent copies
      (scanned layers, experts). Factors then have shape
      ``stacked_shape + (groups,)``.
    follow_a: patterns of tensors that move with ``a`` (its biases). A follower
      shares its kernel's trailing axes, so its group axis is the kernel's
      counted from the end.
    follow_b: likewise for ``b``.
    name: label used in errors (with the patterns) and in :func:`saggs_jax.describe`.

  Example::

    >>> import saggs_jax as saggs
    >>> qk = saggs.Pair("attn/q_proj/kernel", "attn/k_proj/kernel",
    ...                 axes=(1, 1), groups=2, follow_a="attn/q_proj/bias")
  """

  a: str
  b: str
  axes: tuple[int, int] | None = None
  groups: int | None = None
  stacked: int = 0
  follow_a: str | Sequence[str] = ()
  follow_b: str | Sequence[str] = ()
  name: str | None = None

  def __post_init__(self):
    object.__setattr__(self, "follow_a", _as_tuple(self.follow_a))
    object.__setattr__(self, "follow_b", _as_tuple(self.follow_b))
    for p in (self.a, self.b, *self.follow_a, *self.follow_b):
      if not isinstance(p, str):
        raise ValueError(f"{self._spelled}: patterns must be strings, got {p!r}.")
    if self.axes is not None:
      if not (isinstance(self.axes, (tuple, list)) and len(self.axes) == 2
              and all(map(_is_int, self.axes))):
        raise ValueError(
            f"{self._spelled}: axes must be None or a pair of ints (axis_a, axis_b), got"
            f" {self.axes!r}; e.g. axes=(1, 1) groups axis 1 of both sides.")
      object.__setattr__(self, "axes", tuple(int(x) for x in self.axes))
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
    n = paths.num_captures(self.a)
    for p in (self.b, *self.follow_a, *self.follow_b):
      if paths.num_captures(p) != n:
        raise ValueError(
            f"{self._spelled}: pattern {p!r} has a different number of wildcards than {self.a!r};"
            " matches are paired by their wildcard captures.")

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
  """One resolved pair: the two primary leaves and their followers."""

  key: str
  pair: Pair
  a: str
  b: str
  followers_a: tuple[str, ...]
  followers_b: tuple[str, ...]
  factor_shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
  """All instances resolved on one tree, and the slots of every leaf path."""

  instances: tuple[Instance, ...]
  slots: dict[str, tuple[Slot, ...]]
  shapes: dict[str, tuple[int, ...]]

  def slot(self, path: str, key: str) -> Slot:
    """How the leaf at ``path`` moves in the pair instance ``key``."""
    return next(s for s in self.slots[path] if s.key == key)


def _leaf_specs(tree: Any) -> tuple[tuple[str, tuple[int, ...], Any], ...]:
  """``(path, shape, dtype)`` of every leaf: all that resolution reads, hence its cache key."""
  out = {}
  for path, leaf in paths.leaves_with_paths(tree):
    if path in out:
      raise ValueError(f"Two leaves share the path {path!r}; paths must be unique.")
    dtype = getattr(leaf, "dtype", None)
    out[path] = (tuple(np.shape(leaf)), np.asarray(leaf).dtype if dtype is None else dtype)
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


def _group_axis(pair: Pair, side: int, path: str, shape: tuple[int, ...]) -> int | None:
  if len(shape) < pair.stacked:
    raise ValueError(
        f"{pair._spelled}: {path!r} has shape {shape}, fewer than stacked={pair.stacked} axes.")
  if pair.axes is None:
    return None
  ax = pair.axes[side]
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
  a_matches = _matches(pair.a, dtypes, pair)
  b_matches = _matches(pair.b, dtypes, pair)
  unpaired = sorted(set(a_matches) ^ set(b_matches))
  if unpaired:
    caps = unpaired[0]
    side, path = ("a", a_matches[caps]) if caps in a_matches else ("b", b_matches[caps])
    other = pair.b if side == "a" else pair.a
    raise ValueError(f"{pair._spelled}: {path!r} (matched by {side}) has no partner matching"
                     f" {other!r} with the same wildcard captures.")
  follower_matches = [(+1, p, _matches(p, dtypes, pair)) for p in pair.follow_a]
  follower_matches += [(-1, p, _matches(p, dtypes, pair)) for p in pair.follow_b]
  for caps in sorted(a_matches):
    pa, pb = a_matches[caps], b_matches[caps]
    sa, sb = shapes[pa], shapes[pb]
    key = f"{pa}|{pb}"
    if sa[:pair.stacked] != sb[:pair.stacked]:
      raise ValueError(f"{pair._spelled}: stacked axes differ between {pa!r} {sa} and {pb!r} {sb}.")
    ax_a, ax_b = _group_axis(pair, 0, pa, sa), _group_axis(pair, 1, pb, sb)
    if pair.axes is None:
      groups = 1
    else:
      na, nb = sa[ax_a], sb[ax_b]
      if pair.groups is None and na != nb:
        raise ValueError(f"{pair._spelled}: group axes differ in size ({pa!r} {sa} vs {pb!r} {sb});"
                         " pass groups= to split both into the same number of blocks.")
      groups = pair.groups or na
      for path, n, shape in ((pa, na, sa), (pb, nb, sb)):
        if n % groups:
          raise ValueError(f"{pair._spelled}: {groups} groups do not divide axis of size {n} of"
                           f" {path!r} with shape {shape}.")
    members = [(pa, Slot(key, +1, ax_a, groups, pair.stacked), "side a"),
               (pb, Slot(key, -1, ax_b, groups, pair.stacked), "side b")]
    followers = {+1: [], -1: []}
    for sign, pattern, found in follower_matches:
      if caps not in found:
        raise ValueError(f"{pair._spelled}: follower pattern {pattern!r} has no match with the"
                         f" captures of {pa!r}.")
      path = found[caps]
      kpath, kax = (pa, ax_a) if sign > 0 else (pb, ax_b)
      slot = _follower_slot(pair, key, sign, kpath, shapes[kpath], kax, groups, path, shapes[path])
      members.append((path, slot, f"a follower of side {'a' if sign > 0 else 'b'}"
                      f" (pattern {pattern!r})"))
      followers[sign].append(path)
    fshape = tuple(sa[:pair.stacked]) + ((groups,) if pair.axes is not None else ())
    yield Instance(key, pair, pa, pb, tuple(followers[+1]), tuple(followers[-1]), fshape), members


def _claim(inst: Instance, members, declared: dict, roles: dict) -> None:
  """Records the leaves of ``inst``; raises if it or one of its leaves is declared already.

  The factors of all instances are applied at once, which balances each one
  exactly only when no leaf is shared: a shared leaf would need the factors
  solved jointly, and an instance declared twice would be applied twice.
  """
  both = frozenset((inst.a, inst.b))
  if both in declared:
    raise ValueError(
        f"{declared[both].pair._spelled} and {inst.pair._spelled} both pair {inst.a!r} with"
        f" {inst.b!r}, so its factors would be applied twice. Declare each pair once.")
  declared[both] = inst
  for path, _, role in members:
    if path not in roles:
      roles[path] = (role, inst)
      continue
    first_role, first = roles[path]
    if first.key == inst.key:
      raise ValueError(
          f"{inst.pair._spelled}: {path!r} is both {first_role} and {role} of the pair of"
          f" {inst.a!r} and {inst.b!r}; a leaf moves with one side of a pair only. Remove it from"
          " one of the patterns.")
    raise ValueError(
        f"{path!r} is {first_role} of {first.pair._spelled} (pairing {first.a!r} with {first.b!r})"
        f" and {role} of {inst.pair._spelled} (pairing {inst.a!r} with {inst.b!r}). Overlapping"
        " symmetries (one leaf in two pair instances) are not supported yet: the factors of all"
        " instances are applied at once, which does not balance them jointly. Declare each leaf"
        " in at most one pair.")


@functools.lru_cache(maxsize=256)
def _resolve_cached(pairs: tuple[Pair, ...], leaf_specs: tuple) -> Plan:
  shapes = {path: shape for path, shape, _ in leaf_specs}
  dtypes = {path: dtype for path, _, dtype in leaf_specs}
  instances, slots, declared, roles = [], {}, {}, {}
  for pair in pairs:
    for inst, members in _resolve_pair(pair, shapes, dtypes):
      _claim(inst, members, declared, roles)
      instances.append(inst)
      slots.update((path, (slot,)) for path, slot, _ in members)
  return Plan(tuple(instances), slots, shapes)


def resolve(pairs: Sequence[Pair], tree: Any) -> Plan:
  """Resolves ``pairs`` on the leaves of ``tree``; raises ValueError on a bad declaration.

  Resolution looks only at paths, shapes and dtypes, so it runs once per tree
  structure at trace time and costs nothing inside a compiled step. Every leaf
  is in at most one pair instance, and only floating-point leaves are.
  """
  if isinstance(pairs, Pair):
    pairs = (pairs,)
  pairs = tuple(pairs)
  for p in pairs:
    if not isinstance(p, Pair):
      raise TypeError(f"Expected saggs_jax.Pair, got {type(p).__name__}: {p!r}")
  return _resolve_cached(pairs, _leaf_specs(tree))


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
    for side, path in [("a", inst.a), ("b", inst.b)] + [("a+", p) for p in inst.followers_a] + [
        ("b+", p) for p in inst.followers_b]:
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
  return "\n".join(lines)
