"""What a factor on a parameter is where it arrives, and what it meets there.

A value the factor reaches is a :class:`Tag` (scaled per channel: which of its axes carry
which source-leaf axes, and why it may no longer be exact), a :class:`Taint` (changed by
the factor, with no channel axis left: a norm statistic), or :data:`SIGN` (a comparison
with zero, unchanged by a positive factor); what it meets on the way is a
:class:`Trace`; a program's static facts are a :class:`Flow`. :mod:`.primitives` says how
each primitive moves them, :mod:`.propagation` follows one factor through a program.
"""

from __future__ import annotations

import enum
import functools
import operator
from collections.abc import Sequence
from typing import NamedTuple

from saggs_jax._src.discovery.program import Program

Shape = Sequence[int]


# ---------------------------------------------------------------------------
# Why a factor is no longer exact.


class Cause(enum.Enum):
  """The kind of a :class:`Reason`; its value starts the message that explains it."""

  NONLINEAR = "not positively homogeneous"  # a primitive such as exp, tanh, reduce_prod
  INEXACT = "not exact"  # anything else: an added constant, a normalization


class Reason(NamedTuple):
  """Why a factor is no longer exact: a primitive's name, or a phrase."""

  cause: Cause
  text: str


def nonlinear(prim: str) -> Reason:
  return Reason(Cause.NONLINEAR, prim)


def inexact(text: str) -> Reason:
  return Reason(Cause.INEXACT, text)


NORM = inexact("a normalization over its channels")
UNLIKE = inexact("a concatenation with a value that does not scale like it")


def explain(reasons: frozenset[Reason], where: str) -> str:
  """Why a factor is not cancelled exactly: the nonlinear primitives if any, else the reasons."""
  prims = sorted(r.text for r in reasons if r.cause is Cause.NONLINEAR)
  if prims:
    return f"{Cause.NONLINEAR.value}: {', '.join(prims)} {where}"
  return f"{Cause.INEXACT.value}: {'; '.join(sorted(r.text for r in reasons))} {where}"


# ---------------------------------------------------------------------------
# Values.


class Tag(NamedTuple):
  """A value scaled per channel: value axis -> source leaf axes; why it is no longer exact.
  With a ``span`` ``(axis, lo, hi)``, only the entries ``[lo, hi)`` of that value axis scale,
  the rest not at all: a block of a concatenation (MLA's key, the latent's non-rotary dims
  beside a rotary key that no head's factor reaches)."""

  axes: tuple[tuple[int, frozenset[int]], ...]
  reasons: frozenset[Reason] = frozenset()
  positive: bool = False  # exact for positive factors only (it went through a ReLU, say)
  span: tuple[int, int, int] | None = None

  @property
  def amap(self) -> dict[int, frozenset[int]]:
    return dict(self.axes)


class Taint(NamedTuple):
  """A value changed by the factor without a channel axis (a norm statistic, say)."""

  reasons: frozenset[Reason]


class Sign:
  """A comparison of the factor's value with zero: unchanged by a positive factor."""


SIGN = Sign()
Value = Tag | Taint | Sign


def tag(
  amap: dict[int, frozenset[int]], reasons: frozenset[Reason] = frozenset(), positive: bool = False
) -> Tag | None:
  """The :class:`Tag` of ``amap`` without its empty entries; None if none is left."""
  axes = tuple(sorted((a, s) for a, s in amap.items() if s))
  return Tag(axes, frozenset(reasons), positive) if axes else None


# ---------------------------------------------------------------------------
# Pure axis bookkeeping.


def reshape_map(old: Shape, new: Shape) -> tuple[list[list[int]], list[list[int]]]:
  """For each old axis the new axes of its block, and each block's new sizes.

  Axes of size 1 map nowhere. ``(6, 4) -> (2, 3, 4)``: axis 0 splits into new
  axes 0 and 1 of sizes 2 and 3; ``(2, 3, 4) -> (6, 4)``: old axes 0 and 1
  both land on new axis 0 (of size 6).
  """
  out: list[list[int]] = [[] for _ in old]
  sizes: list[list[int]] = [[] for _ in old]
  i = j = 0
  while i < len(old) and j < len(new):
    if old[i] == 1:
      i += 1
      continue
    if new[j] == 1:
      j += 1
      continue
    bi, bj, po, pn = [i], [j], old[i], new[j]
    i, j = i + 1, j + 1
    while po != pn:
      if po < pn:
        bi.append(i)
        po *= old[i]
        i += 1
      else:
        bj.append(j)
        pn *= new[j]
        j += 1
    for a in bi:
      out[a], sizes[a] = bj, [new[b] for b in bj]
  return out, sizes


def dot_out_axis(dims, shapes: Sequence[Shape], side: int) -> dict[int, int]:
  """Output position of every batch or free axis of operand ``side`` of a dot_general."""
  (lc, rc), (lb, rb) = dims
  contract, batch = (lc, rc), (lb, rb)
  free = [
    [a for a in range(len(s)) if a not in contract[i] and a not in batch[i]]
    for i, s in enumerate(shapes)
  ]
  out = {a: i for i, a in enumerate(batch[side])}
  offset = len(batch[0]) + (len(free[0]) if side else 0)
  out.update({a: offset + i for i, a in enumerate(free[side])})
  return out


