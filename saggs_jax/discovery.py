"""Finding a model's exact rescaling symmetries from its jaxpr.

:func:`discover` reads ``jax.make_jaxpr(apply_fn)(params, *inputs)`` and
follows, for every parameter used as a linear map (a ``dot_general`` operand)
or as an elementwise gain, how a per-channel factor ``c`` on that parameter
travels through the program:

* reshapes, transposes, broadcasts, slices, stacks and concatenations carry
  the channel axes (a reshape that splits a channel axis proposes head groups);
* a slice or split that cuts a whole leaf axis into blocks (GPT-2's fused
  q|k|v columns, gemma's K and V on a leading axis of 2) makes each block a
  source of its own (a :class:`~saggs_jax.Block`), the other blocks then
  values that do not scale; blocks that are added back together (the halves
  of rotate-half RoPE) stay one channel;
* multiplying by a value that does not depend on the parameter (a constant,
  RoPE's cos/sin, a SwiGLU gate, attention probabilities, a dropout mask) keeps
  ``c``; ``max(x, 0)``, ``min(x, 0)`` and a choice on the sign of ``x`` keep
  positive ``c`` (ReLU, leaky ReLU), a clip at any other constant does not
  (ReLU6); ``jnp.where`` and ``lax.cond`` keep ``c`` when every case scales
  alike or is zero;
* adding a bias keeps ``c`` if the bias is scaled along (a follower: a bias
  vector of the channel axis, or a tensor sharing it as a trailing axis);
  adding zero changes nothing; adding anything else loses it (the residual
  stream) or makes it inexact (a constant, a bias broadcast over the channels);
* a nonlinearity (``exp``, ``tanh``, ``logistic``, ``erf``, ...) or a
  reduction over the channel (a normalisation) breaks it, and the reason is
  kept for the report;
* a ``dot_general`` contracting the channel against another parameter (B)
  cancels ``c`` when B is scaled by ``1/c`` along the contracted axis: a
  candidate ``A -> B`` (V/O, up/down, a norm gain against the rows of every
  linear that reads it);
* a ``dot_general`` contracting the channel against another parameter's
  channel (Q.K) cancels it when that parameter is scaled by ``1/c``; a head
  axis may carry the factor on one side only (one KV head read by every
  query head, MQA), and the check then finds the grouping.

Every candidate is then confirmed numerically: all its instances (every layer)
get random factors at once and the outputs must agree to ``rtol`` (float32,
full-precision matmuls); the finest exact grouping wins. The check runs where
every path is live: all-zero leaves (a zero-initialised output projection)
are drawn at random first, and a candidate counts as confirmed only if the
check could have failed: a finer grouping failed, or side a rescaled alone
moves the outputs past the tolerance. Nothing unconfirmed is returned; what
could not be tested is rejected as unconfirmed, and a factor that reaches
another parameter but is no longer exact there (whatever made it so, an
unknown primitive included) is rejected with the reason. Declarations use path
patterns relative to each instance's enclosing module, so one
:class:`~saggs_jax.Pair` covers every layer.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import heapq
import math
import re
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from saggs_jax import paths
from saggs_jax.diagnostics import Probe
from saggs_jax.pairs import Block, Pair, follower_axis

NORM = "a normalization over its channels"
_SUB_JAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# Ops that move axes around without mixing channels: they carry leaf views and factors.
_STRUCTURAL = frozenset({
    "convert_element_type", "copy", "copy_p", "reduce_precision", "neg", "transpose",
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "slice", "rev", "pad",
    "dynamic_slice", "scan_slice", "scan_stack", "split", "concatenate", "stack",
    "optimization_barrier",
    "sharding_constraint", "real"})
_ADD = frozenset({"add", "sub", "add_any"})
_REDUCE = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"})
_POSITIVE_REDUCE = frozenset({"reduce_sum", "reduce_max", "reduce_min"})


# ---------------------------------------------------------------------------
# The program: one flat list of equations, sub-jaxprs inlined.

@dataclasses.dataclass
class _Eqn:
  prim: str
  ins: list  # value ids
  outs: list
  params: dict


class _Program:
  """A jaxpr flattened: pjit, custom_jvp/vjp, remat and calls inlined; one scan iteration."""

  def __init__(self, closed: jcore.ClosedJaxpr, num_leaves: int):
    self.eqns: list[_Eqn] = []
    self.shapes: list[tuple[int, ...]] = []
    self.zeros: set[int] = set()  # values known to be all zeros (literals, broadcasts of them)
    ids = [self._new(v.aval.shape) for v in closed.jaxpr.invars]
    self.leaf_ids, self.input_ids = ids[:num_leaves], ids[num_leaves:]
    self.outputs = set(self._inline(closed.jaxpr, ids, closed.consts))

  def _new(self, shape) -> int:
    self.shapes.append(tuple(shape))
    return len(self.shapes) - 1

  def _emit(self, prim, ins, out_shapes, params) -> list[int]:
    outs = [self._new(s) for s in out_shapes]
    self.eqns.append(_Eqn(prim, ins, outs, params))
    if prim in _STRUCTURAL and all(i in self.zeros for i in ins):
      self.zeros.update(outs)
    return outs

  def _const(self, var, value=None) -> int:
    """A literal or a closed-over constant: it depends on nothing."""
    i = self._new(var.aval.shape)
    dtype = getattr(value, "dtype", None)
    dtype = np.result_type(value) if dtype is None and isinstance(value, (int, float)) else dtype
    if dtype is not None and jnp.issubdtype(dtype, jnp.number) and not np.any(value):
      self.zeros.add(i)
    return i

  def _inline(self, jaxpr: jcore.Jaxpr, in_ids: list, consts=()) -> list:
    env = dict(zip(jaxpr.invars, in_ids))
    for k, v in enumerate(jaxpr.constvars):
      env[v] = self._const(v, consts[k] if k < len(consts) else None)

    def read(x):
      return self._const(x, x.val) if isinstance(x, jcore.Literal) else env[x]

    for eqn in jaxpr.eqns:
      ins = [read(x) for x in eqn.invars]
      name = eqn.primitive.name
      sub = next((eqn.params[k] for k in _SUB_JAXPR_PARAMS if k in eqn.params), None)
      consts = ()
      if isinstance(sub, jcore.ClosedJaxpr):
        sub, consts = sub.jaxpr, sub.consts
      if name == "scan":
        outs = self._scan(eqn, ins)
      elif name == "cond":
        outs = self._cond(eqn, ins)
      elif isinstance(sub, jcore.Jaxpr) and len(sub.invars) == len(ins):
        outs = self._inline(sub, ins, consts)
      else:
        outs = self._emit(name, ins, [v.aval.shape for v in eqn.outvars], eqn.params)
      env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]

  def _scan(self, eqn, ins) -> list:
    """One iteration: per-step slices of ``xs`` in, stacked ``ys`` out."""
    body, nc, ncarry = eqn.params["jaxpr"], eqn.params["num_consts"], eqn.params["num_carry"]
    xs = [None if i is None else self._emit("scan_slice", [i], [self.shapes[i][1:]], {})[0]
          for i in ins[nc + ncarry:]]
    outs = self._inline(body.jaxpr, ins[:nc + ncarry] + xs, body.consts)
    ys = [None if o is None else self._emit("scan_stack", [o], [v.aval.shape], {})[0]
          for o, v in zip(outs[ncarry:], eqn.outvars[ncarry:])]
    return outs[:ncarry] + ys

  def _cond(self, eqn, ins) -> list:
    """Every branch inlined on the operands, their outputs chosen by ``select_n`` on the index."""
    outs = [self._inline(b.jaxpr, ins[1:], b.consts) for b in eqn.params["branches"]]
    return [self._emit("select_n", [ins[0], *cases], [v.aval.shape], {})[0]
            for cases, v in zip(zip(*outs), eqn.outvars)]


def _reshape_map(old, new) -> tuple[list[list[int]], list[list[int]]]:
  """For each old axis the new axes of its block, and each block's new sizes."""
  out, sizes = [[] for _ in old], [[] for _ in old]
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


