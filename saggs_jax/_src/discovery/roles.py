"""What each parameter is, for the update rules: roles read from the program's structure.

The roles of :func:`saggs_jax.equivariant.symmetry_compatible` are named by what a parameter
does, not by the pairs it sits in (a Q/K pair is moot under QK-norm, yet ``k_proj`` is still a
key), so each is read from the jaxpr:

* attention: a product of two activations, ``s = q . k``, whose scores pass a softmax
  (``exp``) into a second product ``s . v`` that contracts them over the axes ``k`` brought
  (the key side: the one the softmax runs over); query, key and value are the linear maps
  that produce ``q``, ``k`` and ``v`` (through RoPE, norms, biases, reshapes), the output the
  linear map that reads ``s . v``;
* router: the linear map whose output (through a softmax, a bias) feeds ``top_k``;
* experts: a matrix whose leading axis, as many as the router has outputs, indexes copies read
  by a matmul that does not contract it (or is gathered by the router's choices, ``jnp.take``,
  or groups a ``ragged_dot``'s rows, or is contracted against the expert axis another expert
  matmul made: the down projection summing the weighted experts in one product);
* embedding: a leaf gathered by indices that come from the inputs alone (token ids), not from
  the parameters (an expert bias gathered by the router's choices is none);
* LM head: the linear map producing an output, through axis moves and bias sums;
* gated MLP: the up/down pairs found, and the GLU gate read from the jaxpr.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from saggs_jax.discovery import discover
  >>> def attend(p, x):  # the key is the side the softmax runs over, whatever its name
  ...   s = jnp.einsum("qd,kd->qk", x @ p["a"], x @ p["b"])
  ...   return (jax.nn.softmax(s) @ (x @ p["c"])) @ p["d"]
  >>> params = {n: jax.random.normal(jax.random.key(i), (4, 4)) for i, n in enumerate("abcd")}
  >>> discover(attend, params, jnp.ones((3, 4))).roles
  {'query': ('a',), 'key_value': ('b', 'c'), 'output': ('d',)}
"""

from __future__ import annotations

import collections

from saggs_jax._src import paths
from saggs_jax._src.discovery.candidates import Analysis, Candidate, copy_axes
from saggs_jax._src.discovery.primitives import rule_of
from saggs_jax._src.discovery.program import Program
from saggs_jax._src.discovery.tags import Flow, dot_out_axis

_MLP = {
  "gated MLP up/down": ("gate_up", "down"),
  "ReLU MLP up/down": ("gate_up", "down"),
  "expert up/down": ("experts", "experts"),
}
ORDER = (
  "embedding",
  "lm_head",
  "query",
  "key_value",
  "output",
  "gate_up",
  "down",
  "router",
  "experts",
)
TOP_K = ("top_k", "approx_top_k")
# the roles whose leaves are matrices per copy (Muon's; embedding and LM head are tables)
MATRIX_ROLES = ("query", "key_value", "output", "gate_up", "down", "router", "experts")


def _producers(prog: Program) -> dict[int, int]:
  return {o: e for e, eqn in enumerate(prog.eqns) for o in eqn.outs}


def _activation(flow: Flow, i: int) -> bool:
  return flow.dep[i] and i not in flow.views


def _linear(eqn) -> bool:
  """A ``dot_general`` that contracts something: a linear map, not an elementwise product
  (``einsum("...k,k->...k", y, scale)``, a norm's gain)."""
  return eqn.prim == "dot_general" and any(eqn.params["dimension_numbers"][0])


def projections(flow: Flow, value: int, producer: dict[int, int]) -> set[int]:
  """The leaves of the linear maps that produce ``value``: back through every eqn but a
  contracting ``dot_general``, which is the map (a leaf operand) or the end of the search."""
  todo, seen, found = [value], set(), set()
  while todo:
    i = todo.pop()
    e = producer.get(i)
    if e is None or (e, i) in seen:
      continue
    seen.add((e, i))
    eqn = flow.prog.eqns[e]
    if _linear(eqn):
      found.update(flow.views[j].leaf for j in eqn.ins if j in flow.views)
    elif rule_of(eqn.prim).identity:  # output k is input k (a barrier over q, k and v)
      todo += [eqn.ins[eqn.outs.index(i)]]
    else:
      todo += [j for j in eqn.ins if _activation(flow, j)]
  return found