# ---------------------------------------------------------------------------
# The program's static facts: leaf views, uses, dependence on leaves, zeros.


class View(NamedTuple):
  """A value that is a leaf with its axes moved (transposed, reshaped, sliced by a scan)."""

  leaf: int
  axes: tuple[frozenset[int], ...]  # per axis of the value: the leaf axes it holds
  consumed: tuple[int, ...]  # leaf axes sliced off by scans (layers), outermost first
  gathered: frozenset[int] = frozenset()  # value axes indexing a leaf axis by computed indices


class Use(NamedTuple):
  """Operand ``operand`` of eqn ``eqn`` reads ``view``."""

  eqn: int
  operand: int
  view: View


class Flow(NamedTuple):
  """What :func:`follow` needs to know of a program, computed once by :func:`flow`."""

  prog: Program
  views: dict[int, View]  # value id -> the leaf it is a view of
  uses: dict[int, list[Use]]  # leaf -> its uses, in program order
  dep: list[bool]  # per value id: whether it depends on a leaf
  zeros: set[int]  # values known to be all zeros (zero constants moved around)
  consumers: dict[int, list[int]]  # value id -> the eqns that read it


# ---------------------------------------------------------------------------
# What a factor meets.


class Reach(NamedTuple):
  """The factor is contracted against parameter ``leaf``: a candidate ``A -> leaf``."""

  leaf: int
  amap: dict[int, frozenset[int]]  # source leaf axis -> leaf axes of the reached parameter
  consumed: tuple[int, ...]  # its axes sliced off by scans
  eqn: int
  reasons: frozenset[Reason]
  positive: bool


class Meet(NamedTuple):
  """The factor is contracted against another value that depends on parameters (Q.K)."""

  eqn: int
  side: int
  positions: tuple[tuple[str, int], ...]  # ("c" or "b", k): the dimension numbers it sits on
  reasons: frozenset[Reason]
  positive: bool
  span: tuple[int, int, int] | None = None  # (k, lo, hi): only [lo, hi) of contracted dim k


class Follower(NamedTuple):
  """Parameter ``leaf`` is added to the factor's value along its channels (a bias); the
  candidates stage replaces ``leaf`` by the unit of its block when the source is cut."""

  leaf: int
  amap: dict[int, frozenset[int]]  # source leaf axis -> leaf axes of the follower
  consumed: tuple[int, ...]


class Lost(NamedTuple):
  """A linear map reads parameter ``leaf`` with what the factor became, inexact for ``reasons``."""

  leaf: int
  reasons: frozenset[Reason]


class Cut(NamedTuple):
  """The block ``[lo, hi)`` of a source leaf's ``axis`` (a fused QKV kernel's q columns); with
  a ``period``, the block ``[lo, hi)`` of every run of ``period`` entries along it (columns
  interleaved per head, ``[q_0 k_0 v_0 q_1 k_1 v_1 ...]``, as BLOOM stores them)."""

  axis: int
  lo: int
  hi: int
  period: int = 0  # 0: one run, the whole axis


class Via(enum.Enum):
  """What the factor went through, naming the pair; the first found wins."""

  ATTENTION = "attention V/O"  # a product with another activation (the attention weights)
  GATE = "gated MLP up/down"  # an elementwise product with another activation (a GLU)
  RELU = "ReLU MLP up/down"


REACHES_OUTPUT = "it reaches the model's output directly"
RESIDUAL = "it is added to a value that does not scale with it (the residual stream, say)"


class Trace(NamedTuple):
  """What a factor met on its way, in program order: a whole run's, or one step's part."""

  reaches: tuple[Reach, ...] = ()
  meets: tuple[Meet, ...] = ()
  summed: tuple[Meet, ...] = ()  # its sums over the channels meet another activation
  followers: tuple[Follower, ...] = ()
  lost: tuple[Lost, ...] = ()  # lost before a linear map
  breaks: frozenset[str] = frozenset()  # why part of it is lost exactly
  gates: frozenset[int] = frozenset()  # the GLU products it went through
  splits: frozenset[int] = frozenset()  # the sizes a reshape split a channel axis into
  through: frozenset[Via] = frozenset()
  cuts: frozenset[Cut] = frozenset()  # blocks of the source leaf that were read alone
  joined: frozenset[int] = frozenset()  # leaf axes whose blocks add up again

  @classmethod
  def merge(cls, parts: Sequence[Trace]) -> Trace:
    """The parts' fields concatenated (tuples) or united (sets)."""
    return cls._make(
      functools.reduce(
        operator.or_ if isinstance(empty, frozenset) else operator.add, fields, empty
      )
      for empty, *fields in zip(cls(), *parts)
    )