def _axis_map(prog: _Program, eqn: _Eqn, k: int) -> list[list[int]]:
  """For structural ``eqn``, the output axes each axis of input ``k`` lands on."""
  shape, p = prog.shapes[eqn.ins[k]], eqn.params
  n = len(shape)
  if eqn.prim == "transpose":
    inv = {old: new for new, old in enumerate(p["permutation"])}
    return [[inv[a]] for a in range(n)]
  if eqn.prim == "broadcast_in_dim":
    return [[d] for d in p["broadcast_dimensions"]]
  if eqn.prim == "reshape":
    return _reshape_map(shape, prog.shapes[eqn.outs[0]])[0]
  if eqn.prim == "squeeze":
    kept = [a for a in range(n) if a not in p["dimensions"]]
    return [[kept.index(a)] if a in kept else [] for a in range(n)]
  if eqn.prim == "expand_dims":
    out = [a for a in range(len(prog.shapes[eqn.outs[0]])) if a not in p["dimensions"]]
    return [[o] for o in out]
  if eqn.prim == "scan_slice":
    return [[]] + [[a - 1] for a in range(1, n)]
  if eqn.prim == "scan_stack":
    return [[a + 1] for a in range(n)]
  if eqn.prim == "stack":  # a new axis at p["axis"]: interleaved RoPE stacks its halves
    return [[a + (a >= p["axis"])] for a in range(n)]
  return [[a] for a in range(n)]


def _dot_out_axis(dims, shapes, side: int) -> dict[int, int]:
  """Output position of every batch or free axis of operand ``side`` of a dot_general."""
  (lc, rc), (lb, rb) = dims
  contract, batch = (lc, rc), (lb, rb)
  free = [[a for a in range(len(s)) if a not in contract[i] and a not in batch[i]]
          for i, s in enumerate(shapes)]
  out = {a: i for i, a in enumerate(batch[side])}
  offset = len(batch[0]) + (len(free[0]) if side else 0)
  out.update({a: offset + i for i, a in enumerate(free[side])})
  return out


# ---------------------------------------------------------------------------
# Leaf views and uses.

class _View(NamedTuple):
  leaf: int
  axes: tuple[frozenset, ...]  # per axis of the value: the leaf axes it holds
  consumed: int  # leading leaf axes sliced off by scans


class _Use(NamedTuple):
  eqn: int
  operand: int
  view: _View


def _views(prog: _Program, shapes: list) -> tuple[dict, dict, list[bool]]:
  """Values that are views of one leaf, each leaf's uses, and which values depend on leaves."""
  views = {i: _View(n, tuple(frozenset([a]) for a in range(len(shapes[n]))), 0)
           for n, i in enumerate(prog.leaf_ids)}
  dep = [False] * len(prog.shapes)
  for i in prog.leaf_ids:
    dep[i] = True
  uses = collections.defaultdict(list)
  for e, eqn in enumerate(prog.eqns):
    for o in eqn.outs:
      dep[o] = any(i is not None and dep[i] for i in eqn.ins)
    src = [(k, views[i]) for k, i in enumerate(eqn.ins) if i in views]
    if len(eqn.ins) == 1 and src and eqn.prim in _STRUCTURAL and eqn.prim not in ("split",):
      view = src[0][1]
      new = [frozenset() for _ in prog.shapes[eqn.outs[0]]]
      for a, outs in enumerate(_axis_map(prog, eqn, 0)):
        for o in outs:
          new[o] = new[o] | view.axes[a]
      consumed = view.consumed + (eqn.prim == "scan_slice")
      views[eqn.outs[0]] = _View(view.leaf, tuple(new), consumed)
      continue
    for k, view in src:
      uses[view.leaf].append(_Use(e, k, view))
  return views, uses, dep


# ---------------------------------------------------------------------------
# Following one factor through the program.

@dataclasses.dataclass(frozen=True)
class _Tag:
  """A value scaled per channel: value axis -> source leaf axes; why it is no longer exact."""
  axes: tuple[tuple[int, frozenset], ...]
  reasons: frozenset = frozenset()
  positive: bool = False

  @property
  def amap(self) -> dict[int, frozenset]:
    return dict(self.axes)


@dataclasses.dataclass(frozen=True)
class _Taint:
  """A value changed by the factor without a channel axis (a norm statistic, say)."""
  reasons: frozenset


class _Sign:
  """A comparison of the factor's value with zero: unchanged by a positive factor."""


def _tag(amap: dict, reasons=frozenset(), positive=False) -> _Tag | None:
  axes = tuple(sorted((a, s) for a, s in amap.items() if s))
  return _Tag(axes, frozenset(reasons), positive) if axes else None


class _Reach(NamedTuple):
  leaf: int
  amap: dict  # source leaf axis -> leaf axes of the reached parameter
  consumed: int  # its leading axes sliced off by scans
  eqn: int
  reasons: frozenset
  positive: bool


class _Meet(NamedTuple):
  eqn: int
  side: int
  positions: tuple  # (kind, k) of the dot_general dimension numbers the factor sits on
  reasons: frozenset
  positive: bool


@dataclasses.dataclass
class _Trace:
  reaches: list = dataclasses.field(default_factory=list)
  meets: list = dataclasses.field(default_factory=list)
  followers: list = dataclasses.field(default_factory=list)  # (leaf, {source axis: leaf axes})
  breaks: set = dataclasses.field(default_factory=set)
  lost: list = dataclasses.field(default_factory=list)  # (leaf, reasons): lost before a linear
  gates: set = dataclasses.field(default_factory=set)  # the GLU products it went through
  splits: set = dataclasses.field(default_factory=set)
  through: set = dataclasses.field(default_factory=set)  # what the factor went through
  cuts: set = dataclasses.field(default_factory=set)  # (leaf axis, start, stop): blocks read
  joined: set = dataclasses.field(default_factory=set)  # leaf axes whose blocks add up again