def _readers(flow: Flow, value: int) -> set[int]:
  """The leaves of the first linear maps that read ``value``, forward through every eqn that
  keeps its shape or only moves its axes."""
  prog, todo, seen, found = flow.prog, [value], set(), set()
  while todo:
    i = todo.pop()
    for e in flow.consumers.get(i, ()):
      if (e, i) in seen:
        continue
      seen.add((e, i))
      eqn = prog.eqns[e]
      if _linear(eqn):
        found.update(flow.views[j].leaf for j in eqn.ins if j in flow.views)
      elif rule_of(eqn.prim).identity:
        todo += [o for j, o in zip(eqn.ins, eqn.outs) if j == i]
      elif (
        rule_of(eqn.prim).axes is not None
        or eqn.prim == "dot_general"
        or prog.shapes[eqn.outs[0]] == prog.shapes[i]
      ):
        todo += eqn.outs
  return found


def _scores(flow: Flow, e: int) -> tuple[int, int, int] | None:
  """For a product of two activations (eqn ``e``): ``(key side, values, context)`` if its
  output passes a softmax into a second product contracting the axes of one side, else None."""
  prog = flow.prog
  eqn = prog.eqns[e]
  shapes = [prog.shapes[i] for i in eqn.ins]
  sides = [set(dot_out_axis(eqn.params["dimension_numbers"], shapes, k).values()) for k in (0, 1)]
  batch = sides[0] & sides[1]
  start = eqn.outs[0]
  # per value reached: its axes holding each axis of the scores, and whether it passed an exp
  todo = [(start, {a: frozenset([a]) for a in range(len(prog.shapes[start]))}, False)]
  seen = set()
  while todo:
    i, amap, softmax = todo.pop()
    for c in flow.consumers.get(i, ()):
      if (c, i) in seen:
        continue
      seen.add((c, i))
      use, rule = prog.eqns[c], rule_of(prog.eqns[c].prim)
      k = use.ins.index(i)
      if use.prim == "dot_general":
        (lc, rc), _ = use.params["dimension_numbers"]
        contracted = {a for a, held in amap.items() for x in (lc, rc)[k] if x in held}
        for side in (0, 1):
          if softmax and contracted and contracted <= sides[side] - batch:
            return side, use.ins[1 - k], use.outs[0]
        continue
      if rule.identity:
        todo.append((use.outs[k], amap, softmax))
      elif rule.axes is not None and (k == 0 or rule.joins):
        moves = rule.axes(prog.shapes[use.ins[k]], prog.shapes[use.outs[0]], use.params)
        new = {s: frozenset(o for a in held for o in moves[a]) for s, held in amap.items()}
        todo.append((use.outs[0], new, softmax))
      elif len(use.outs) == 1 and prog.shapes[use.outs[0]] == prog.shapes[i]:
        todo.append((use.outs[0], amap, softmax or use.prim == "exp"))
  return None


def attention(flow: Flow) -> dict[str, set[int]]:
  """Query, key, value and output leaves of every attention the program computes."""
  prog, producer = flow.prog, _producers(flow.prog)
  found = collections.defaultdict(set)
  for e, eqn in enumerate(prog.eqns):
    if eqn.prim != "dot_general" or not all(_activation(flow, i) for i in eqn.ins):
      continue
    scores = _scores(flow, e)
    if scores is None:
      continue
    key, values, context = scores
    found["query"] |= projections(flow, eqn.ins[1 - key], producer)
    found["key"] |= projections(flow, eqn.ins[key], producer)
    found["value"] |= projections(flow, values, producer)
    found["output"] |= _readers(flow, context)
  return found


def routers(flow: Flow) -> tuple[set[int], set[int]]:
  """The router leaves (the linear maps feeding ``top_k``) and their numbers of experts."""
  producer, found, widths = _producers(flow.prog), set(), set()
  for eqn in flow.prog.eqns:
    if eqn.prim in TOP_K:
      found |= projections(flow, eqn.ins[0], producer)
      widths.add(flow.prog.shapes[eqn.ins[0]][-1])
  return found, widths


def _lead(flow: Flow, leaf: int, view, widths: set[int]) -> int | None:
  """The expert axis a matrix ``leaf`` may have: its first axis no scan slices, one of ``widths``
  long, with two more after it."""
  shape = flow.prog.shapes[flow.prog.leaf_ids[leaf]]
  rest = [a for a in range(len(shape)) if a not in view.consumed]
  return rest[0] if len(rest) >= 3 and shape[rest[0]] in widths else None


