"""Declaring exact symmetry pairs: what users write.

A :class:`Pair` says: scaling every group of ``a`` by ``c`` and the matching
group of ``b`` by ``1/c`` leaves the model's function unchanged. A side may be
several tensors (a norm gain against the input rows of every linear reading
the normalised activations). A :class:`Block` names a fixed part of one axis
of a fused leaf (GPT-2's q|k|v blocks), and stands anywhere a pattern does.
The copy-axes helpers count axes as a pair's ``axes`` and a Block's ``axis`` do.
:mod:`saggs_jax._src.plan` resolves the declarations against a parameter tree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TypeGuard

import numpy as np

from saggs_jax._src import paths


def _as_tuple(x) -> tuple:
  return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _is_int(x) -> TypeGuard[int | np.integer]:
  """An int that is not a bool: ``True`` would silently read as 1."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def copy_positions(stacked: int | tuple[int, ...]) -> tuple[int, ...]:
  """The copy axes' positions that a pair's ``stacked`` names: ``n`` leading ones, or the
  positions themselves."""
  return tuple(stacked) if isinstance(stacked, tuple) else tuple(range(stacked))


def free_axes(ndim: int, copy: tuple[int, ...]) -> tuple[int, ...]:
  """The axes of a leaf of ``ndim`` axes that are not copy axes: those a pair's ``axes``
  and a Block's ``axis`` count among."""
  return tuple(i for i in range(ndim) if i not in copy)


def per_copy_axis(axis: int, copy: tuple[int, ...]) -> int:
  """The absolute ``axis`` (not a copy axis) counted among the axes of one copy."""
  return axis - sum(c < axis for c in copy)


# A leaf with fewer axes than a pair's copy axes (``stacked``) needs: two raises say it.
COPY_AXES_MSG = (
  "{where}: {path!r} has shape {shape}, too few axes for the copy axes at {copy}."
  " Set stacked= to the copy axes this leaf has."
)


def absolute_axis(where: str, what: str, axis: int, path: str, shape, copy: tuple[int, ...]) -> int:
  """The absolute axis of ``axis``, counted among the non-copy axes of the leaf at ``path``."""
  if copy and max(copy) >= len(shape):
    raise ValueError(COPY_AXES_MSG.format(where=where, path=path, shape=shape, copy=copy))
  free = free_axes(len(shape), copy)
  if not -len(free) <= axis < len(free):
    raise ValueError(
      f"{where}: {what} {axis} is out of range for {path!r} with shape {shape}"
      f" ({len(free)} axes besides the copy axes at {copy}). Count it among those."
    )
  return free[axis]