class _Follower:
  """Propagates one source's factor forward in program order."""

  def __init__(self, prog, views, dep, consumers):
    self.prog, self.views, self.dep, self.consumers = prog, views, dep, consumers

  def run(self, start: int, out: int, tag: _Tag, shape: tuple, keep=None) -> _Trace:
    """Follows ``tag`` on ``out``, the output of eqn ``start`` using a leaf of ``shape``;
    with ``keep = (leaf axis, start, stop)``, only that block of the leaf's factor: the
    other blocks cut from it (``trace.cuts``) go on as values that do not scale."""
    self.trace, self.state, self.heap, self.seen = _Trace(), {}, [], {start}
    self.shape, self.keep, self.cut_of, self.cut = shape, keep, {}, None
    self._set(out, tag)
    while self.heap:
      e = heapq.heappop(self.heap)
      self._step(e, self.prog.eqns[e])
    return self.trace

  def _set(self, i, value):
    if value is None:
      return
    self.state[i], self.cut_of[i] = value, self.cut
    if i in self.prog.outputs:
      self.trace.breaks.add("it reaches the model's output directly")
    for e in self.consumers.get(i, ()):
      if e not in self.seen:
        self.seen.add(e)
        heapq.heappush(self.heap, e)

  def _step(self, e: int, eqn: _Eqn):
    st = [None if i is None else self.state.get(i) for i in eqn.ins]
    tags = [s for s in st if isinstance(s, _Tag)]
    taints = [s for s in st if isinstance(s, _Taint)]
    reasons = frozenset().union(*(s.reasons for s in tags + taints))
    p = eqn.prim
    cuts = {self.cut_of[i] for i, s in zip(eqn.ins, st) if isinstance(s, _Tag)}
    if len(cuts) > 1 and p in _ADD | {"concatenate", "stack", "select_n"}:
      self.trace.joined.update(c[0] for c in cuts if c)  # one channel after all (RoPE halves)
    self.cut = cuts.pop() if len(cuts) == 1 else None
    if not tags:
      if p == "dot_general" and taints:  # a linear reads what the factor became: say why
        self.trace.lost += [(self.views[i].leaf, reasons) for i in eqn.ins if i in self.views]
      state = _Taint(reasons) if taints else _Sign()
      for o in eqn.outs:
        self._set(o, state)
      return
    zero = [i in self.prog.zeros for i in eqn.ins]
    if p in _STRUCTURAL:
      self._structural(eqn, st, reasons)
    elif p in _ADD or p == "mul" or p == "div":
      self._binary(eqn, st, reasons)
    elif p in ("max", "min", "ge", "gt", "le", "lt") and len(tags) == 1 and \
        zero[1 - st.index(tags[0])]:  # ReLU, and the sign test of a leaky ReLU
      self.trace.through.add("relu")
      self._set(eqn.outs[0], dataclasses.replace(tags[0], positive=True) if p in ("max", "min")
                else _Sign())
    elif p in ("abs",):
      self._set(eqn.outs[0], dataclasses.replace(tags[0], positive=True))
    elif p in _REDUCE:
      self._reduce(eqn, tags[0], reasons)
    elif p == "dot_general":
      self._dot(e, eqn, st, reasons)
    elif p == "select_n":  # jnp.where, a cond: every case must scale alike (or be zero)
      if isinstance(st[0], (_Tag, _Taint)):
        reasons |= {"a choice that depends on it"}
      if any(not z and (not isinstance(s, _Tag) or s.axes != tags[0].axes)
             for s, z in zip(st[1:], zero[1:])):
        reasons |= {"a choice between values that do not scale alike"}
      self._set(eqn.outs[0], _Tag(tags[0].axes, reasons, any(
          s.positive for s in tags) or isinstance(st[0], _Sign)))
    elif len(eqn.ins) == 1 and len(eqn.outs) == 1 and self.prog.shapes[eqn.outs[0]] == \
        self.prog.shapes[eqn.ins[0]]:  # elementwise nonlinearity
      self._set(eqn.outs[0], _Tag(tags[0].axes, reasons | {p}, tags[0].positive))
    else:
      for o in eqn.outs:
        self._set(o, _Taint(reasons | {p}))

  def _structural(self, eqn, st, reasons):
    """Axes move, the factor moves with them; a reshape that splits a channel proposes groups."""
    tag = next(s for s in st if isinstance(s, _Tag))
    if eqn.prim in ("concatenate", "stack") and any(not isinstance(s, _Tag) or s.axes != tag.axes
                                         for s in st):
      reasons |= {"a concatenation with a value that does not scale like it"}
    amap = {}
    for a, outs in enumerate(_axis_map(self.prog, eqn, 0)):
      for o in outs:
        if a in tag.amap:
          amap[o] = amap.get(o, frozenset()) | tag.amap[a]
    if eqn.prim == "reshape":
      blocks = _reshape_map(self.prog.shapes[eqn.ins[0]], self.prog.shapes[eqn.outs[0]])[1]
      for a, sizes in enumerate(blocks):
        if a in tag.amap and len(sizes) > 1:
          self.trace.splits.update(math.prod(sizes[:k]) for k in range(1, len(sizes)))
    cuts = self._cuts(eqn, tag) if eqn.prim in ("slice", "split") else [None] * len(eqn.outs)
    inherited = self.cut
    for o, cut in zip(eqn.outs, cuts):
      if cut is not None:
        self.trace.cuts.add(cut)
      self.cut = cut or inherited
      if cut is None or self.keep is None or cut[0] != self.keep[0] or cut == self.keep:
        self._set(o, _tag(amap, reasons, tag.positive))

  def _cuts(self, eqn, tag) -> list:
    """Per output of a slice or split, the block ``(leaf axis, start, stop)`` it takes of the
    source leaf (a fused QKV kernel's q columns, say), or None. A block is a contiguous range
    of an axis that holds exactly one whole leaf axis."""
    shape, p = self.prog.shapes[eqn.ins[0]], eqn.params
    if eqn.prim == "split":
      axis, bounds = p["axis"], np.cumsum([0] + list(p["sizes"]))
      ranges = list(zip(bounds[:-1], bounds[1:]))
    else:
      strided = [a for a, s in enumerate(p["strides"] or ()) if s != 1]
      narrowed = [a for a, (lo, hi) in enumerate(zip(p["start_indices"], p["limit_indices"]))
                  if hi - lo < shape[a]]
      if len(narrowed) != 1 or strided:
        return [None]
      axis = narrowed[0]
      ranges = [(p["start_indices"][axis], p["limit_indices"][axis])]
    leaf_axes = tag.amap.get(axis, frozenset())
    if len(leaf_axes) != 1:
      return [None] * len(ranges)
    (la,) = leaf_axes
    if shape[axis] != self.shape[la] or sum(la in s for s in tag.amap.values()) > 1:
      return [None] * len(ranges)
    return [(la, int(lo), int(hi)) for lo, hi in ranges]

  def _binary(self, eqn, st, reasons):
    """add/sub/mul/div with the factor on one operand or both; ``reasons`` has both's."""
    p, (x, y) = eqn.prim, st
    tag = x if isinstance(x, _Tag) else y
    other, i = (y, eqn.ins[1]) if tag is x else (x, eqn.ins[0])
    positive = tag.positive
    if isinstance(other, _Tag):
      if p in _ADD and other.axes != tag.axes:
        reasons |= {"a sum of values scaled along different axes"}
      elif p not in _ADD:
        reasons |= {f"{p} of two values that both scale with it (degree 2)"}
      positive = tag.positive or other.positive
    elif isinstance(other, _Taint):  # its reasons (a normalization, say) are in ``reasons``
      pass
    elif isinstance(other, _Sign):  # x * (x > 0): ReLU written as a mask
      reasons |= {"a sum with its own sign test"} if p in _ADD else frozenset()
      positive = True
    elif p in _ADD and i in self.prog.zeros:
      pass
    elif p in _ADD and not self._follower(i, tag, self.prog.shapes[eqn.outs[0]]):
      if i is None or not self.dep[i]:
        reasons |= {"an added constant"}
      elif i in self.views:  # a bias broadcast over the channels (or along another axis)
        reasons |= {"an added parameter that does not follow it channel by channel"}
      elif not reasons:  # an exact factor is lost here; an inexact one is reported as such
        self.trace.breaks.add("it is added to a value that does not scale with it"
                              " (the residual stream, say)")
        return
    elif p == "div" and tag is y:
      reasons |= {"a division by it"}
    elif i is not None and self.dep[i] and i not in self.views:
      self.trace.through.add("gate")  # a product with another activation: a GLU
      self.trace.gates.add(eqn.outs[0])
    self._set(eqn.outs[0], _Tag(tag.axes, reasons, positive))

  def _follower(self, i, tag, shape) -> bool:
    view = self.views.get(i)
    if view is None:
      return False
    amap, leaf = {}, self.prog.shapes[self.prog.leaf_ids[view.leaf]]
    for a, src in tag.amap.items():  # a bias follows along its own axis, not broadcast over it
      if a >= len(view.axes) or not view.axes[a] or \
          math.prod(leaf[x] for x in view.axes[a]) != shape[a]:
        return False
      for s in src:
        amap[s] = view.axes[a]
    self.trace.followers.append((view.leaf, amap, view.consumed))
    return True

  def _reduce(self, eqn, tag, reasons):
    axes = set(eqn.params["axes"])
    if axes & set(tag.amap):
      for o in eqn.outs:
        self._set(o, _Taint(reasons | {NORM}))
      return
    kept = [a for a in range(len(self.prog.shapes[eqn.ins[0]])) if a not in axes]
    amap = {kept.index(a): s for a, s in tag.amap.items()}
    if eqn.prim not in _POSITIVE_REDUCE:
      reasons |= {eqn.prim}
    self._set(eqn.outs[0], _tag(amap, reasons, tag.positive or eqn.prim != "reduce_sum"))

  def _dot(self, e, eqn, st, reasons):
    dims = eqn.params["dimension_numbers"]
    (lc, rc), (lb, rb) = dims
    if all(isinstance(s, _Tag) for s in st):
      for o in eqn.outs:
        self._set(o, _Taint(reasons | {"a product of two values that both scale with it"}))
      return
    side = 0 if isinstance(st[0], _Tag) else 1
    tag, other = st[side], eqn.ins[1 - side]
    contract, batch = (lc, rc)[side], (lb, rb)[side]
    if isinstance(st[1 - side], _Taint):
      reasons |= st[1 - side].reasons
    if set(contract) & set(tag.amap):
      view = self.views.get(other)
      ocontract, obatch = (lc, rc)[1 - side], (lb, rb)[1 - side]
      if view is not None:
        amap = {}
        for mine, theirs in zip(list(contract) + list(batch), list(ocontract) + list(obatch)):
          for s in tag.amap.get(mine, ()):
            amap[s] = amap.get(s, frozenset()) | view.axes[theirs]
        self.trace.reaches.append(_Reach(view.leaf, amap, view.consumed, e, reasons, tag.positive))
      elif other is not None and self.dep[other]:
        positions = tuple(sorted([("c", k) for k, a in enumerate(contract) if a in tag.amap]
                                 + [("b", k) for k, a in enumerate(batch) if a in tag.amap]))
        self.trace.meets.append(_Meet(e, side, positions, reasons, tag.positive))
      else:  # a constant mixes the contracted channels (RoPE as a matmul): the rest stay
        out = _dot_out_axis(dims, [self.prog.shapes[i] for i in eqn.ins], side)
        rest = _tag({out[a]: s for a, s in tag.amap.items() if a not in contract}, reasons,
                    tag.positive)
        self._set(eqn.outs[0], rest or _Taint(reasons | {"a contraction with a constant"}))
      return
    if other is not None and self.dep[other] and other not in self.views:
      self.trace.through.add("attention")
    out = _dot_out_axis(dims, [self.prog.shapes[i] for i in eqn.ins], side)
    self._set(eqn.outs[0], _tag({out[a]: s for a, s in tag.amap.items()}, reasons, tag.positive))


