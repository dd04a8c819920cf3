"""Declarations: confirmed instances as the fewest Pairs, rejections, and update-rule roles.

Path patterns are relative to each instance's enclosing module, with layer
numbers as wildcards, so one :class:`~saggs_jax.Pair` covers every layer.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Sequence

import numpy as np

from saggs_jax import paths
from saggs_jax.discovery.candidates import Analysis, Candidate, Part, Rejection, Unit
from saggs_jax.discovery.program import Program
from saggs_jax.discovery.propagation import Flow, rule_of
from saggs_jax.discovery.result import Rejected
from saggs_jax.pairs import Block, Pair


def patterns(names: list[str], extra: int) -> list[str]:
  """``names`` without the leading segments they share (their enclosing module) but ``extra``
  of them, whose numbers become wildcards (``layers/0`` -> ``layers/*``, ``h_1`` -> ``h_*``)."""
  segs = [n.split("/") for n in names]
  k = 0
  while all(len(s) > k + 1 for s in segs) and len({s[k] for s in segs}) == 1:
    k += 1
  k = max(k - extra, 0)
  return [
    "/".join([re.sub(r"\d+", "*", x) for x in s[k : k + extra]] + s[k + extra :]) for s in segs
  ]


def _one(x: Sequence):
  return x[0] if len(x) == 1 else tuple(x)


def _sides(inst: Candidate) -> tuple[list[tuple[int, int]], ...]:
  return inst.a, inst.b, inst.follow_a, inst.follow_b


def declare(
  units: list[Unit],
  names: list[str],
  shapes: list[tuple[int, ...]],
  instances: list[Candidate],
  groups: int,
) -> list[Pair]:
  """The fewest Pairs whose patterns resolve to exactly ``instances`` (by unit: ``units``,
  ``names`` and ``shapes`` of :class:`~saggs_jax.discovery.candidates.Analysis`)."""
  first = instances[0]
  leaf_names = [names[leaf] for leaf, part in units if part is None]
  sizes = [shapes[unit][axis] for unit, axis in first.a + first.b]

  def pair(pats: list[str], inst: Candidate) -> Pair:
    cut = np.cumsum([0] + [len(s) for s in _sides(first)])
    specs = [
      _as_block(p, units[u].part, inst.stacked)
      for p, (u, _) in zip(pats, [m for side in _sides(inst) for m in side])
    ]
    a, b, fa, fb = (specs[cut[i] : cut[i + 1]] for i in range(4))
    axes = tuple(_one(tuple(axis - inst.stacked for _, axis in side)) for side in (inst.a, inst.b))
    axes = tuple(x if isinstance(x, int) or len(set(x)) > 1 else x[0] for x in axes)
    name = inst.name + (" (positive factors)" if inst.positive else "")
    return Pair(
      _one(a),
      _one(b),
      axes=axes,  # type: ignore[arg-type]
      groups=None if all(n == groups for n in sizes) else groups,
      stacked=inst.stacked,
      follow_a=tuple(fa),
      follow_b=tuple(fb),
      name=name,
    )

  def members(inst: Candidate) -> list[str]:
    return [names[unit] for side in _sides(inst) for unit, _ in side]

  wanted = [set(column) for column in zip(*map(members, instances))]
  for extra in range(max(n.count("/") for n in members(first)) + 1):
    pats = patterns(members(first), extra)
    if all(patterns(members(i), extra) == pats for i in instances) and all(
      {n for n in leaf_names if paths.match(p, n) is not None} == w for p, w in zip(pats, wanted)
    ):
      return [pair(pats, first)]
  return [pair(members(i), i) for i in instances]


def _as_block(pattern: str, part: Part | None, stacked: int) -> str | Block:
  """``pattern`` as a :class:`~saggs_jax.Block` if the unit is one."""
  if part is None:
    return pattern
  sizes = [hi - lo for lo, hi in part.bounds]
  return Block(
    pattern,
    axis=part.axis - stacked,
    parts=len(part.bounds),
    part=part.bounds.index((part.lo, part.hi)),
    sizes=None if len(set(sizes)) == 1 else tuple(sizes),
  )


def key(units: list[Unit], names: list[str], inst: Candidate) -> tuple:
  """What instances of one candidate share: they are confirmed and declared together."""
  members = [u for side in _sides(inst) for u, _ in side]
  rel = patterns([names[u] for u in members], 0)
  return (
    inst.name,
    tuple(rel),
    tuple(units[u].part for u in members),
    tuple(len(s) for s in _sides(inst)),
    tuple(axis - inst.stacked for _, axis in inst.a + inst.b),
    inst.stacked,
  )


def rejected(rejections: list[Rejection]) -> list[Rejected]:
  """Each rejection once, its labels relative to the enclosing module."""
  out: dict[Rejected, None] = {}
  for a, b, reason in rejections:
    rel = patterns(a + b, 0)
    out[Rejected(_one(tuple(rel[: len(a)])), _one(tuple(rel[len(a) :])), reason)] = None
  return list(out)


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


def _embeddings(flow: Flow) -> set[int]:
  """Leaves read by a gather whose indices come from the model's inputs (token embeddings)."""
  prog = flow.prog
  inputs = set(prog.input_ids)
  found = set()
  for eqn in prog.eqns:
    if any(i in inputs for i in eqn.ins):
      inputs.update(eqn.outs)
      if eqn.prim == "gather" and eqn.ins[0] in flow.views and eqn.ins[1] in inputs:
        found.add(flow.views[eqn.ins[0]].leaf)
  return found


def _heads(flow: Flow) -> set[int]:
  """Leaves of the linear maps that produce an output, through axis moves and bias sums."""
  prog: Program = flow.prog
  producer = {o: e for e, eqn in enumerate(prog.eqns) for o in eqn.outs}
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


# The roles of equivariant.symmetry_compatible each found pair assigns to its sides.
_ROLES = {
  "attention Q/K": ("query", "key_value"),
  "attention V/O": ("key_value", "output"),
  "gated MLP up/down": ("gate_up", "down"),
  "ReLU MLP up/down": ("gate_up", "down"),
}


def roles(
  analysis: Analysis,
  names: list[str],
  shapes: list[tuple[int, ...]],
  confirmed: list[list[Candidate]],
) -> dict[str, tuple[str, ...]]:
  """Role -> path patterns, as ``equivariant.symmetry_compatible(patterns=...)`` takes them:
  attention and MLP matrices from the pairs found (a GLU's gate from the jaxpr, stacked MLP
  copies that no scan made as experts), the embedding and the LM head from the jaxpr."""
  leaves = collections.defaultdict(set)
  for insts in confirmed:
    for inst in insts:
      if inst.name not in _ROLES:
        continue
      a, b = (
        [
          unit
          for unit, _ in side  # a fused leaf's block: no one role for the leaf
          if analysis.units[unit].part is None and len(shapes[unit]) - inst.stacked >= 2
        ]
        for side in (inst.a, inst.b)
      )
      if inst.name == "gated MLP up/down":  # the gate: the other factor of up's product
        a += [
          g
          for leaf in a
          for glu in analysis.gates_of[leaf]
          for g in analysis.gated[glu]
          if g != leaf and len(shapes[g]) - inst.stacked >= 2
        ]
      scanned = min(u.view.consumed for leaf in a for u in analysis.uses[leaf]) if a else 0
      found = ("experts", "experts") if inst.stacked > scanned else _ROLES[inst.name]
      for role, side in zip(found, (a, b)):
        leaves[role].update(side)
  taken = set().union(*leaves.values())
  leaves["embedding"] = {x for x in _embeddings(analysis.flow) if len(shapes[x]) == 2} - taken
  leaves["lm_head"] = (
    {x for x in _heads(analysis.flow) if len(shapes[x]) == 2} - taken - leaves["embedding"]
  )
  order = ("embedding", "lm_head", "query", "key_value", "output", "gate_up", "down", "experts")
  return {r: _cover(names, {names[x] for x in leaves[r]}) for r in order if leaves[r]}
