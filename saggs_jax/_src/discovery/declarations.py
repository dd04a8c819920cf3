"""Declarations: confirmed instances as the fewest Pairs, and rejections.

Path patterns are relative to each instance's enclosing module, with layer
numbers as wildcards, so one :class:`~saggs_jax.Pair` covers every layer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from saggs_jax._src import paths
from saggs_jax._src.discovery.candidates import Candidate, Part, Rejection, Stacked, Unit, relative
from saggs_jax._src.discovery.result import Rejected
from saggs_jax._src.pairs import Block, Pair


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
  ``names`` and ``shapes`` of :class:`~saggs_jax._src.discovery.candidates.Analysis`)."""
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
    axes = tuple(
      _one(tuple(relative(axis, inst.stacked) for _, axis in side)) for side in (inst.a, inst.b)
    )
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


def _as_block(pattern: str, part: Part | None, stacked: Stacked) -> str | Block:
  """``pattern`` as a :class:`~saggs_jax.Block` if the unit is one."""
  if part is None:
    return pattern
  sizes = [hi - lo for lo, hi in part.bounds]
  return Block(
    pattern,
    axis=relative(part.axis, stacked),
    parts=len(part.bounds),
    part=part.bounds.index((part.lo, part.hi)),
    sizes=None if len(set(sizes)) == 1 else tuple(sizes),
  )


def key(
  units: list[Unit], names: list[str], shapes: list[tuple[int, ...]], inst: Candidate
) -> tuple:
  """What instances of one candidate share: they are confirmed and declared together. Their
  members' shapes are part of it: one relative pattern may name parameters of other widths
  (a dense MLP and a narrower shared expert), which group and declare apart."""
  members = [u for side in _sides(inst) for u, _ in side]
  rel = patterns([names[u] for u in members], 0)
  return (
    inst.name,
    tuple(rel),
    tuple(units[u].part for u in members),
    tuple(len(s) for s in _sides(inst)),
    tuple(relative(axis, inst.stacked) for _, axis in inst.a + inst.b),
    inst.stacked,
    tuple(shapes[u] for u in members),
  )


def rejected(rejections: list[Rejection]) -> list[Rejected]:
  """Each rejection once, its labels relative to the enclosing module."""
  out: dict[Rejected, None] = {}
  for a, b, reason in rejections:
    rel = patterns(a + b, 0)
    out[Rejected(_one(tuple(rel[: len(a)])), _one(tuple(rel[len(a) :])), reason)] = None
  return list(out)