# ---------------------------------------------------------------------------
# Candidates.

@dataclasses.dataclass
class _Candidate:
  """One instance: ``(leaf, absolute group axis)`` per side and follower list."""
  name: str
  a: list
  b: list
  follow_a: list
  follow_b: list
  stacked: int
  splits: set
  positive: bool

  @property
  def scaled(self):
    return [(m, +1) for m in self.a + self.follow_a] + [(m, -1) for m in self.b + self.follow_b]


def _sources(prog, uses):
  """Each leaf use a factor can start from (a linear map or a gain): ``(leaf, eqn, output id,
  tag, stacked axes, channel axes)``."""
  for leaf, found in uses.items():
    for use in found:
      eqn = prog.eqns[use.eqn]
      view, k = use.view, use.operand
      if eqn.prim == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        contract, batch = (lc, rc)[k], (lb, rb)[k]
        out = _dot_out_axis(eqn.params["dimension_numbers"], [prog.shapes[i] for i in eqn.ins], k)
        amap = {out[a]: view.axes[a] for a in range(len(view.axes)) if a not in contract}
        stack = frozenset().union(*(view.axes[a] for a in batch))
      elif eqn.prim == "mul" and len(eqn.ins) == 2:
        amap = {a: s for a, s in enumerate(view.axes)
                if prog.shapes[eqn.outs[0]][a] == prog.shapes[eqn.ins[k]][a]}
        stack = frozenset()
      else:
        continue
      channel = frozenset().union(*amap.values()) - stack
      stacked = view.consumed + len(stack)
      if not channel or stack != frozenset(range(view.consumed, stacked)):
        continue
      tag = _tag(amap)
      if tag is not None:
        yield leaf, use.eqn, eqn.outs[0], tag, stacked, tuple(sorted(channel))


def _embeddings(prog, views) -> set[int]:
  """Leaves read by a gather whose indices come from the model's inputs (token embeddings)."""
  inputs = set(prog.input_ids)
  found = set()
  for eqn in prog.eqns:
    if any(i in inputs for i in eqn.ins):
      inputs.update(eqn.outs)
      if eqn.prim == "gather" and eqn.ins[0] in views and eqn.ins[1] in inputs:
        found.add(views[eqn.ins[0]].leaf)
  return found


def _heads(prog, views, dep) -> set[int]:
  """Leaves of the linear maps that produce an output, through reshapes and bias additions."""
  producer = {o: eqn for eqn in prog.eqns for o in eqn.outs}
  todo, found, seen = list(prog.outputs), set(), set()
  while todo:
    eqn = producer.get(todo.pop())
    if eqn is None or id(eqn) in seen:
      continue
    seen.add(id(eqn))
    if eqn.prim == "dot_general":
      found.update(views[i].leaf for i in eqn.ins if i in views)
    elif eqn.prim in _STRUCTURAL or eqn.prim in _ADD:
      todo += [i for i in eqn.ins if dep[i] and i not in views]
  return found


def _explain(reasons: frozenset, where: str) -> str:
  """Why a factor is not cancelled exactly: the nonlinear primitives if any, else the reasons."""
  prims = sorted(r for r in reasons if " " not in r)
  if prims:
    return f"not positively homogeneous: {', '.join(prims)} {where}"
  return f"not exact: {'; '.join(sorted(reasons))} {where}"


def _group_options(sizes: list[int], splits: set) -> list[int]:
  """Group counts to try, finest first: per index, per head (``splits``: the sizes a reshape
  split a channel axis into), per KV head (their common divisors), one group."""
  options = {n for n in sizes} | set(splits) | {1}
  options |= {math.gcd(a, b) for a in options for b in options}
  return sorted((g for g in options if all(n % g == 0 for n in sizes)), reverse=True)


# ---------------------------------------------------------------------------
# The result.

class Rejected(NamedTuple):
  """A rescaling that is no exact symmetry: ``a`` against ``b``, and why."""
  a: str | tuple[str, ...]
  b: str | tuple[str, ...]
  reason: str


