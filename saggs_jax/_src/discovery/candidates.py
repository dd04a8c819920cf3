"""Candidates: the rescalings the program suggests, and what it rules out on its own.

Every use of a parameter as a linear map or a gain is a source; its factor is
followed (:func:`~saggs_jax._src.discovery.propagation.follow`) and what it reaches
makes a candidate: parameters it is contracted against (``A -> B``, a chain),
or another source's factor met in one contraction (Q.K). A leaf whose blocks
are read apart (fused q|k|v columns) is split into units, one per block.
"""

from __future__ import annotations

import collections
import math
from typing import NamedTuple

import numpy as np

from saggs_jax._src.discovery import propagation
from saggs_jax._src.discovery.program import Program
from saggs_jax._src.discovery.tags import (
  NORM,
  Cut,
  Flow,
  Meet,
  Tag,
  Trace,
  Via,
  dot_out_axis,
  explain,
  inexact,
  tag,
)
from saggs_jax._src.plan import follower_axis

Stacked = int | tuple[int, ...]  # copy axes as Pair(stacked=...) takes them


def copy_axes(stacked: Stacked) -> tuple[int, ...]:
  """The leaf positions of the copy axes: ``n`` leading ones, or the positions given."""
  return tuple(range(stacked)) if isinstance(stacked, int) else tuple(stacked)


def as_stacked(copies) -> Stacked:
  """Copy axes at leaf positions ``copies`` as ``Pair(stacked=...)`` takes them: a count when
  they lead (``(0, 1)`` -> 2), else their positions (MaxText's layer axis at 1: ``(1,)``)."""
  copies = tuple(sorted(copies))
  return len(copies) if copies == tuple(range(len(copies))) else copies


def relative(axis: int, stacked: Stacked) -> int:
  """Leaf axis ``axis`` counted among the axes that are not copies (as ``Pair(axes=...)``)."""
  return axis - sum(c < axis for c in copy_axes(stacked))