def _carried(flow: Flow, seeds: dict[int, set[int]]) -> dict[int, set[int]]:
  """Value -> its axes that hold an expert axis, forward from ``seeds`` (the outputs of the
  expert matmuls) through axis moves, elementwise maps and the free and batch axes of products
  (the routing weights')."""
  prog, held = flow.prog, collections.defaultdict(set, seeds)
  for eqn in prog.eqns[min((_producers(prog)[v] for v in seeds), default=len(prog.eqns)) :]:
    for k, i in enumerate(eqn.ins):
      if not held.get(i):
        continue
      rule = rule_of(eqn.prim)
      if rule.identity:
        held[eqn.outs[k]] |= held[i]
      elif rule.axes is not None and (k == 0 or rule.joins):
        moves = rule.axes(prog.shapes[i], prog.shapes[eqn.outs[0]], eqn.params)
        held[eqn.outs[0]] |= {o for a in held[i] for o in moves[a]}
      elif eqn.prim == "dot_general":
        out = dot_out_axis(eqn.params["dimension_numbers"], [prog.shapes[j] for j in eqn.ins], k)
        held[eqn.outs[0]] |= {out[a] for a in held[i] if a in out}
      elif len(eqn.outs) == 1 and prog.shapes[eqn.outs[0]] == prog.shapes[i]:
        held[eqn.outs[0]] |= held[i]
  return held


def experts(flow: Flow, widths: set[int]) -> dict[int, int]:
  """Leaf -> its expert axis: a leading axis (one of ``widths`` long) of a matrix that indexes
  copies, each its own map: a matmul reads it without contracting it, or it is gathered by
  indices the parameters compute (a router's choices), or it is the group axis of a
  ``ragged_dot`` (rows grouped by the router's counts), or a matmul contracts it against an
  expert axis another expert matmul produced (the down projection summing the experts'
  outputs, weighted by the router, in one product)."""
  prog, found, seeds, later = flow.prog, {}, collections.defaultdict(set), []
  for leaf, uses in flow.uses.items():
    for use in uses:
      eqn, view = prog.eqns[use.eqn], use.view
      lead = _lead(flow, leaf, view, widths)
      if lead is None:
        continue
      axes = [a for a, held in enumerate(view.axes) if lead in held]
      if eqn.prim == "dot_general":
        (lc, rc), _ = eqn.params["dimension_numbers"]
        if axes and not set(axes) & set((lc, rc)[use.operand]):
          found[leaf] = lead
          out = dot_out_axis(
            eqn.params["dimension_numbers"], [prog.shapes[j] for j in eqn.ins], use.operand
          )
          seeds[eqn.outs[0]] |= {out[a] for a in axes}
        elif axes:
          later.append((leaf, lead, use, axes))
      elif eqn.prim == "gather" and use.operand == 0 and flow.dep[eqn.ins[1]]:
        found[leaf] = lead
      elif (
        eqn.prim == "ragged_dot_general"
        and use.operand == 1
        and flow.dep[eqn.ins[2]]
        and set(axes) & set(eqn.params["ragged_groups"])
      ):
        found[leaf] = lead
  held = _carried(flow, seeds)
  for leaf, lead, use, axes in later:
    eqn = prog.eqns[use.eqn]
    contract = eqn.params["dimension_numbers"][0]
    mine, theirs = contract[use.operand], contract[1 - use.operand]
    partners = {theirs[mine.index(a)] for a in axes if a in mine}  # the other side's axes
    if partners & held.get(eqn.ins[1 - use.operand], set()):
      found[leaf] = lead
  return found


def embeddings(flow: Flow) -> set[int]:
  """Leaves gathered by indices that come from the model's inputs and no parameter."""
  prog = flow.prog
  inputs = set(prog.input_ids)
  found = set()
  for eqn in prog.eqns:
    if any(i in inputs for i in eqn.ins):
      inputs.update(eqn.outs)
      index = eqn.ins[1] if len(eqn.ins) > 1 else None
      if eqn.prim == "gather" and eqn.ins[0] in flow.views and index in inputs:
        if not flow.dep[index]:
          found.add(flow.views[eqn.ins[0]].leaf)
  return found