class Discovery(collections.abc.Sequence):
  """What :func:`discover` found: a sequence of :class:`~saggs_jax.Pair`, and what it rejected.

  Pass it wherever pairs go (``saggs.saggs(discovery)``, ``saggs.describe``,
  ``saggs.check_symmetry``). ``repr`` is Python that rebuilds it;
  :meth:`report` is a readable summary. ``roles`` maps the roles of
  :func:`saggs_jax.equivariant.symmetry_compatible` to path patterns
  (``patterns=discovery.roles`` routes a model of any naming).
  """

  def __init__(self, pairs: Sequence[Pair] = (), rejected: Sequence[Rejected] = (),
               roles: dict[str, tuple[str, ...]] | None = None):
    self.pairs, self.rejected, self.roles = tuple(pairs), tuple(rejected), dict(roles or {})

  def __getitem__(self, i):
    return self.pairs[i]

  def __len__(self):
    return len(self.pairs)

  def __eq__(self, other):
    return (isinstance(other, Discovery) and self.pairs == other.pairs
            and self.rejected == other.rejected and self.roles == other.roles)

  def __repr__(self):
    def block(items):
      return "".join(f"\n    {x!r}," for x in items) + ("\n" if items else "")
    roles = f", roles={self.roles!r}" if self.roles else ""
    return f"Discovery(pairs=[{block(self.pairs)}], rejected=[{block(self.rejected)}]{roles})"

  def report(self) -> str:
    """Found and rejected symmetries, one line each."""
    def side(x, axes):
      names = (x,) if isinstance(x, str) else x
      return ", ".join(f"{n!r} ({'whole' if a is None else f'axis {a}'})"
                       for n, a in zip(names, axes))

    lines = [f"Found {len(self.pairs)} symmetr{'y' if len(self.pairs) == 1 else 'ies'}:"]
    for p in self.pairs:
      extra = [f"{p.groups} groups"] if p.groups else []
      extra += [f"stacked={p.stacked}"] if p.stacked else []
      extra += [f"bias {', '.join(map(repr, p.follow_a + p.follow_b))}"] if (
          p.follow_a or p.follow_b) else []
      lines.append(f"  {p.label}: {side(p.a, p.side_axes(0))} x c  against"
                   f"  {side(p.b, p.side_axes(1))}"
                   f" x 1/c{'; ' + ', '.join(extra) if extra else ''}")
    lines.append(f"Rejected {len(self.rejected)}:")
    lines += [f"  {r.a!r} against {r.b!r}: {r.reason}" for r in self.rejected]
    return "\n".join(lines)

  __str__ = report

  def muon_dimension_numbers(self, params):
    """The ``optax.contrib.muon`` tree of ``MuonDimensionNumbers`` for the matrices of
    :attr:`roles`, ``None`` elsewhere (see :func:`saggs_jax.equivariant.role_dimension_numbers`)."""
    from saggs_jax.equivariant.stack import role_dimension_numbers
    return role_dimension_numbers(params, self.roles)


# ---------------------------------------------------------------------------
# discover()

_NAMES = {"attention": "attention V/O", "gate": "gated MLP up/down", "relu": "ReLU MLP up/down"}


