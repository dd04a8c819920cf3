"""Following a per-channel factor through the program, one primitive at a time.

:func:`flow` reads the program's static facts once (the views of each parameter leaf,
its uses, which values depend on which leaves, which are zero); :func:`follow` folds the
steps of :mod:`.primitives` in program order from one starting factor and returns what it
reached, met and lost (a :class:`~.tags.Trace`).
"""

from __future__ import annotations

import collections
import heapq

from saggs_jax._src.discovery.primitives import Walk, moved, rule_of, step
from saggs_jax._src.discovery.program import Eqn, Program
from saggs_jax._src.discovery.tags import (
  REACHES_OUTPUT,
  Cut,
  Flow,
  Tag,
  Trace,
  Use,
  Value,
  View,
)


def _plus_zero(prog: Program, eqn: Eqn, zeros: set[int]) -> bool:
  """``x + 0``, ``0 + x`` or ``x - 0`` that keeps ``x``'s shape: ``x`` itself."""
  if eqn.prim not in ("add", "sub") or len(eqn.ins) != 2:
    return False
  keep = [k for k in range(2) if eqn.ins[1 - k] in zeros and (k == 0 or eqn.prim == "add")]
  return any(prog.shapes[eqn.ins[k]] == prog.shapes[eqn.outs[0]] for k in keep)


def _taken(prog: Program, eqn: Eqn, view: View) -> View | None:
  """The view a ``gather`` of whole slices along one axis (``jnp.take(w, idx, axis)``) makes
  of ``view``: its index axes hold that axis, indexed by values the parameters compute (an
  MoE's chosen experts), the other axes as they were; None for any other gather."""
  dims = eqn.params["gather"]
  shape, out = prog.shapes[eqn.ins[0]], prog.shapes[eqn.outs[0]]
  (axis,) = dims.collapsed_slice_dims if len(dims.collapsed_slice_dims) == 1 else (None,)
  if (
    axis is None
    or dims.start_index_map != (axis,)
    or dims.operand_batching_dims
    or any(n != shape[a] for a, n in enumerate(dims.slice_sizes) if a != axis)
  ):
    return None
  kept = iter(a for a in range(len(shape)) if a != axis)
  index = frozenset(range(len(out))) - frozenset(dims.offset_dims)
  axes = tuple(view.axes[axis] if o in index else view.axes[next(kept)] for o in range(len(out)))
  return View(view.leaf, axes, view.consumed, view.gathered | index)


def flow(prog: Program) -> Flow:
  """Views of one leaf through structural eqns, each leaf's other uses, and dependence."""
  views = {
    i: View(n, tuple(frozenset([a]) for a in range(len(prog.shapes[i]))), ())
    for n, i in enumerate(prog.leaf_ids)
  }
  dep = [False] * len(prog.shapes)
  for i in prog.leaf_ids:
    dep[i] = True
  zeros = set(prog.zeros)
  uses = collections.defaultdict(list)
  consumers = collections.defaultdict(list)
  for e, eqn in enumerate(prog.eqns):
    for i in set(eqn.ins):
      consumers[i].append(e)
    for o in eqn.outs:
      dep[o] = any(dep[i] for i in eqn.ins)
    rule = rule_of(eqn.prim)
    if rule.identity:  # output k is input k: a view, a zero or a value as it was
      for i, o in zip(eqn.ins, eqn.outs):
        if i in views:
          views[o] = views[i]
        if i in zeros:
          zeros.add(o)
      continue
    if rule.axes is not None and all(i in zeros for i in eqn.ins):
      zeros.update(eqn.outs)
    src = [(k, views[i]) for k, i in enumerate(eqn.ins) if i in views]
    if _plus_zero(prog, eqn, zeros) and src:  # ``w + 0.0`` (MaxText's gain offset): still w
      views[eqn.outs[0]] = src[0][1]
      continue
    if eqn.prim == "gather" and eqn.ins[0] in views and dep[eqn.ins[1]]:
      view = _taken(prog, eqn, views[eqn.ins[0]])  # experts chosen by a router (jnp.take)
      if view is not None:
        views[eqn.outs[0]] = view
        continue
    if src and len(eqn.ins) == 1 and rule.axes is not None and rule.views:
      view = src[0][1]
      views[eqn.outs[0]] = View(
        view.leaf,
        tuple(moved(eqn, prog.shapes, view.axes)),
        view.consumed + (tuple(sorted(view.axes[0])) if eqn.prim == "scan_slice" else ()),
      )  # (an axis move drops ``gathered``: only a take's own reader is followed)
      continue
    for k, view in src:
      uses[view.leaf].append(Use(e, k, view))
  return Flow(prog, views, uses, dep, zeros, consumers)


# ---------------------------------------------------------------------------
# Following one factor.


def follow(
  flow: Flow, start: int, out: int, source: Tag, shape: tuple[int, ...], keep: Cut | None = None
) -> Trace:
  """Follows ``source`` on value ``out``, the output of eqn ``start`` using a leaf of
  ``shape``, in program order; with ``keep``, only that block of the leaf's factor: the other
  blocks cut from it (``Trace.cuts``) go on as values that do not scale."""
  walk = Walk(flow, shape, keep)
  values: dict[int, Value] = {}
  cut_of: dict[int, Cut | None] = {}
  heap, seen, notes = [], {start}, []

  def put(i: int, value: Value | None, cut: Cut | None):
    if value is None:
      return
    values[i], cut_of[i] = value, cut
    if i in flow.prog.outputs:
      notes.append(Trace(breaks=frozenset({REACHES_OUTPUT})))
    for e in flow.consumers.get(i, ()):
      if e not in seen:
        seen.add(e)
        heapq.heappush(heap, e)

  put(out, source, None)
  while heap:
    e = heapq.heappop(heap)
    outs, note = step(walk, e, values, cut_of)
    if note is not None:
      notes.append(note)
    for o in outs:
      put(*o)
  return Trace.merge(notes)