def heads(flow: Flow) -> set[int]:
  """Leaves of the linear maps that produce an output, through axis moves and bias sums."""
  prog: Program = flow.prog
  producer = _producers(prog)
  todo, found, seen = list(prog.outputs), set(), set()
  while todo:
    e = producer.get(todo.pop())
    if e is None or e in seen:
      continue
    seen.add(e)
    eqn, rule = prog.eqns[e], rule_of(prog.eqns[e].prim)
    if eqn.prim == "dot_general":
      found.update(flow.views[i].leaf for i in eqn.ins if i in flow.views)
    elif rule.axes is not None or rule.additive:
      todo += [i for i in eqn.ins if flow.dep[i] and i not in flow.views]
  return found


def _cover(names: list[str], wanted: set[str]) -> tuple[str, ...]:
  """Path patterns that match exactly ``wanted`` among ``names``: each its shortest suffix that
  matches nothing else (``wq`` for every layer's ``.../attention/wq``)."""
  out = []
  for name in (n for n in names if n in wanted):
    segs = name.split("/")
    pattern = next(
      (
        p
        for p in ("/".join(segs[-k:]) for k in range(1, len(segs)))
        if all(m in wanted for m in names if paths.match(p, m) is not None)
      ),
      name,
    )
    if pattern not in out:
      out.append(pattern)
  return tuple(out)


def roles(
  analysis: Analysis,
  names: list[str],
  shapes: list[tuple[int, ...]],
  confirmed: list[list[Candidate]],
) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[int, ...]]]:
  """Role -> path patterns, as ``equivariant.symmetry_compatible(patterns=...)`` takes them:
  attention, router, experts, embedding and LM head from the jaxpr's structure; the MLP's
  up/gate/down from the pairs found (stacked copies that no scan made: experts). And the copy
  axes of each leaf of a matrix role that has some (path -> positions): the axes a scan slices
  (layers, wherever they sit) and an expert's expert axis."""
  flow = analysis.flow
  fused = {u.leaf for u in analysis.units if u.part is not None}  # no one role for the leaf
  leaves = collections.defaultdict(set)
  router, widths = routers(flow)
  leaves["router"] = router
  expert_axes = experts(flow, widths)
  leaves["experts"] = set(expert_axes)
  # each leaf's copy axes: those a scan slices (layers), and an expert's expert axis
  copied = collections.defaultdict(set)
  for leaf, uses in flow.uses.items():
    copied[leaf].update(a for u in uses for a in u.view.consumed)
  for leaf, axis in expert_axes.items():
    copied[leaf].add(axis)
  found = attention(flow)
  leaves["query"] = found["query"]
  leaves["key_value"] = found["key"] | found["value"]
  leaves["output"] = found["output"]
  for insts in confirmed:
    for inst in insts:
      if inst.name not in _MLP:
        continue
      a, b = (
        [unit for unit, _ in side if analysis.units[unit].part is None] for side in (inst.a, inst.b)
      )
      if inst.name in (
        "gated MLP up/down",
        "expert up/down",
      ):  # the gate: the other factor of up's product
        a += [
          g
          for leaf in a
          for glu in analysis.gates_of[leaf]
          for g in analysis.gated[glu]
          if g != leaf and len(shapes[g]) - len(copy_axes(inst.stacked)) >= 2
        ]
      scanned = min(len(u.view.consumed) for leaf in a for u in analysis.uses[leaf]) if a else 0
      copies = len(copy_axes(inst.stacked))
      found_roles = ("experts", "experts") if copies > scanned else _MLP[inst.name]
      for role, side in zip(found_roles, (a, b)):
        leaves[role].update(side)
        if role == "experts":
          for leaf in side:
            copied[leaf].update(copy_axes(inst.stacked))
  matrices = {x for x in range(len(names)) if len(shapes[x]) >= 2 and x not in fused}
  taken = set()
  for role in ("router", "experts", "query", "key_value", "output", "gate_up", "down"):
    leaves[role] = (leaves[role] & matrices) - taken
    taken |= leaves[role]
  leaves["embedding"] = {x for x in embeddings(flow) if len(shapes[x]) == 2} - taken
  leaves["lm_head"] = {x for x in heads(flow) if len(shapes[x]) == 2} - taken - leaves["embedding"]
  patterns = {r: _cover(names, {names[x] for x in leaves[r]}) for r in ORDER if leaves[r]}
  copies = {names[x]: tuple(sorted(copied[x])) for r in MATRIX_ROLES for x in leaves[r]}
  return patterns, {n: c for n, c in sorted(copies.items()) if c}
