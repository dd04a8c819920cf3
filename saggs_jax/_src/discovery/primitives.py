"""The rule table: for every primitive, how it moves a factor's axes if it only moves
them, and its step, a function from the inputs' values (:mod:`.tags`) to the outputs'
values and what the factor met there (:func:`step` takes one equation). A primitive not
in :data:`RULES` is a nonlinearity.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from saggs_jax._src.discovery.program import Eqn
from saggs_jax._src.discovery.tags import (
  NORM,
  RESIDUAL,
  SIGN,
  UNLIKE,
  Cut,
  Flow,
  Follower,
  Lost,
  Meet,
  Reach,
  Reason,
  Shape,
  Sign,
  Tag,
  Taint,
  Trace,
  Value,
  Via,
  dot_out_axis,
  inexact,
  nonlinear,
  reshape_map,
  tag,
)

AxisMap = Callable[[Shape, Shape, dict], list[list[int]]]


def _same_axes(shape, out_shape, params) -> list[list[int]]:
  return [[a] for a in range(len(shape))]


def _transpose_axes(shape, out_shape, params) -> list[list[int]]:
  inv = {old: new for new, old in enumerate(params["permutation"])}
  return [[inv[a]] for a in range(len(shape))]


def _broadcast_axes(shape, out_shape, params) -> list[list[int]]:
  return [[d] for d in params["broadcast_dimensions"]]


def _reshape_axes(shape, out_shape, params) -> list[list[int]]:
  return reshape_map(shape, out_shape)[0]


def _squeeze_axes(shape, out_shape, params) -> list[list[int]]:
  kept = [a for a in range(len(shape)) if a not in params["dimensions"]]
  return [[kept.index(a)] if a in kept else [] for a in range(len(shape))]


def _expand_dims_axes(shape, out_shape, params) -> list[list[int]]:
  return [[o] for o in range(len(out_shape)) if o not in params["dimensions"]]


def _scan_slice_axes(shape, out_shape, params) -> list[list[int]]:
  return [[]] + [[a - 1] for a in range(1, len(shape))]


def _scan_stack_axes(shape, out_shape, params) -> list[list[int]]:
  return [[a + 1] for a in range(len(shape))]


def _stack_axes(shape, out_shape, params) -> list[list[int]]:
  """A new axis at ``params["axis"]`` (interleaved RoPE stacks its halves)."""
  return [[a + (a >= params["axis"])] for a in range(len(shape))]


def moved(
  eqn: Eqn, shapes: list[tuple[int, ...]], axes: tuple[frozenset[int], ...]
) -> list[frozenset[int]]:
  """``axes`` (per axis of structural ``eqn``'s first input) on its output's axes."""
  new = [frozenset() for _ in shapes[eqn.outs[0]]]
  axis_map = RULES[eqn.prim].axes
  assert axis_map is not None, eqn.prim
  for a, outs in enumerate(axis_map(shapes[eqn.ins[0]], shapes[eqn.outs[0]], eqn.params)):
    for o in outs:
      new[o] = new[o] | axes[a]
  return new


# ---------------------------------------------------------------------------
# Steps: one function per kind of primitive, from the inputs' values to the outputs'.


class Walk(NamedTuple):
  """What is fixed during one :func:`follow`."""

  flow: Flow
  shape: tuple[int, ...]  # the source leaf's
  keep: Cut | None  # follow only this block of the source leaf's factor


class Site(NamedTuple):
  """An eqn the factor arrived at, its inputs as the factor left them."""

  e: int  # the eqn's index
  eqn: Eqn
  values: list[Value | None]  # per input; None where the factor does not reach
  tags: list[Tag]
  reasons: frozenset[Reason]  # every input's reasons
  cut: Cut | None  # the block of the source leaf the tagged inputs come from, if one


Out = tuple[int, Value | None, Cut | None]  # value id, its value (None: unchanged), its block
Step = tuple[list[Out], Trace | None]  # the outputs' values, and what the factor met


def _first(x: Site, value: Value | None, note: Trace | None = None) -> Step:
  return [(x.eqn.outs[0], value, x.cut)], note


def _all(x: Site, value: Value) -> Step:
  return [(o, value, x.cut) for o in x.eqn.outs], None


def _other(walk: Walk, x: Site) -> Step:
  """Any other primitive: an elementwise nonlinearity keeps the channels, the rest loses them."""
  shapes, eqn, reasons = walk.flow.prog.shapes, x.eqn, x.reasons | {nonlinear(x.eqn.prim)}
  if len(eqn.ins) == 1 and len(eqn.outs) == 1 and shapes[eqn.outs[0]] == shapes[eqn.ins[0]]:
    return _first(x, Tag(x.tags[0].axes, reasons, x.tags[0].positive))
  return _all(x, Taint(reasons))


def _carry(
  walk: Walk, x: Site, reasons: frozenset[Reason], cuts: Sequence[Cut | None] | None = None
) -> list[Out]:
  """Axes move, the factor moves with them; with ``cuts`` (per output, a block of the source
  leaf or None), an output that cuts another block than :attr:`Walk.keep` does not scale."""
  t, eqn, keep, shapes = x.tags[0], x.eqn, walk.keep, walk.flow.prog.shapes
  amap = t.amap
  axes = tuple(amap.get(a, frozenset()) for a in range(len(shapes[eqn.ins[0]])))
  value = tag(dict(enumerate(moved(eqn, shapes, axes))), reasons, t.positive)
  if t.span is not None and value is not None:  # the block's entries stay where they were?
    a, lo, hi = t.span
    lands = RULES[eqn.prim].axes(shapes[eqn.ins[0]], shapes[eqn.outs[0]], eqn.params)[a]  # pyright: ignore[reportOptionalCall]
    if (
      len(lands) == 1
      and shapes[eqn.outs[0]][lands[0]] == shapes[eqn.ins[0]][a]
      and (eqn.prim not in ("rev", "pad"))
    ):
      value = value._replace(span=(lands[0], lo, hi))
    else:
      value = value._replace(reasons=value.reasons | {UNLIKE})
  return [
    (
      o,
      value if c is None or keep is None or c.axis != keep.axis or c == keep else None,
      c or x.cut,
    )
    for o, c in zip(eqn.outs, cuts or [None] * len(eqn.outs))
  ]


def _move(walk: Walk, x: Site) -> Step:
  return _carry(walk, x, x.reasons), None


def _identity(walk: Walk, x: Site) -> Step:
  """A value identity of any arity (``optimization_barrier``, ``device_put``): output ``k`` is
  input ``k``."""
  return [(o, v, x.cut) for o, v in zip(x.eqn.outs, x.values) if v is not None], None


def _concatenate(walk: Walk, x: Site) -> Step:
  """A concatenation of values that all scale alike scales like them; of one that scales with
  values the factor does not reach, it scales on that block of the axis only (a span)."""
  t, shapes, eqn = x.tags[0], walk.flow.prog.shapes, x.eqn
  tagged = [k for k, s in enumerate(x.values) if isinstance(s, Tag)]
  if eqn.prim == "concatenate" and len(tagged) == 1 and t.span is None:
    k = tagged[0]
    if all(s is None for j, s in enumerate(x.values) if j != k):
      dim = eqn.params["dimension"]
      lo = sum(shapes[i][dim] for i in eqn.ins[:k])
      [(o, value, cut)] = _carry(walk, x, x.reasons)
      if isinstance(value, Tag):
        value = value._replace(span=(dim, lo, lo + shapes[eqn.ins[k]][dim]))
      return [(o, value, cut)], None
  reasons = x.reasons
  if any(not isinstance(s, Tag) or s.axes != t.axes or s.span for s in x.values):
    reasons |= {UNLIKE}
  return _carry(walk, x, reasons), None


def _reshape(walk: Walk, x: Site) -> Step:
  """A reshape that splits a channel axis proposes groups (heads)."""
  shapes, amap = walk.flow.prog.shapes, x.tags[0].amap
  blocks = reshape_map(shapes[x.eqn.ins[0]], shapes[x.eqn.outs[0]])[1]
  splits = frozenset(
    math.prod(sizes[:k])
    for a, sizes in enumerate(blocks)
    if a in amap and len(sizes) > 1
    for k in range(1, len(sizes))
  )
  return _carry(walk, x, x.reasons), Trace(splits=splits) if splits else None


def _slice(walk: Walk, x: Site) -> Step:
  """A slice or split: an output that is one block of a leaf axis is a :class:`Cut`. A block
  of every run (a head's first ``r`` dims, which partial RoPE rotates) proposes groups finer
  than a run: as many as the largest groups whose bounds its bounds fall on."""
  cuts = _cuts(walk, x.eqn, x.tags[0])
  found = frozenset(c for c in cuts if c is not None)
  finer = frozenset(walk.shape[c.axis] // math.gcd(c.lo, c.hi, c.period) for c in found if c.period)
  return _carry(walk, x, x.reasons, cuts), Trace(cuts=found, splits=finer) if found else None


def _cuts(walk: Walk, eqn: Eqn, t: Tag) -> list[Cut | None]:
  """Per output of a slice or split, the block it takes of the source leaf, or None. A block
  is a contiguous range of an axis that holds one leaf axis, whole or as one of the axes a
  reshape split it into (heads, then q|k|v, then head dims): the range of every run of the
  axes it and those after it span, the axes taken to keep the leaf's order (a wrong block is
  only a wrong candidate, which the numbers refute)."""
  shape, p = walk.flow.prog.shapes[eqn.ins[0]], eqn.params
  if eqn.prim == "split":
    axis, bounds = p["axis"], np.cumsum([0] + list(p["sizes"]))
    ranges = list(itertools.pairwise(bounds))
  else:
    strided = [a for a, s in enumerate(p["strides"] or ()) if s != 1]
    narrowed = [
      a
      for a, (lo, hi) in enumerate(zip(p["start_indices"], p["limit_indices"]))
      if hi - lo < shape[a]
    ]
    if len(narrowed) != 1 or strided:
      return [None]
    axis = narrowed[0]
    ranges = [(p["start_indices"][axis], p["limit_indices"][axis])]
  amap = t.amap
  leaf_axes = amap.get(axis, frozenset())
  if len(leaf_axes) != 1:
    return [None] * len(ranges)
  (la,) = leaf_axes
  holders = sorted(a for a, s in amap.items() if la in s)
  if (
    any(len(amap[a]) > 1 for a in holders) or math.prod(shape[a] for a in holders) != walk.shape[la]
  ):
    return [None] * len(ranges)
  inner = math.prod(shape[a] for a in holders if a > axis)
  period = shape[axis] * inner
  period = 0 if period == walk.shape[la] else period
  return [Cut(la, int(lo) * inner, int(hi) * inner, period) for lo, hi in ranges]


def _operands(x: Site) -> tuple[bool, Tag, Value | None, int]:
  """A binary eqn's first tagged operand: whether it is the second, its tag; the other
  operand's value and id."""
  second = not isinstance(x.values[0], Tag)
  return second, x.tags[0], x.values[1 - second], x.eqn.ins[1 - second]


def _add(walk: Walk, x: Site) -> Step:
  """A sum keeps the factor if the other term scales alike, is zero or is a follower."""
  _, t, other, i = _operands(x)
  reasons, positive, note = x.reasons, t.positive, None
  if isinstance(other, Tag):
    if other.axes != t.axes:
      reasons |= {inexact("a sum of values scaled along different axes")}
    positive = t.positive or other.positive
  elif isinstance(other, Sign):
    reasons |= {inexact("a sum with its own sign test")}
    positive = True
  elif other is None and i not in walk.flow.zeros:
    follower = _follower(walk.flow, i, t, walk.flow.prog.shapes[x.eqn.outs[0]])
    if follower is not None:
      note = Trace(followers=(follower,))
    elif not walk.flow.dep[i]:
      reasons |= {inexact("an added constant")}
    elif i in walk.flow.views:  # a bias broadcast over the channels (or along another axis)
      reasons |= {inexact("an added parameter that does not follow it channel by channel")}
    elif not reasons:  # an exact factor is lost here; an inexact one is reported as such
      return [], Trace(breaks=frozenset({RESIDUAL}))
  return _first(x, Tag(t.axes, reasons, positive), note)


def _follower(flow: Flow, i: int, t: Tag, shape: Shape) -> Follower | None:
  """Value ``i`` as a follower of ``t``: a view of a leaf whose axes are ``t``'s channels."""
  view = flow.views.get(i)
  if view is None:
    return None
  amap, leaf = {}, flow.prog.shapes[flow.prog.leaf_ids[view.leaf]]
  for a, src in t.amap.items():  # a bias follows along its own axis, not broadcast over it
    if (
      a >= len(view.axes)
      or not view.axes[a]
      or (a not in view.gathered and math.prod(leaf[x] for x in view.axes[a]) != shape[a])
    ):
      return None
    for s in src:
      amap[s] = view.axes[a]
  return Follower(view.leaf, amap, view.consumed)


def _product(walk: Walk, x: Site) -> Step:
  """mul, div: a product with what does not depend on the factor keeps it."""
  second, t, other, i = _operands(x)
  reasons, positive, note = x.reasons, t.positive, None
  if isinstance(other, Tag):
    reasons |= {inexact(f"{x.eqn.prim} of two values that both scale with it (degree 2)")}
    positive = t.positive or other.positive
  elif isinstance(other, Sign):  # x * (x > 0): ReLU written as a mask
    positive = True
  elif isinstance(other, Taint):  # its reasons (a normalization, say) are in ``reasons``
    pass
  elif x.eqn.prim == "div" and second:
    reasons |= {inexact("a division by it")}
  elif walk.flow.dep[i] and i not in walk.flow.views:  # a product with another activation
    note = Trace(through=frozenset({Via.GATE}), gates=frozenset({x.eqn.outs[0]}))
  return _first(x, t._replace(reasons=reasons, positive=positive), note)


def _relu(walk: Walk, x: Site) -> Step:
  """``max(x, 0)``, ``min(x, 0)`` keep a positive factor; ``x > 0`` is a :data:`SIGN`."""
  k = next(k for k, s in enumerate(x.values) if isinstance(s, Tag))
  if len(x.tags) != 1 or x.eqn.ins[1 - k] not in walk.flow.zeros:
    return _other(walk, x)
  value = x.tags[0]._replace(positive=True) if x.eqn.prim in ("max", "min") else SIGN
  return _first(x, value, Trace(through=frozenset({Via.RELU})))


def _abs(walk: Walk, x: Site) -> Step:
  return _first(x, x.tags[0]._replace(positive=True))


def _reduce(walk: Walk, x: Site, homogeneous: bool, linear: bool) -> Step:
  """A reduction over a channel is a normalization's statistic; over other axes, a sum
  (``linear``) keeps the factor, ``max``/``min`` keep a positive one (``homogeneous``), the
  rest (``prod``, ``argmax``) neither."""
  t, axes = x.tags[0], set(x.eqn.params["axes"])
  if axes & set(t.amap):
    return _all(x, Taint(x.reasons | {NORM}))
  kept = [a for a in range(len(walk.flow.prog.shapes[x.eqn.ins[0]])) if a not in axes]
  amap = {kept.index(a): s for a, s in t.amap.items()}
  reasons = x.reasons if homogeneous else x.reasons | {nonlinear(x.eqn.prim)}
  return _first(x, tag(amap, reasons, t.positive or not linear))


def _dot(walk: Walk, x: Site) -> Step:
  """A contraction over the channel: against a parameter it reaches it, against an activation
  the factors meet, against a constant the channels mix; a free channel axis carries on."""
  flow, eqn, reasons = walk.flow, x.eqn, x.reasons
  dims = eqn.params["dimension_numbers"]
  (lc, rc), (lb, rb) = dims
  if all(isinstance(s, Tag) for s in x.values):
    return _all(x, Taint(reasons | {inexact("a product of two values that both scale with it")}))
  side = 0 if isinstance(x.values[0], Tag) else 1
  t, other, amap = x.tags[0], eqn.ins[1 - side], x.tags[0].amap
  contract, batch = (lc, rc)[side], (lb, rb)[side]
  out = dot_out_axis(dims, [flow.prog.shapes[i] for i in eqn.ins], side)
  span, out_span = None, None  # a block of a contracted axis; of a kept one, where it lands
  if t.span is not None:
    a, lo, hi = t.span
    if a in contract and a in amap and flow.dep[other] and other not in flow.views:
      span = (contract.index(a), lo, hi)  # it meets a block alike, or nothing pairs it
    elif a in contract or (set(contract) & set(amap) and flow.dep[other]):
      reasons |= {UNLIKE}  # summed with entries that do not scale; or a reach or a meet that
      # would compensate the factor on every entry of an axis it holds on a block only
    else:
      out_span = (out[a], lo, hi)
  if set(contract) & set(amap):
    view = flow.views.get(other)
    ocontract, obatch = (lc, rc)[1 - side], (lb, rb)[1 - side]
    if view is not None:
      reached: dict[int, frozenset[int]] = {}
      for mine, theirs in zip(list(contract) + list(batch), list(ocontract) + list(obatch)):
        for s in amap.get(mine, ()):
          reached[s] = reached.get(s, frozenset()) | view.axes[theirs]
      return [], Trace(
        reaches=(Reach(view.leaf, reached, view.consumed, x.e, reasons, t.positive),)
      )
    if flow.dep[other]:
      positions = tuple(
        sorted(
          [("c", k) for k, a in enumerate(contract) if a in amap]
          + [("b", k) for k, a in enumerate(batch) if a in amap]
        )
      )
      return [], Trace(meets=(Meet(x.e, side, positions, reasons, t.positive, span),))
    # a constant mixes the contracted channels (RoPE as a matmul): the rest stay
    rest = tag({out[a]: s for a, s in amap.items() if a not in contract}, reasons, t.positive)
    rest = rest and rest._replace(span=out_span)
    return _first(x, rest or Taint(reasons | {inexact("a contraction with a constant")}))
  note = (
    Trace(through=frozenset({Via.ATTENTION}))
    if flow.dep[other] and other not in flow.views
    else None
  )
  value = tag({out[a]: s for a, s in amap.items()}, reasons, t.positive)
  return _first(x, value and value._replace(span=out_span), note)


def _select(walk: Walk, x: Site) -> Step:
  """``jnp.where``, a ``cond``: every case must scale alike (or be zero)."""
  reasons, t, (which, *cases) = x.reasons, x.tags[0], x.values
  if isinstance(which, (Tag, Taint)):
    reasons |= {inexact("a choice that depends on it")}
  if any(
    i not in walk.flow.zeros and (not isinstance(s, Tag) or s.axes != t.axes)
    for s, i in zip(cases, x.eqn.ins[1:])
  ):
    reasons |= {inexact("a choice between values that do not scale alike")}
  return _first(x, Tag(t.axes, reasons, any(s.positive for s in x.tags) or isinstance(which, Sign)))


# ---------------------------------------------------------------------------
# The rule table.


class Rule(NamedTuple):
  """How a primitive acts on a per-channel factor.

  Attributes:
    step: the outputs' values and what the factor met, from the inputs' values.
    axes: for a primitive that only moves axes around (it carries leaf views, zeros and
      factors, mixing no channels): per axis of its first input, the output axes it lands
      on, from ``(input shape, output shape, params)``; None for any other.
    joins: it brings values together (a sum, a concatenation, a choice): two blocks of one
      leaf meeting here are one channel after all (the halves of rotate-half RoPE).
    additive: a sum, through which a head's output passes (a bias).
    views: a view of a leaf through it is still a view (an axis move, not a split).
    identity: output ``k`` is input ``k``, whatever the arity (a value identity).
  """

  step: Callable[[Walk, Site], Step]
  axes: AxisMap | None = None
  joins: bool = False
  additive: bool = False
  views: bool = True
  identity: bool = False


def _mover(
  axes: AxisMap = _same_axes, step: Callable[[Walk, Site], Step] = _move, **kwargs
) -> Rule:
  return Rule(step, axes, **kwargs)


_SUM = Rule(_add, joins=True, additive=True)
_RELU = Rule(_relu)
# Primitives that return their operands' values unchanged: remat names (``checkpoint_name``,
# which MaxText and EasyDeL wrap around every projection), barriers, copies, placement and
# sharding annotations, ``stop_gradient`` (the function's values are what a symmetry keeps).
IDENTITIES = (
  "name",
  "optimization_barrier",
  "copy",
  "copy_p",
  "device_put",
  "sharding_constraint",
  "mesh_cast",
  "reshard",
  "pvary",
  "stop_gradient",
)
RULES: dict[str, Rule] = {
  **{p: Rule(_identity, _same_axes, identity=True) for p in IDENTITIES},
  **{
    p: _mover()
    for p in (
      "convert_element_type",
      "reduce_precision",
      "neg",
      "rev",
      "pad",
      "dynamic_slice",
      "real",
    )
  },
  "transpose": _mover(_transpose_axes),
  "broadcast_in_dim": _mover(_broadcast_axes),
  "reshape": _mover(_reshape_axes, _reshape),
  "squeeze": _mover(_squeeze_axes),
  "expand_dims": _mover(_expand_dims_axes),
  "scan_slice": _mover(_scan_slice_axes),
  "scan_stack": _mover(_scan_stack_axes),
  "slice": _mover(step=_slice),
  "split": _mover(step=_slice, views=False),
  "concatenate": _mover(step=_concatenate, joins=True),
  "stack": _mover(_stack_axes, _concatenate, joins=True),
  "add": _SUM,
  "sub": _SUM,
  "add_any": _SUM,
  "mul": Rule(_product),
  "div": Rule(_product),
  **{p: _RELU for p in ("max", "min", "ge", "gt", "le", "lt")},
  "abs": Rule(_abs),
  "reduce_sum": Rule(functools.partial(_reduce, homogeneous=True, linear=True)),
  **{
    p: Rule(functools.partial(_reduce, homogeneous=True, linear=False))
    for p in ("reduce_max", "reduce_min")
  },
  **{
    p: Rule(functools.partial(_reduce, homogeneous=False, linear=False))
    for p in ("reduce_prod", "argmax", "argmin")
  },
  "dot_general": Rule(_dot),
  "select_n": Rule(_select, joins=True),
}
_OTHER = Rule(_other)
# Steps that keep a Tag's span (with the axis movers, which move it): any other primitive
# makes a spanned value inexact first, whatever it does.
_SPANS = frozenset({"mul", "div", "dot_general"})


def rule_of(prim: str) -> Rule:
  """``prim``'s rule; a primitive not in :data:`RULES` is a nonlinearity."""
  return RULES.get(prim, _OTHER)


def _in_place(walk: Walk, eqn: Eqn, st: list, cut_of: dict[int, Cut | None]) -> bool:
  """A concatenation that puts the blocks of a leaf axis back where they were (MLA's query:
  its non-rotary block, then its rotary one): side by side, not one channel. Blocks put
  elsewhere (``concat([-x2, x1])``, rotate-half RoPE as MaxText writes it) are joined."""
  if eqn.prim != "concatenate":
    return False
  shapes, dim, offset = walk.flow.prog.shapes, eqn.params["dimension"], 0
  for i, s in zip(eqn.ins, st):
    size, cut = shapes[i][dim], cut_of.get(i)
    if isinstance(s, Tag) and (
      cut is None or cut.period or (cut.lo, cut.hi) != (offset, offset + size)
    ):
      return False
    offset += size
  return offset == walk.shape[next(c for c in map(cut_of.get, eqn.ins) if c).axis]


def step(walk: Walk, e: int, values: dict[int, Value], cut_of: dict[int, Cut | None]) -> Step:
  """Eqn ``e`` on the inputs' ``values``: the outputs' values, and what the factor met."""
  eqn = walk.flow.prog.eqns[e]
  rule = rule_of(eqn.prim)
  st = [values.get(i) for i in eqn.ins]
  if not (rule.identity or rule.axes is not None or eqn.prim in _SPANS):  # a block is lost
    st = [
      Tag(s.axes, s.reasons | {UNLIKE}, s.positive) if isinstance(s, Tag) and s.span else s
      for s in st
    ]
  tags = [s for s in st if isinstance(s, Tag)]
  taints = [s for s in st if isinstance(s, Taint)]
  reasons = frozenset().union(*(s.reasons for s in tags + taints))
  cuts = {cut_of[i] for i, s in zip(eqn.ins, st) if isinstance(s, Tag)}
  joined = (
    frozenset(c.axis for c in cuts if c)
    if len(cuts) > 1 and rule.joins and not _in_place(walk, eqn, st, cut_of)
    else None
  )
  x = Site(e, eqn, st, tags, reasons, cuts.pop() if len(cuts) == 1 else None)
  if tags or rule.identity:
    outs, note = rule.step(walk, x)
  else:
    note = None
    if eqn.prim == "dot_general" and taints:  # a linear reads what the factor became: say why
      note = Trace(
        lost=tuple(Lost(walk.flow.views[i].leaf, reasons) for i in eqn.ins if i in walk.flow.views)
      )
    if eqn.prim in ("dot_general", "mul") and len(taints) == 1 and len(eqn.ins) == 2:
      side = 0 if isinstance(st[0], Taint) else 1
      other = eqn.ins[1 - side]
      if walk.flow.dep[other] and other not in walk.flow.views:  # (Σ q)(Σ k)
        note = Trace(summed=(Meet(e, side, (), reasons, False),))
    outs, _ = _all(x, Taint(reasons) if taints else SIGN)
  if joined:  # one channel after all (RoPE halves)
    note = Trace.merge([note or Trace(), Trace(joined=joined)])
  return outs, note