class _Analysis:
  """The jaxpr read once: candidate instances and static rejections, by unit index.

  A unit is a leaf (units ``0 .. n-1`` are the leaves, in order) or one block of a leaf that
  the program cuts into parts (a fused QKV kernel's q, k and v columns): ``units[u]`` is
  ``(leaf, None)`` or ``(leaf, (axis, start, stop, bounds))``, ``bounds`` every part's range.
  """

  def __init__(self, closed, names, shapes, floating):
    self.names, self.shapes = list(names), list(shapes)
    self.units, self.blocks = [(leaf, None) for leaf in range(len(names))], {}
    prog = _Program(closed, len(names))
    views, self.uses, dep = _views(prog, shapes)
    consumers = collections.defaultdict(list)
    for e, eqn in enumerate(prog.eqns):
      for i in set(eqn.ins) - {None}:
        consumers[i].append(e)
    follower = _Follower(prog, views, dep, consumers)
    self.candidates, self.rejected = [], []
    self.gated = collections.defaultdict(set)  # a GLU product -> the leaves whose factor it takes
    self.gates_of = collections.defaultdict(set)  # leaf -> the GLU products its factor takes
    self.embeddings, self.heads = _embeddings(prog, views), _heads(prog, views, dep)
    meets = collections.defaultdict(list)
    for leaf, e, out, tag, stacked, channel in _sources(prog, self.uses):
      if not floating[leaf]:
        continue
      trace = follower.run(e, out, tag, shapes[leaf])
      self.gates_of[leaf] |= trace.gates
      for g in trace.gates:
        self.gated[g].add(leaf)
      parts = None if _clean(trace) else _partition(
          {c for c in trace.cuts if c[0] not in trace.joined}, shapes[leaf])
      found = [(leaf, channel, trace)]
      if parts is not None:  # each block its own source, the others values that do not scale
        axis, bounds = parts
        found = [(self._block(leaf, axis, lo, hi, bounds),
                  tuple(a for a in channel if a != axis or hi - lo > 1),
                  self._block_followers(follower.run(e, out, tag, shapes[leaf], (axis, lo, hi)),
                                        axis, lo, hi, bounds))
                 for lo, hi in bounds]
      for unit, channel, trace in found:
        source = (unit, e, channel, stacked, trace, prog.eqns[e].prim == "mul")
        if len(trace.meets) == 1 and not trace.reaches and not trace.breaks:
          meets[trace.meets[0].eqn].append(source)
        elif trace.reaches and not trace.meets:
          self._chain(*source)
        elif trace.lost and not trace.meets:  # what reaches a linear no longer carries the factor
          self._reject([unit], sorted({t for t, _ in trace.lost}), _explain(
              frozenset().union(*(r for _, r in trace.lost)), "between them"))
    for found in meets.values():
      self._meeting(found)

  def _block(self, leaf, axis, lo, hi, bounds) -> int:
    """The unit of ``leaf``'s block ``[lo, hi)`` on ``axis`` (one of ``bounds``)."""
    key = (leaf, axis, lo, hi, bounds)
    if key not in self.blocks:
      self.blocks[key] = len(self.units)
      self.units.append((leaf, (axis, lo, hi, bounds)))
      self.names.append(self.names[leaf])
      self.shapes.append(tuple(hi - lo if a == axis else n
                               for a, n in enumerate(self.shapes[leaf])))
    return self.blocks[key]

  def _block_followers(self, trace, axis, lo, hi, bounds) -> _Trace:
    """``trace`` with each follower (a fused bias) cut like its source: the same range of the
    follower axis that moves with the source's block axis."""
    followers = []
    for f, amap, consumed in trace.followers:
      fa = min(amap[axis]) if len(amap.get(axis, ())) == 1 else None
      if fa is not None and self.shapes[f][fa] == bounds[-1][1]:
        f = self._block(f, fa, lo, hi, bounds)
      followers.append((f, amap, consumed))
    trace.followers = followers
    return trace

  def label(self, unit) -> str:
    """The unit's name, with the block if it is one (for rejections)."""
    leaf, block = self.units[unit]
    if block is None:
      return self.names[leaf]
    axis, lo, hi, bounds = block
    return f"{self.names[leaf]}[part {bounds.index((lo, hi))} of {len(bounds)} on axis {axis}]"

  def _followers(self, leaf, axis, trace, stacked):
    """Each follower with the axis a Pair declares it on (see ``pairs.follower_axis``)."""
    return [(f, follower_axis(len(self.shapes[leaf]), axis, len(self.shapes[f]), stacked))
            for f, _, _ in trace.followers]

  def _undeclarable(self, leaf, axis, trace, stacked) -> str | None:
    """Why a follower cannot be declared: it moves along another axis than the one a Pair
    gives it (a bias vector's, or its kernel's trailing axes)."""
    for (f, amap, _), (_, declared) in zip(trace.followers,
                                           self._followers(leaf, axis, trace, stacked)):
      if declared not in amap.get(axis, ()):
        return (f"its bias {self.label(f)!r} follows axis {axis} of {self.label(leaf)!r} along"
                " another axis than a Pair's follower: a bias vector's own, or its kernel's"
                " trailing axes")
    return None

  def _tied(self, units_eqns) -> str | None:
    for unit, eqns in units_eqns:
      if any(u.eqn not in eqns for u in self.uses[self.units[unit][0]]):
        return (f"weight tying: {self.label(unit)!r} is also used elsewhere, so rescaling it"
                " changes another part of the model")
    return None

  def _first_use(self, unit) -> int:
    return self.uses[self.units[unit][0]][0].eqn

  def _reject(self, a, b, reason):
    self.rejected.append(([self.label(x) for x in a], [self.label(x) for x in b], reason))

  def _chain(self, leaf, e, channel, stacked, trace, gain):
    targets = [r.leaf for r in trace.reaches]
    reasons = frozenset().union(*(r.reasons for r in trace.reaches))
    if NORM in reasons:
      return self._reject([leaf], targets, (
          "a normalization between them makes what follows side a invariant to its scale,"
          " so nothing compensates a factor on side b"))
    if reasons:
      return self._reject([leaf], targets, _explain(reasons, "between them"))
    if trace.breaks:
      return self._reject([leaf], targets, "part of side a's output bypasses side b: "
                          + "; ".join(sorted(trace.breaks)))
    reach_eqns = {r.eqn for r in trace.reaches}
    tied = self._tied([(leaf, {e})] + [(t, reach_eqns) for t in targets]
                      + [(f, {self._first_use(f)}) for f, _, _ in trace.followers])
    if tied:
      return self._reject([leaf], targets, tied)
    channel = list(channel)  # a leading channel axis that meets a leading axis of every B
    while len(channel) > 1 and channel[0] == stacked and all(  # indexes copies (experts)
        r.amap.get(stacked) == {stacked} for r in trace.reaches):
      stacked, channel = stacked + 1, channel[1:]
    axis = channel[0]
    b_side = []
    for r in trace.reaches:
      stack = frozenset().union(*(r.amap.get(s, frozenset()) for s in range(stacked)))
      if axis not in r.amap or r.consumed + len(stack) != stacked:
        return
      if (r.leaf, min(r.amap[axis])) not in b_side:  # a weight read twice is scaled once
        b_side.append((r.leaf, min(r.amap[axis])))
    if why := self._undeclarable(leaf, axis, trace, stacked):
      return self._reject([leaf], targets, why)
    name = "norm gain" if gain else next(
        (_NAMES[k] for k in ("attention", "gate", "relu") if k in trace.through), "linear chain")
    self.candidates.append(_Candidate(name, [(leaf, axis)], b_side,
                                      self._followers(leaf, axis, trace, stacked), [], stacked,
                                      trace.splits, any(r.positive for r in trace.reaches)))

  def _meeting(self, found):
    """Pairs the sources that meet in one dot_general: exact pairs first, then the rest."""
    sides = [[s for s in found if s[4].meets[0].side == k] for k in (0, 1)]
    combos = [(a, b) for a in sides[0] for b in sides[1]
              if _contracted(a[4].meets[0]) == _contracted(b[4].meets[0]) and a[3] == b[3]]
    exact = [(a, b) for a, b in combos if not (a[4].meets[0].reasons | b[4].meets[0].reasons)]
    paired = {id(s) for combo in exact for s in combo}
    for a, b in exact + [(a, b) for a, b in combos if not {id(a), id(b)} & paired]:
      (la, ea, (xa, *_), sa, ta, _), (lb, eb, (xb, *_), sb, tb, _) = a, b
      ma, mb = ta.meets[0], tb.meets[0]
      if la == lb:
        self._reject([la], [lb], "both sides read the same weight, which cannot carry a factor"
                     " and its inverse at once")
      elif NORM in ma.reasons and NORM in mb.reasons:
        self._reject([la], [lb], (
            "moot: each side is scale-invariant on its own (a normalization follows each,"
            " QK-norm), so the pair is exact but balancing it changes nothing that matters"))
      elif ma.reasons | mb.reasons:
        self._reject([la], [lb], _explain(ma.reasons | mb.reasons, "before they meet"))
      else:
        tied = self._tied([(la, {ea}), (lb, {eb})] + [(f, {self._first_use(f)}) for f, _, _ in
                                                       ta.followers + tb.followers])
        why = (tied or self._undeclarable(la, xa, ta, sa) or self._undeclarable(lb, xb, tb, sb))
        if why:
          self._reject([la], [lb], why)
          continue
        self.candidates.append(_Candidate(
            "attention Q/K", [(la, xa)], [(lb, xb)], self._followers(la, xa, ta, sa),
            self._followers(lb, xb, tb, sb), sa, ta.splits | tb.splits, ma.positive or mb.positive))


def _clean(trace: _Trace) -> bool:
  """Whether ``trace`` proposes a candidate as it is (else its blocks may)."""
  if trace.breaks:
    return False
  if len(trace.meets) == 1 and not trace.reaches:
    return not trace.meets[0].reasons
  return bool(trace.reaches) and not trace.meets and not any(r.reasons for r in trace.reaches)


def _partition(cuts: set, shape: tuple) -> tuple[int, tuple] | None:
  """``(axis, bounds)``: the parts the blocks in ``cuts`` split one leaf axis into, gaps
  included as parts of their own; None unless they are disjoint blocks of one axis."""
  if len({axis for axis, _, _ in cuts}) != 1:
    return None
  axis = next(iter(cuts))[0]
  bounds, end = [], 0
  for _, lo, hi in sorted(cuts):
    if lo < end:
      return None
    bounds += [(end, lo)] * (lo > end) + [(lo, hi)]
    end = hi
  bounds += [(end, shape[axis])] * (shape[axis] > end)
  return (axis, tuple(bounds)) if len(bounds) > 1 else None


def _contracted(meet: _Meet) -> tuple:
  """The contracted positions a factor sits on. A batch axis (heads) may carry it on one side
  only: one KV head read by every query head (MQA); the check then finds the grouping."""
  return tuple(x for x in meet.positions if x[0] == "c")