class Part(NamedTuple):
  """The block ``[lo, hi)`` of a leaf's ``axis``; ``bounds``: every block's range on it. With
  a ``period``, the ranges are within each run of ``period`` entries (blocks interleaved)."""

  axis: int
  lo: int
  hi: int
  bounds: tuple[tuple[int, int], ...]
  period: int = 0  # 0: one run, the whole axis

  def index(self, n: int) -> tuple:
    """The block's index into a leaf whose ``axis`` has ``n`` entries: a slice, or the
    block's entries of every run in order (run by run: one head's q dims, the next head's)."""
    if not self.period:
      return (slice(None),) * self.axis + (slice(self.lo, self.hi),)
    runs = np.arange(0, n, self.period)[:, None]
    return (slice(None),) * self.axis + ((runs + np.arange(self.lo, self.hi)).ravel(),)

  def size(self, n: int) -> int:
    """The block's length along ``axis``, the leaf's being ``n``."""
    return (self.hi - self.lo) * (n // self.period if self.period else 1)


class Unit(NamedTuple):
  """What a factor sits on: a whole leaf (``part`` None) or one block of it."""

  leaf: int
  part: Part | None


class Start(NamedTuple):
  """Where a factor starts: leaf ``leaf`` used by eqn ``eqn`` (a linear map or a gain)."""

  leaf: int
  eqn: int
  out: int  # the value the factor first sits on
  tag: Tag
  stacked: Stacked  # the leaf axes that index copies (layers, experts), as Pair takes them
  channel: tuple[int, ...]  # the leaf axes the factor can sit on
  gain: bool  # an elementwise gain (a norm scale), not a linear map


class Source(NamedTuple):
  """A unit whose factor was followed."""

  unit: int
  eqn: int
  channel: tuple[int, ...]
  stacked: Stacked
  trace: Trace
  gain: bool  # an elementwise gain (a norm scale), not a linear map


class Candidate(NamedTuple):
  """One instance: ``(unit, absolute group axis)`` per member of each side."""

  name: str
  a: list[tuple[int, int]]
  b: list[tuple[int, int]]
  follow_a: list[tuple[int, int]]
  follow_b: list[tuple[int, int]]
  stacked: Stacked
  splits: frozenset[int]
  positive: bool

  @property
  def scaled(self) -> list[tuple[tuple[int, int], int]]:
    """Every member with the sign of its factor's exponent."""
    return [(m, +1) for m in self.a + self.follow_a] + [(m, -1) for m in self.b + self.follow_b]


class Rejection(NamedTuple):
  """A rescaling that is no exact symmetry, by unit labels."""

  a: list[str]
  b: list[str]
  reason: str


EXPERTS = "expert up/down"  # the name of an MLP pair with a factor per expert
OFFSET = inexact("a constant added to it first (a gain stored as w in 1 + w)")


def starts(prog: Program, flow: Flow) -> list[Start]:
  """Each leaf use a factor can start from: a ``dot_general`` operand (a linear map, or a gain
  where the leaf sits on batch dimensions only: ``einsum("...k,k->...k", y, scale)``), or a
  ``mul``'s (a gain). A gain read as ``w + constant`` (Gemma's ``1 + w``) starts inexact."""
  found = []
  for leaf, leaf_uses in flow.uses.items():
    for use in leaf_uses:
      eqn, view, k, reasons = prog.eqns[use.eqn], use.view, use.operand, frozenset()
      offset = _offset(prog, flow, use.eqn, k)
      if offset is not None:  # the gain is read through ``w + c``: start where it is applied
        e, k = offset
        eqn, reasons = prog.eqns[e], frozenset({OFFSET})
        use = use._replace(eqn=e)
      gain = eqn.prim == "mul" and len(eqn.ins) == 2
      if eqn.prim == "dot_general":
        dims = eqn.params["dimension_numbers"]
        (lc, rc), (lb, rb) = dims
        contract, batch = (lc, rc)[k], (lb, rb)[k]
        out = dot_out_axis(dims, [prog.shapes[i] for i in eqn.ins], k)
        amap = {out[a]: view.axes[a] for a in range(len(view.axes)) if a not in contract}
        gain = not contract and len(batch) == len(view.axes)  # elementwise: a gain
        stack = frozenset() if gain else frozenset().union(*(view.axes[a] for a in batch))
      elif gain:
        amap = {
          a: s
          for a, s in enumerate(view.axes)
          if prog.shapes[eqn.outs[0]][a] == prog.shapes[eqn.ins[k]][a]
        }
        stack = frozenset()
      else:
        continue
      channel = frozenset().union(*amap.values()) - stack
      rest = [a for a in range(len(prog.shapes[prog.leaf_ids[leaf]])) if a not in view.consumed]
      # batch axes (experts) are copies too: the leading axes that no scan sliced
      if not channel or sorted(stack) != rest[: len(stack)]:
        continue
      copies = stack | set(view.consumed)
      t = tag(amap, reasons)
      if t is not None:
        found.append(
          Start(leaf, use.eqn, eqn.outs[0], t, as_stacked(copies), tuple(sorted(channel)), gain)
        )
  return found


def _offset(prog: Program, flow: Flow, e: int, k: int) -> tuple[int, int] | None:
  """Where ``w + c`` (eqn ``e`` adds a constant ``c`` to its operand ``k``, a view of ``w``) is
  applied as a gain: ``(eqn, operand)`` of its one consumer, a ``mul`` or a ``dot_general``."""
  eqn = prog.eqns[e]
  if eqn.prim not in ("add", "sub") or flow.dep[eqn.ins[1 - k]]:
    return None
  if prog.shapes[eqn.outs[0]] != prog.shapes[eqn.ins[k]]:
    return None
  consumers = flow.consumers.get(eqn.outs[0], [])
  if len(consumers) != 1 or prog.eqns[consumers[0]].prim not in ("mul", "dot_general"):
    return None
  return consumers[0], prog.eqns[consumers[0]].ins.index(eqn.outs[0])


def group_options(sizes: list[int], splits: set[int]) -> list[int]:
  """Group counts to try, finest first: per index, per head (``splits``: the sizes a reshape
  split a channel axis into), per KV head (their common divisors), one group."""
  options = {n for n in sizes} | set(splits) | {1}
  options |= {math.gcd(a, b) for a in options for b in options}
  return sorted((g for g in options if all(n % g == 0 for n in sizes)), reverse=True)


class Analysis:
  """The jaxpr read once: candidate instances and static rejections, by unit index.

  Units ``0 .. n-1`` are the leaves, in order; a leaf that the program cuts into blocks (a
  fused QKV kernel's q, k and v columns) adds one unit per block.
  """

  def __init__(self, closed, names: list[str], shapes: list[tuple[int, ...]], floating: list[bool]):
    self.names, self.shapes = list(names), list(shapes)
    self.units = [Unit(leaf, None) for leaf in range(len(names))]
    self._blocks: dict[tuple[int, Part], int] = {}
    self.prog = Program(closed, len(names))
    self.flow = propagation.flow(self.prog)
    self.uses = self.flow.uses
    self.candidates: list[Candidate] = []
    self.rejected: list[Rejection] = []
    self.gated = collections.defaultdict(set)  # a GLU product -> the leaves whose factor it takes
    self.gates_of = collections.defaultdict(set)  # leaf -> the GLU products its factor takes
    meets = collections.defaultdict(list)
    summed = collections.defaultdict(list)  # eqn -> the sources whose sums meet there
    chains = collections.defaultdict(list)  # unit -> its sources that reach parameters
    for start in starts(self.prog, self.flow):
      if not floating[start.leaf]:
        continue
      for source in self._sources(start):
        trace = source.trace
        if len(trace.meets) == 1 and not trace.reaches and not trace.breaks:
          meets[trace.meets[0].eqn].append(source)
        elif trace.reaches and not trace.meets:
          chains[source.unit].append(source)
        elif len(trace.summed) == 1 and not trace.reaches and not trace.meets:
          summed[trace.summed[0].eqn].append(source)
        elif trace.lost and not trace.meets:  # what reaches a linear no longer carries it
          self._add(
            self.rejection(
              [source.unit],
              sorted({x.leaf for x in trace.lost}),
              explain(frozenset().union(*(x.reasons for x in trace.lost)), "between them"),
            )
          )
    for siblings in chains.values():
      for source in siblings:
        self._add(self._chain(source, siblings))
    # every use of a Q/K pair's leaves that meets exactly (a layer shared across depth)
    self._met = collections.defaultdict(set)
    for found in meets.values():
      for a, b in _combos(found, exact=True):
        self._met[a.unit, b.unit] |= {(a.unit, a.eqn), (b.unit, b.eqn)}
    for found in meets.values():
      for outcome in self._meeting(found):
        self._add(outcome)
    for found in summed.values():
      for outcome in self._sums(found):
        self._add(outcome)

  def _add(self, outcome: Candidate | Rejection | None):
    if isinstance(outcome, Candidate):
      if outcome not in self.candidates:  # a shared layer's uses propose it once each
        self.candidates.append(outcome)
    elif outcome is not None:
      self.rejected.append(outcome)

  def _follow(self, start: Start, keep: Cut | None = None) -> Trace:
    return propagation.follow(
      self.flow, start.eqn, start.out, start.tag, self.shapes[start.leaf], keep
    )

  def _sources(self, start: Start) -> list[Source]:
    """The source of ``start``'s leaf; or, where its blocks are read apart, one per block,
    the other blocks then values that do not scale."""
    leaf, gain = start.leaf, start.gain
    trace = self._follow(start)
    self.gates_of[leaf] |= trace.gates
    for g in trace.gates:
      self.gated[g].add(leaf)
    parts = _partition({c for c in trace.cuts if c.axis not in trace.joined}, self.shapes[leaf])
    whole = [Source(leaf, start.eqn, start.channel, start.stacked, trace, gain)]
    if parts is None:
      return whole
    # blocks are tried even where the whole leaf is exact: MLA's query meets the key whole,
    # and its non-rotary block meets the latent's non-rotary block per head
    axis, bounds, period = parts
    out = whole if _clean(trace) else []
    for lo, hi in bounds:
      part = Part(axis, lo, hi, bounds, period)
      out.append(
        Source(
          self._block(leaf, part),
          start.eqn,
          tuple(a for a in start.channel if a != axis or part.size(self.shapes[leaf][axis]) > 1),
          start.stacked,
          self._block_followers(self._follow(start, Cut(axis, lo, hi, period)), leaf, part),
          gain,
        )
      )
    return out

  def _block(self, leaf: int, part: Part) -> int:
    """The unit of ``leaf``'s block ``part``."""
    key = (leaf, part)
    if key not in self._blocks:
      self._blocks[key] = len(self.units)
      self.units.append(Unit(leaf, part))
      self.names.append(self.names[leaf])
      self.shapes.append(
        tuple(part.size(n) if a == part.axis else n for a, n in enumerate(self.shapes[leaf]))
      )
    return self._blocks[key]

  def _block_followers(self, trace: Trace, leaf: int, part: Part) -> Trace:
    """``trace`` with each follower (a fused bias) cut like its source (block ``part`` of
    ``leaf``): the same range of the follower axis that moves with the source's block axis."""
    followers = []
    for f in trace.followers:
      fa = min(f.amap[part.axis]) if len(f.amap.get(part.axis, ())) == 1 else None
      if fa is not None and self.shapes[f.leaf][fa] == self.shapes[leaf][part.axis]:
        f = f._replace(leaf=self._block(f.leaf, part._replace(axis=fa)))
      followers.append(f)
    return trace._replace(followers=tuple(followers))

  def label(self, unit: int) -> str:
    """The unit's name, with the block if it is one (for rejections)."""
    leaf, part = self.units[unit]
    if part is None:
      return self.names[leaf]
    every = f", interleaved every {part.period}" if part.period else ""
    return (
      f"{self.names[leaf]}[part {part.bounds.index((part.lo, part.hi))} of"
      f" {len(part.bounds)} on axis {part.axis}{every}]"
    )

  def rejection(self, a: list[int], b: list[int], reason: str) -> Rejection:
    return Rejection([self.label(x) for x in a], [self.label(x) for x in b], reason)

  def _followers(
    self, unit: int, axis: int, trace: Trace, stacked: Stacked
  ) -> list[tuple[int, int]]:
    """Each follower with the axis a Pair declares it on (see ``pairs.follower_axis``)."""
    return [
      (f.leaf, follower_axis(len(self.shapes[unit]), axis, len(self.shapes[f.leaf]), stacked))
      for f in trace.followers
    ]

  def _undeclarable(self, unit: int, axis: int, trace: Trace, stacked: Stacked) -> str | None:
    """Why a follower cannot be declared: it moves along another axis than the one a Pair
    gives it (a bias vector's, or its kernel's trailing axes)."""
    for f, (_, declared) in zip(trace.followers, self._followers(unit, axis, trace, stacked)):
      if declared not in f.amap.get(axis, ()):
        return (
          f"its bias {self.label(f.leaf)!r} follows axis {axis} of {self.label(unit)!r}"
          " along another axis than a Pair's follower: a bias vector's own, or its"
          " kernel's trailing axes"
        )
    return None

  def _tied(self, units_eqns: list[tuple[int, set[int]]]) -> str | None:
    for unit, eqns in units_eqns:
      if any(u.eqn not in eqns for u in self.uses[self.units[unit].leaf]):
        return (
          f"weight tying: {self.label(unit)!r} is also used elsewhere, so rescaling it"
          " changes another part of the model"
        )
    return None

  def _first_use(self, unit: int) -> int:
    return self.uses[self.units[unit].leaf][0].eqn

  def _chain(self, s: Source, siblings: list[Source]) -> Candidate | Rejection | None:
    """A source whose factor reaches parameters only: ``A -> B``. ``siblings``: every source
    of its unit; those that reach the same parameters exactly are one candidate (a layer
    shared across depth, ALBERT's, rescales every use at once), made by the first."""
    trace, unit = s.trace, s.unit
    targets = [r.leaf for r in trace.reaches]
    reasons = frozenset().union(*(r.reasons for r in trace.reaches))
    if NORM in reasons:
      return self.rejection(
        [unit],
        targets,
        (
          "a normalization between them makes what follows side a invariant to its scale,"
          " so nothing compensates a factor on side b"
        ),
      )
    if reasons:
      return self.rejection([unit], targets, explain(reasons, "between them"))
    if trace.breaks:
      return self.rejection(
        [unit],
        targets,
        "part of side a's output bypasses side b: " + "; ".join(sorted(trace.breaks)),
      )
    shared = [
      x for x in siblings if _clean(x.trace) and {r.leaf for r in x.trace.reaches} == set(targets)
    ]
    if s is not shared[0]:
      return None
    reach_eqns = {r.eqn for x in shared for r in x.trace.reaches}
    tied = self._tied(
      [(unit, {x.eqn for x in shared})]
      + [(t, reach_eqns) for t in targets]
      + [(f.leaf, {self._first_use(f.leaf)}) for f in trace.followers]
    )
    if tied:
      return self.rejection([unit], targets, tied)
    copies, channel = set(copy_axes(s.stacked)), list(s.channel)
    # a leading channel axis that meets the same axis of every B indexes copies (experts)
    while len(channel) > 1 and all(r.amap.get(channel[0]) == {channel[0]} for r in trace.reaches):
      if channel[0] != min(set(range(len(self.shapes[unit]))) - copies):
        break
      copies, channel = copies | {channel[0]}, channel[1:]
    stacked, axis = as_stacked(copies), channel[0]
    b_side = []
    for r in trace.reaches:
      theirs = frozenset(r.consumed).union(*(r.amap.get(k, frozenset()) for k in copies))
      if axis not in r.amap or theirs != copies:
        return None
      if (r.leaf, min(r.amap[axis])) not in b_side:  # a weight read twice is scaled once
        b_side.append((r.leaf, min(r.amap[axis])))
    if why := self._undeclarable(unit, axis, trace, stacked):
      return self.rejection([unit], targets, why)
    name = (
      "norm gain"
      if s.gain
      else next((via.value for via in Via if via in trace.through), "linear chain")
    )
    # an MLP with copies that no scan made is one per expert (after a GLU, the router's weights
    # are another activation's product too: the MLP, not attention, is what it is)
    scanned = min(len(u.view.consumed) for u in self.uses[self.units[unit].leaf])
    if not s.gain and {Via.GATE, Via.RELU} & trace.through and len(copies) > scanned:
      name = EXPERTS
    return Candidate(
      name,
      [(unit, axis)],
      b_side,
      self._followers(unit, axis, trace, stacked),
      [],
      stacked,
      trace.splits,
      any(r.positive for r in trace.reaches),
    )

  def _meeting(self, found: list[Source]) -> list[Candidate | Rejection]:
    """Pairs the sources that meet in one dot_general: exact pairs first, then the rest."""

    def meet(s: Source) -> Meet:
      return s.trace.meets[0]

    combos = _combos(found)
    exact = _combos(found, exact=True)
    paired = {id(s) for combo in exact for s in combo}
    out = []
    for a, b in exact + [(a, b) for a, b in combos if not {id(a), id(b)} & paired]:
      ma, mb, xa, xb = meet(a), meet(b), a.channel[0], b.channel[0]
      if a.unit == b.unit:
        out.append(
          self.rejection(
            [a.unit],
            [b.unit],
            "both sides read the same weight, which cannot carry a factor and its inverse at once",
          )
        )
      elif NORM in ma.reasons and NORM in mb.reasons:
        out.append(
          self.rejection(
            [a.unit],
            [b.unit],
            (
              "moot: each side is scale-invariant on its own (a normalization follows each,"
              " QK-norm), so the pair is exact but balancing it changes nothing that matters"
            ),
          )
        )
      elif ma.reasons | mb.reasons:
        out.append(
          self.rejection([a.unit], [b.unit], explain(ma.reasons | mb.reasons, "before they meet"))
        )
      else:
        met = self._met[a.unit, b.unit]
        tied = self._tied(
          [(u, {e for v, e in met if v == u}) for u in (a.unit, b.unit)]
          + [(f.leaf, {self._first_use(f.leaf)}) for f in a.trace.followers + b.trace.followers]
        )
        why = (
          tied
          or self._undeclarable(a.unit, xa, a.trace, a.stacked)
          or self._undeclarable(b.unit, xb, b.trace, b.stacked)
        )
        if why:
          out.append(self.rejection([a.unit], [b.unit], why))
          continue
        out.append(
          Candidate(
            "attention Q/K",
            [(a.unit, xa)],
            [(b.unit, xb)],
            self._followers(a.unit, xa, a.trace, a.stacked),
            self._followers(b.unit, xb, b.trace, b.stacked),
            a.stacked,
            a.trace.splits | b.trace.splits,
            ma.positive or mb.positive,
          )
        )
    return out

  def _sums(self, found: list[Source]) -> list[Candidate]:
    """Sources summed over their channels before they meet in one product, ``(Σ q)(Σ k)``:
    no per-channel factor survives a sum, one factor for the whole leaf does; the check finds
    which (``one group``), or refutes it."""
    sides = [[s for s in found if s.trace.summed[0].side == k] for k in (0, 1)]
    return [
      Candidate(
        SUMS,
        [(a.unit, a.channel[0])],
        [(b.unit, b.channel[0])],
        [],
        [],
        a.stacked,
        frozenset(),
        False,
      )
      for a in sides[0]
      for b in sides[1]
      if a.stacked == b.stacked and a.unit != b.unit
    ]


SUMS = "product of sums"


def _combos(found: list[Source], exact: bool = False) -> list[tuple[Source, Source]]:
  """The sources of each side of one dot_general that sit on the same contracted positions;
  ``exact``: only those that meet with no reason."""

  def meet(s: Source) -> Meet:
    return s.trace.meets[0]

  sides = [[s for s in found if meet(s).side == k] for k in (0, 1)]
  return [
    (a, b)
    for a in sides[0]
    for b in sides[1]
    if _contracted(meet(a)) == _contracted(meet(b))
    and a.stacked == b.stacked
    and not (exact and meet(a).reasons | meet(b).reasons)
  ]


def _clean(trace: Trace) -> bool:
  """Whether ``trace`` proposes a candidate as it is (else its blocks may)."""
  if trace.breaks:
    return False
  if len(trace.meets) == 1 and not trace.reaches:
    return not trace.meets[0].reasons
  return bool(trace.reaches) and not trace.meets and not any(r.reasons for r in trace.reaches)


def _partition(
  cuts: set[Cut], shape: tuple[int, ...]
) -> tuple[int, tuple[tuple[int, int], ...], int] | None:
  """``(axis, bounds, period)``: the parts the blocks in ``cuts`` split one leaf axis (or each
  of its runs of ``period``) into, gaps included as parts of their own; None unless they are
  disjoint blocks of one axis, with one period."""
  if len({(c.axis, c.period) for c in cuts}) != 1:
    return None
  axis, period = next(iter(cuts)).axis, next(iter(cuts)).period
  bounds, end, n = [], 0, period or shape[axis]
  for _, lo, hi, _ in sorted(cuts):
    if lo < end:
      return None
    bounds += [(end, lo)] * (lo > end) + [(lo, hi)]
    end = hi
  bounds += [(end, n)] * (n > end)
  return (axis, tuple(bounds), period) if len(bounds) > 1 else None


def _contracted(meet: Meet) -> tuple:
  """The contracted positions a factor sits on, and the block of them (a span) if one. A batch
  axis (heads) may carry it on one side only: one KV head read by every query head (MQA); the
  check then finds the grouping."""
  return tuple(x for x in meet.positions if x[0] == "c"), meet.span