@dataclasses.dataclass(frozen=True)
class Block:
  """A fixed part of one axis of the leaves ``pattern`` matches: a fused leaf's role.

  The axis is split into ``parts`` contiguous parts (equal, or of ``sizes``)
  and the block is part ``part`` of them. It stands wherever a :class:`Pair`
  takes a pattern (``a``, ``b``, ``follow_a``, ``follow_b``) and is then
  treated as a tensor of its own: it keeps the leaf's number of axes, the
  block axis having the part's size, and the pair's group axes and
  ``groups`` count in those coordinates. Disjoint blocks of one leaf may sit
  on both sides of a pair and in several pairs.

  Attributes:
    pattern: path pattern of the fused leaves (see :mod:`saggs_jax._src.paths`).
    axis: the split axis, counted like a pair's group axes: among the axes that
      are not the pair's ``stacked`` copy axes, negative from the end.
    parts: the number of parts, or their names.
    part: the block's part: a name from ``parts`` or an index.
    sizes: the parts' sizes along ``axis`` when they differ (fused QKV under
      GQA); default equal parts.

  Example (GPT-2's fused attention, kernel (out, in) = (3d, d): q|k|v rows)::

    >>> import saggs_jax as saggs
    >>> qkv = dict(axis=0, parts=("q", "k", "v"))
    >>> qk = saggs.Pair(saggs.Block("attn/c_attn/kernel", part="q", **qkv),
    ...                 saggs.Block("attn/c_attn/kernel", part="k", **qkv), axes=(0, 0), groups=12)
    >>> qk.a
    Block('attn/c_attn/kernel', axis=0, parts=('q', 'k', 'v'), part='q')
  """

  pattern: str
  axis: int
  parts: int | tuple[str, ...]
  part: int | str
  sizes: tuple[int, ...] | None = None

  def __post_init__(self) -> None:
    if not isinstance(self.pattern, str):
      raise ValueError(f"{self!r}: pattern must be a string.")
    if not _is_int(self.axis):
      raise ValueError(f"{self!r}: axis must be an int.")
    if isinstance(self.parts, (list, tuple)):
      object.__setattr__(self, "parts", tuple(self.parts))
      if (
        len(self.parts) < 1
        or not all(isinstance(n, str) and n for n in self.parts)
        or len(set(self.parts)) != len(self.parts)
      ):
        raise ValueError(f"{self!r}: parts must be distinct non-empty names, or their number.")
    elif not (_is_int(self.parts) and self.parts >= 1):
      raise ValueError(f"{self!r}: parts must be a positive int or a tuple of names.")
    n = len(self.names)
    if not (
      (_is_int(self.part) and 0 <= self.part < n)
      or (isinstance(self.parts, tuple) and self.part in self.parts)
    ):
      named = f"one of {self.parts} or " if isinstance(self.parts, tuple) else ""
      raise ValueError(f"{self!r}: part must be {named}an index below {n}.")
    if self.sizes is not None:
      object.__setattr__(
        self, "sizes", tuple(self.sizes) if isinstance(self.sizes, (list, tuple)) else self.sizes
      )
      if not (
        isinstance(self.sizes, tuple)
        and len(self.sizes) == n
        and all(_is_int(s) and s > 0 for s in self.sizes)
      ):
        raise ValueError(f"{self!r}: sizes must be {n} positive ints, one per part.")

  def __repr__(self) -> str:  # valid Python, so that a Discovery's repr runs
    sizes = "" if self.sizes is None else f", sizes={self.sizes!r}"
    return (
      f"Block({self.pattern!r}, axis={self.axis!r}, parts={self.parts!r},"
      f" part={self.part!r}{sizes})"
    )

  @property
  def names(self) -> tuple[str, ...]:
    """The parts' names (their indices, for unnamed parts)."""
    return self.parts if isinstance(self.parts, tuple) else tuple(map(str, range(self.parts)))

  @property
  def index(self) -> int:
    return int(self.part) if _is_int(self.part) else self.names.index(self.part)

  def span(
    self, where: str, path: str, shape: tuple[int, ...], copy: tuple[int, ...]
  ) -> tuple[int, int, int]:
    """``(absolute axis, start, stop)`` of the block in the leaf at ``path`` whose copy
    axes are at ``copy``."""
    axis = absolute_axis(where, f"{self!r} axis", self.axis, path, shape, copy)
    size, n = shape[axis], len(self.names)
    if self.sizes is None and size % n:
      raise ValueError(
        f"{where}: {self!r} cannot split axis {axis} of size {size} of {path!r}"
        f" with shape {shape} into {n} equal parts. Pass sizes=, one size per part."
      )
    sizes = self.sizes or (size // n,) * n
    if sum(sizes) != size:
      raise ValueError(
        f"{where}: {self!r} sizes sum to {sum(sizes)}, but axis {axis} of"
        f" {path!r} with shape {shape} has size {size}. Pass sizes= that sum to {size}."
      )
    start = sum(sizes[: self.index])
    return axis, start, start + sizes[self.index]


Spec = str | Block


def pattern_of(spec: Spec) -> str:
  return spec.pattern if isinstance(spec, Block) else spec


@dataclasses.dataclass(frozen=True)
class Pair:
  """An exact symmetry: ``a`` scaled by ``c`` per group, ``b`` by ``1/c``.

  Attributes:
    a: path pattern of the side scaled by ``c``, or a tuple of patterns (several tensors,
      one norm over all of them). A :class:`Block` may stand for any pattern.
    b: path pattern(s) of the side scaled by ``1/c``. Matches pair up by equal wildcard
      captures; every match needs exactly one partner in every other pattern.
    axes: ``(axis_a, axis_b)``, the group axis on each side (counted among the axes that
      are not ``stacked``; negative from the end; a tuple per pattern on a side of
      several), or ``None`` for one group spanning the whole tensor.
    groups: split the group axis into this many contiguous blocks (for GQA, the number
      of KV heads). Default: one group per index.
    stacked: the axes of every leaf of the pair that index independent copies (scanned
      layers, experts): ``n`` for the ``n`` leading axes, or increasing positions such
      as ``(1,)`` for MaxText's layer axis. Factors have shape ``stacked_shape +
      (groups,)``; :func:`saggs_jax.copy_axes` reads the positions from Flax's metadata.
    follow_a: patterns of tensors that move with ``a`` (its biases) without counting in
      its norm. A follower of one axis per copy is grouped along it; one of more axes
      shares the kernel's trailing axes.
    follow_b: likewise for ``b``.
    name: label used in errors and in :func:`saggs_jax.describe`.
    ndim: ``(ndim_a, ndim_b)``, the number of axes of every member of each side besides
      the copy axes (``None``: any); a member of another rank is an error naming its
      path. A check only: not in the repr nor compared.

  Example:
    >>> import saggs_jax as saggs
    >>> qk = saggs.Pair("attn/q_proj/kernel", "attn/k_proj/kernel",
    ...                 axes=(1, 1), groups=2, follow_a="attn/q_proj/bias")
    >>> gain = saggs.Pair("attn_norm/scale", ("attn/q_proj/kernel", "attn/k_proj/kernel",
    ...                   "attn/v_proj/kernel"), axes=(0, 0), name="RMSNorm gain")
    >>> # MaxText's scanned MLP: wi_1 (emb, layers, mlp), wo (mlp, layers, emb)
    >>> up = saggs.Pair("mlp/wi_1/kernel", "mlp/wo/kernel", axes=(1, 0), stacked=(1,))
  """

  a: Spec | tuple[Spec, ...]
  b: Spec | tuple[Spec, ...]
  axes: tuple[int | tuple[int, ...], int | tuple[int, ...]] | None = None
  groups: int | None = None
  stacked: int | tuple[int, ...] = 0
  follow_a: Spec | Sequence[Spec] = ()
  follow_b: Spec | Sequence[Spec] = ()
  name: str | None = None
  # A check, not part of the symmetry: equal pairs declare the same factors with or without.
  ndim: tuple[int | None, int | None] | None = dataclasses.field(
    default=None, repr=False, compare=False
  )

  def __post_init__(self) -> None:
    if self.name is not None and not isinstance(self.name, str):
      raise ValueError(
        f"Pair({self.a!r}, {self.b!r}): name must be a string or None, got {self.name!r}."
      )
    for side in ("a", "b"):  # one pattern stays a str, so reprs of plain pairs are unchanged
      value = getattr(self, side)
      if not isinstance(value, str):
        value = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        if not value:
          raise ValueError(f"{self.spelled}: side {side} needs at least one pattern.")
        object.__setattr__(self, side, value[0] if len(value) == 1 else value)
    object.__setattr__(self, "follow_a", _as_tuple(self.follow_a))
    object.__setattr__(self, "follow_b", _as_tuple(self.follow_b))
    for p in (*self.patterns(0), *self.patterns(1), *self.followers(0), *self.followers(1)):
      if not isinstance(p, (str, Block)):
        raise ValueError(f"{self.spelled}: patterns must be strings or Blocks, got {p!r}.")
    if self.axes is not None:
      object.__setattr__(self, "axes", self._checked_axes())
    if self.ndim is not None:
      if not (
        isinstance(self.ndim, (tuple, list))
        and len(self.ndim) == 2
        and all(n is None or (_is_int(n) and n >= 0) for n in self.ndim)
      ):
        raise ValueError(
          f"{self.spelled}: ndim must be None or (ndim_a, ndim_b), each an int >= 0 or None,"
          f" got {self.ndim!r}."
        )
      object.__setattr__(self, "ndim", tuple(self.ndim))
    if self.groups is not None:
      if not _is_int(self.groups) or self.groups < 1:
        raise ValueError(f"{self.spelled}: groups must be a positive int, got {self.groups!r}.")
      if self.axes is None:
        raise ValueError(
          f"{self.spelled}: groups={self.groups!r} needs a group axis to split; pass"
          " axes=(axis_a, axis_b), or drop groups for one group per whole tensor."
        )
      object.__setattr__(self, "groups", int(self.groups))
    stacked, ok = self.stacked, False
    if isinstance(stacked, (tuple, list)) and all(map(_is_int, stacked)):
      stacked = tuple(map(int, stacked))
      ok = all(a < b for a, b in zip((-1,) + stacked, stacked))
    elif _is_int(stacked):
      stacked, ok = int(stacked), stacked >= 0
    if not ok:
      raise ValueError(
        f"{self.spelled}: stacked must be an int >= 0 (the number of leading copy axes)"
        f" or a tuple of increasing axis positions >= 0, got {self.stacked!r}. Pass e.g."
        " stacked=(1,) for a layer axis at position 1."
      )
    object.__setattr__(self, "stacked", stacked)
    first = self.patterns(0)[0]
    n = paths.num_captures(pattern_of(first))
    for p in (*self.patterns(0)[1:], *self.patterns(1), *self.followers(0), *self.followers(1)):
      if paths.num_captures(pattern_of(p)) != n:
        raise ValueError(
          f"{self.spelled}: pattern {p!r} has a different number of wildcards than {first!r};"
          " matches are paired by their wildcard captures."
        )

  @property
  def copy_axes(self) -> tuple[int, ...]:
    """The positions of the copy axes in each of the pair's leaves."""
    return copy_positions(self.stacked)

  def patterns(self, side: int) -> tuple[Spec, ...]:
    """The patterns (or blocks) of side a (0) or b (1)."""
    return _as_tuple((self.a, self.b)[side])

  def followers(self, side: int) -> tuple[Spec, ...]:
    """The patterns (or blocks) that follow side a (0) or b (1)."""
    return _as_tuple((self.follow_a, self.follow_b)[side])

  def side_axes(self, side: int) -> tuple[int | None, ...]:
    """The group axis of each pattern of side a (0) or b (1); None: the whole tensor."""
    ax = None if self.axes is None else self.axes[side]
    if ax is None:
      return (None,) * len(self.patterns(side))
    return ax if isinstance(ax, tuple) else (ax,) * len(self.patterns(side))

  def _checked_axes(self):
    def valid(ax, n):  # an int, or one int per pattern of a side of several
      return _is_int(ax) or (
        isinstance(ax, (tuple, list)) and len(ax) == n > 1 and all(map(_is_int, ax))
      )

    if not (
      isinstance(self.axes, (tuple, list))
      and len(self.axes) == 2
      and all(valid(ax, len(self.patterns(side))) for side, ax in enumerate(self.axes))
    ):
      raise ValueError(
        f"{self.spelled}: axes must be None or a pair of ints (axis_a, axis_b), got"
        f" {self.axes!r}. Pass e.g. axes=(1, 1) (axis 1 of both sides), or a tuple per side"
        " of several patterns."
      )
    return tuple(
      tuple(map(int, ax)) if isinstance(ax, (tuple, list)) else int(ax) for ax in self.axes
    )

  @property
  def label(self) -> str:
    return self.name or f"Pair({self.a!r}, {self.b!r})"

  @property
  def spelled(self) -> str:
    """The label with the patterns: errors name both."""
    plain = f"Pair({self.a!r}, {self.b!r})"
    return f"{self.name!r} = {plain}" if self.name else plain


def as_pairs(pairs: Pair | Iterable[Pair]) -> tuple[Pair, ...]:
  """``pairs`` as a tuple; raises TypeError unless it is a Pair or a collection of them
  (a :func:`saggs_jax.discover` result is one; so is an empty list)."""
  if isinstance(pairs, Pair):
    return (pairs,)
  if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Iterable):
    raise TypeError(
      f"Expected a saggs_jax.Pair or a sequence of them, got {type(pairs).__name__}: {pairs!r}"
    )
  for p in pairs:
    if not isinstance(p, Pair):
      raise TypeError(f"Expected saggs_jax.Pair, got {type(p).__name__}: {p!r}")
  return tuple(pairs)