class _Checker:
  """Rescales instances by random factors and tells whether the model's outputs stay put.

  The check runs on ``params`` made live: an all-zero leaf (a zero-initialised output
  projection, an adaLN-Zero gate) cuts the path it sits on, and every factor behind it would
  pass. Such leaves are drawn at random instead, at the RMS of the non-zero leaves of their
  rank; symmetries are structural, so what is exact on these parameters is exact on any.
  """

  def __init__(self, apply_fn, params, args, kwargs, rtol, seed, units):
    self.units = units
    self.rng = np.random.default_rng(seed)
    self.leaves, self.treedef = jax.tree.flatten(params)
    self.leaves = _live(self.leaves, self.rng)
    self.probe = Probe(apply_fn, self.treedef.unflatten(self.leaves), args, kwargs, rtol=rtol)

  def _moved(self, instances, groups, signs) -> float:
    """The deviation when every instance's members of ``signs`` take random factors."""
    changed = {}
    for inst in instances:
      stacked_shape = tuple(self.leaves[self.units[inst.a[0][0]][0]].shape[:inst.stacked])
      factors = np.exp(self.rng.uniform(-np.log(4), np.log(4), stacked_shape + (groups,)))
      for (unit, axis), sign in inst.scaled:
        if sign not in signs:
          continue
        leaf, block = self.units[unit]
        x = changed.get(leaf)
        x = np.array(self.leaves[leaf], np.float32) if x is None else x
        part = (slice(None),) * block[0] + (slice(block[1], block[2]),) if block else ()
        x[part] = x[part] * _expand(factors ** sign, x[part].shape, axis, inst.stacked)
        changed[leaf] = x
    leaves = [jnp.asarray(changed[i], x.dtype) if i in changed else x
              for i, x in enumerate(self.leaves)]
    return self.probe.deviation(self.treedef.unflatten(leaves))

  def exact(self, instances: list[_Candidate], groups: int) -> bool:
    return bool(self._moved(instances, groups, (1, -1)) <= self.probe.tolerance)  # NaN fails

  def could_fail(self, instances: list[_Candidate], groups: int) -> bool:
    """Whether the check of ``instances`` could have failed: side a rescaled alone, a move
    that is no symmetry, must fail it (it passes behind a constant zero, say)."""
    return bool(self._moved(instances, groups, (1,)) > self.probe.tolerance)


def _live(leaves: list, rng) -> list:
  """``leaves`` with every all-zero floating array drawn from N(0, s^2), s the mean RMS of the
  non-zero floating leaves of the same rank (1 if there is none)."""
  def floating(x):
    return jnp.issubdtype(jnp.result_type(x), jnp.floating) and np.size(x) > 0

  values = [np.asarray(x, np.float32) if floating(x) else None for x in leaves]
  rms = collections.defaultdict(list)
  for v in values:
    if v is not None and v.any():
      rms[v.ndim].append(float(np.sqrt(np.mean(v * v))))
  return [jnp.asarray(rng.standard_normal(v.shape) * np.mean(rms[v.ndim] or [1.0]), x.dtype)
          if v is not None and not v.any() else x for x, v in zip(leaves, values)]


def _expand(factors, shape, axis, stacked):
  """Per-group ``factors`` (stacked..., groups) as a multiplier of a leaf of ``shape``."""
  n = shape[axis]
  factors = np.repeat(factors, n // factors.shape[-1], axis=-1)
  return factors.reshape(factors.shape[:-1] + (1,) * (axis - stacked) + (n,)
                         + (1,) * (len(shape) - axis - 1))


def _confirm(checker, instances, options):
  """``[(instances, groups, tested)]`` confirmed at their finest exact grouping, and those none
  fits; ``tested``: a finer grouping failed, so the check could fail on these instances."""
  for k, groups in enumerate(options):
    if checker.exact(instances, groups):
      return [(instances, groups, k > 0)], []
  if len(instances) == 1:
    return [], instances
  half = len(instances) // 2
  (ok1, bad1), (ok2, bad2) = (_confirm(checker, part, options)
                              for part in (instances[:half], instances[half:]))
  return ok1 + ok2, bad1 + bad2


def _patterns(names: list[str], extra: int) -> list[str]:
  """``names`` without the leading segments they share (their enclosing module) but ``extra``
  of them, whose numbers become wildcards (``layers/0`` -> ``layers/*``, ``h_1`` -> ``h_*``)."""
  segs = [n.split("/") for n in names]
  k = 0
  while all(len(s) > k + 1 for s in segs) and len({s[k] for s in segs}) == 1:
    k += 1
  k = max(k - extra, 0)
  return ["/".join([re.sub(r"\d+", "*", x) for x in s[k:k + extra]] + s[k + extra:])
          for s in segs]


def _one(x):
  return x[0] if len(x) == 1 else tuple(x)


def _declare(units, names, shapes, inst_list, groups) -> list[Pair]:
  """The fewest Pairs whose patterns resolve to exactly ``inst_list`` (``units``, ``names`` and
  ``shapes`` of :class:`_Analysis`)."""
  first = inst_list[0]
  leaf_names = [names[leaf] for leaf, block in units if block is None]
  sides = [first.a, first.b, first.follow_a, first.follow_b]
  sizes = [shapes[leaf][axis] for leaf, axis in first.a + first.b]

  def pair(patterns, inst):
    n = [len(s) for s in sides]
    cut = np.cumsum([0] + n)
    patterns = [_as_block(p, units[u][1], inst.stacked) for p, (u, _) in
                zip(patterns, inst.a + inst.b + inst.follow_a + inst.follow_b)]
    a, b, fa, fb = (patterns[cut[i]:cut[i + 1]] for i in range(4))
    axes = tuple(_one(tuple(axis - inst.stacked for _, axis in side)) for side in (inst.a, inst.b))
    axes = tuple(x if isinstance(x, int) or len(set(x)) > 1 else x[0] for x in axes)
    name = inst.name + (" (positive factors)" if inst.positive else "")
    return Pair(_one(a), _one(b), axes=axes, groups=None if all(n == groups for n in sizes)
                else groups, stacked=inst.stacked, follow_a=tuple(fa), follow_b=tuple(fb),
                name=name)

  def members(inst):
    return [names[leaf] for side in (inst.a, inst.b, inst.follow_a, inst.follow_b)
            for leaf, _ in side]

  wanted = [set(column) for column in zip(*map(members, inst_list))]
  for extra in range(max(n.count("/") for n in members(first)) + 1):
    patterns = _patterns(members(first), extra)
    if all(_patterns(members(i), extra) == patterns for i in inst_list) and all(
        {n for n in leaf_names if paths.match(p, n) is not None} == w
        for p, w in zip(patterns, wanted)):
      return [pair(patterns, first)]
  return [pair(members(i), i) for i in inst_list]


def _as_block(pattern, block, stacked):
  """``pattern`` as a :class:`~saggs_jax.Block` if the unit is one."""
  if block is None:
    return pattern
  axis, lo, hi, bounds = block
  sizes = [b - a for a, b in bounds]
  return Block(pattern, axis=axis - stacked, parts=len(bounds), part=bounds.index((lo, hi)),
               sizes=None if len(set(sizes)) == 1 else tuple(sizes))


def _key(units, names, inst: _Candidate):
  members = [u for side in (inst.a, inst.b, inst.follow_a, inst.follow_b) for u, _ in side]
  rel = _patterns([names[u] for u in members], 0)
  return (inst.name, tuple(rel), tuple(units[u][1] for u in members),
          tuple(len(s) for s in (inst.a, inst.b, inst.follow_a, inst.follow_b)),
          tuple(axis - inst.stacked for _, axis in inst.a + inst.b), inst.stacked)


def _cover(names: list[str], wanted: set[str]) -> tuple[str, ...]:
  """Path patterns that match exactly ``wanted`` among ``names``: each its shortest suffix that
  matches nothing else (``wq`` for every layer's ``.../attention/wq``)."""
  out = []
  for name in (n for n in names if n in wanted):
    segs = name.split("/")
    pattern = next((p for p in ("/".join(segs[-k:]) for k in range(1, len(segs)))
                    if all(m in wanted for m in names if paths.match(p, m) is not None)), name)
    if pattern not in out:
      out.append(pattern)
  return tuple(out)


# The roles of equivariant.symmetry_compatible each found pair assigns to its sides.
_ROLES = {"attention Q/K": ("query", "key_value"), "attention V/O": ("key_value", "output"),
          "gated MLP up/down": ("gate_up", "down"), "ReLU MLP up/down": ("gate_up", "down")}


def _roles(analysis, names, shapes, confirmed) -> dict[str, tuple[str, ...]]:
  """Role -> path patterns, as ``equivariant.symmetry_compatible(patterns=...)`` takes them:
  attention and MLP matrices from the pairs found (a GLU's gate from the jaxpr, stacked MLP
  copies that no scan made as experts), the embedding and the LM head from the jaxpr."""
  leaves = collections.defaultdict(set)
  for insts, _ in confirmed:
    for inst in insts:
      if inst.name not in _ROLES:
        continue
      a, b = ([leaf for leaf, _ in side  # a fused leaf's block: no one role for the leaf
               if analysis.units[leaf][1] is None and len(shapes[leaf]) - inst.stacked >= 2]
              for side in (inst.a, inst.b))
      if inst.name == "gated MLP up/down":  # the gate: the other factor of up's product
        a += [g for leaf in a for glu in analysis.gates_of[leaf] for g in analysis.gated[glu]
              if g != leaf and len(shapes[g]) - inst.stacked >= 2]
      scanned = min(u.view.consumed for leaf in a for u in analysis.uses[leaf]) if a else 0
      roles = ("experts", "experts") if inst.stacked > scanned else _ROLES[inst.name]
      for role, side in zip(roles, (a, b)):
        leaves[role].update(side)
  taken = set().union(*leaves.values())
  leaves["embedding"] = {x for x in analysis.embeddings if len(shapes[x]) == 2} - taken
  leaves["lm_head"] = {x for x in analysis.heads if len(shapes[x]) == 2} - taken - \
      leaves["embedding"]
  order = ("embedding", "lm_head", "query", "key_value", "output", "gate_up", "down", "experts")
  return {r: _cover(names, {names[x] for x in leaves[r]}) for r in order if leaves[r]}


def discover(apply_fn: Callable[..., Any], params: Any, *example_args, rtol: float | None = None,
             seed: int = 0, **example_kwargs) -> Discovery:
  """Finds the exact rescaling symmetries of ``apply_fn`` in ``params``.

  Reads the jaxpr of ``apply_fn(params, *example_args, **example_kwargs)``
  traced on abstract shapes, proposes every rescaling of one parameter that
  another cancels (see the module docstring), and keeps those that random
  factors in [1/4, 4] leave exact on the example inputs: the outputs agree to
  ``rtol * max|output|`` with full-precision matmuls. All instances of one
  candidate (every layer) are checked at once, at the finest grouping the
  jaxpr suggests that is exact (per channel, per head, per KV head), on
  ``params`` with all-zero leaves drawn at random, and only where the check
  could have failed. Blocks of a fused leaf enter pairs as
  :class:`~saggs_jax.Block` members.

  Args:
    apply_fn: ``apply_fn(params, *example_args, **example_kwargs)``, returning
      an array or a pytree.
    params: the parameter tree (an ``nnx.State``, a Linen dict, an Equinox
      module): its inexact arrays are the parameters, every other leaf (flags,
      activation functions, integer buffers) is static, as under ``eqx.filter``.
    *example_args: small example inputs (a batch of 2 short sequences is enough).
    rtol: relative tolerance of the numerical check (>= 0); default 1e-4 in
      float32, 3e-2 with 16-bit parameters or outputs.
    seed: seed of the random factors.
    **example_kwargs: keyword inputs of ``apply_fn``.

  Returns:
    A :class:`Discovery`: a sequence of :class:`~saggs_jax.Pair` whose patterns
    cover every layer, with ``.rejected`` (what was considered and why it is
    no exact symmetry), :meth:`Discovery.report`, and ``.roles``: the path
    patterns of each role of :func:`saggs_jax.equivariant.symmetry_compatible`
    found (attention from the Q/K and V/O pairs, MLP up/gate/down from the MLP
    pairs, stacked experts, the embedding read by a gather on the inputs, the
    LM head producing the output), for ``symmetry_compatible(patterns=...)``.

  Raises:
    ValueError: ``rtol`` is negative or NaN.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from saggs_jax.discovery import discover
    >>> def mlp(p, x): return jax.nn.relu(x @ p["up"]) @ p["down"]
    >>> params = {"up": jnp.ones((3, 4)), "down": jnp.ones((4, 2))}
    >>> discover(mlp, params, jnp.ones((2, 3)))
    Discovery(pairs=[
        Pair(a='up', b='down', axes=(1, 0), groups=None, stacked=0, follow_a=(), follow_b=(),
             name='ReLU MLP up/down (positive factors)'),
    ], rejected=[], roles={'gate_up': ('up',), 'down': ('down',)})
  """
  if rtol is not None and not rtol >= 0:  # NaN too
    raise ValueError(f"rtol must be a non-negative number, got {rtol!r}.")
  # Only inexact arrays are parameters; the rest (flags, activation functions, integer
  # buffers of an Equinox module) stays static, as under eqx.filter.
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  traced = [isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.inexact)
            for _, x in flat]
  names = [paths.path_str(k) for (k, _), t in zip(flat, traced) if t]
  leaves = [x for (_, x), t in zip(flat, traced) if t]

  def fn(arrays, *args, **kwargs):
    arrays = iter(arrays)
    tree = treedef.unflatten([next(arrays) if t else x for (_, x), t in zip(flat, traced)])
    return apply_fn(tree, *args, **kwargs)

  abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
  closed = jax.make_jaxpr(lambda p, a, k: fn(p, *a, **k))(abstract, example_args, example_kwargs)
  shapes = [tuple(x.shape) for x in leaves]
  floating = [jnp.issubdtype(x.dtype, jnp.floating) for x in leaves]
  analysis = _Analysis(closed, names, shapes, floating)

  units, unit_names, unit_shapes = analysis.units, analysis.names, analysis.shapes
  groups_of = collections.defaultdict(list)
  for inst in sorted(analysis.candidates,  # in the order of the tree
                     key=lambda i: (units[i.a[0][0]][0], i.a[0][0])):
    groups_of[_key(units, unit_names, inst)].append(inst)
  pairs, rejected, confirmations = [], [], []
  checker = _Checker(fn, leaves, example_args, example_kwargs, rtol, seed, units) \
      if groups_of else None
  for inst_list in groups_of.values():
    sizes = [unit_shapes[unit][axis] for unit, axis in inst_list[0].a + inst_list[0].b]
    options = _group_options(sizes, set().union(*(i.splits for i in inst_list)))
    confirmed, failed = _confirm(checker, inst_list, options)
    for insts, groups, tested in confirmed:
      if not (tested or checker.could_fail(insts, groups)):
        for inst in insts:
          analysis._reject([l for l, _ in inst.a], [l for l, _ in inst.b], (
              "unconfirmed: rescaling side a alone does not change the output on the example"
              " inputs, even with all-zero parameters drawn at random, so no check could fail"))
        continue
      confirmations.append((insts, groups))
      pairs += _declare(units, unit_names, unit_shapes, insts, groups)
    for inst in failed:
      analysis._reject([l for l, _ in inst.a], [l for l, _ in inst.b],
                       "the jaxpr suggests it, but random factors change the output")
  seen = set()
  for a, b, reason in analysis.rejected:
    rel = _patterns(a + b, 0)
    entry = Rejected(_one(tuple(rel[:len(a)])), _one(tuple(rel[len(a):])), reason)
    if entry not in seen:
      seen.add(entry)
      rejected.append(entry)
  return Discovery(pairs, rejected, _roles(analysis, names, shapes, confirmations))
