"""The state leaves an optimizer computes alike, read off its jaxprs.

An unrolled model repeats each layer's leaves, and an optax optimizer computes the state of
each by the same program from that leaf's parameter and gradient. :func:`classes` finds the
state leaves that share a class: their whole histories (``init``, then any number of
``update`` steps) are the same equations, with the same parameters and constants, applied to
one parameter leaf each (and to values every leaf shares: a step count, a learning rate), whose
shapes, dtypes and multipliers under the pairs (its *layout*) agree, at the same place of
their parameters' trees inside the state. Such leaves have one transport degree, so the degree
probe (:mod:`saggs_jax._src.degrees`) runs one leaf of each class, and :func:`reduced` cuts the
probe's program down to it: its cost no longer grows with the layers.

Equality is structural and exact (interned keys, no hashes): an equation's key is its
primitive, its parameters (sub-jaxprs by their text and their constants' values) and the
keys of its inputs, and a state leaf's class is refined step by step until no class splits
(a history of any length then agrees). A leaf whose history reads more than one parameter
leaf (a global norm), or none, is a class of its own: nothing is shared on a guess.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
from jax.extend import core as jcore

from saggs_jax._src import jaxpr_params

SMALL = 4096
"""Constants of up to this many entries are compared by value; larger ones by identity."""


def _const_key(x: Any) -> Hashable:
  a = np.asarray(x) if np.size(x) <= SMALL else None
  if a is None:
    return ("id", id(x))
  return ("value", a.dtype.str, a.shape, a.tobytes())


def _jaxpr_key(closed: Any, memo: dict) -> Hashable:
  """A sub-jaxpr's text with the values of its constants (its text shows only their names),
  and those of the sub-jaxprs in its equations."""
  key = memo.get(id(closed))
  if key is None:
    jaxpr = getattr(closed, "jaxpr", closed)
    consts = tuple(_const_key(c) for c in getattr(closed, "consts", ()))
    inner = tuple(_jaxpr_key(s, memo) for e in jaxpr.eqns for s in _subjaxprs(e.params))
    key = memo[id(closed)] = (str(jaxpr), consts, inner)
  return key


def _subjaxprs(params: dict) -> list:
  found = []
  for v in params.values():
    for x in v if isinstance(v, (tuple, list)) else (v,):
      if isinstance(getattr(x, "jaxpr", x), jcore.Jaxpr):  # open or closed
        found.append(x)
  return found


def _params_key(eqn: Any, memo: dict) -> Hashable:
  items = []
  for name, v in sorted(eqn.params.items()):
    subs = () if isinstance(v, (bool, int, float, str)) else _subjaxprs({name: v})
    items.append((name, tuple(_jaxpr_key(s, memo) for s in subs) if subs else repr(v)))
  return tuple(items)


def _literal_key(atom: Any) -> Hashable | None:
  """A literal input by its type and value (its repr is slow); None for a variable."""
  return (atom.aval, _const_key(atom.val)) if isinstance(atom, jcore.Literal) else None


class Program:
  """A closed jaxpr's equations keyed once, evaluated on its inputs' keys (:meth:`keys`) or
  on their dependency bitsets (:meth:`reads`)."""

  def __init__(self, closed: Any):
    self.jaxpr = closed.jaxpr
    memo: dict = {}
    self.static = [  # what does not depend on an equation's inputs
      (e.primitive.name, _params_key(e, memo), tuple(o.aval for o in e.outvars))
      for e in self.jaxpr.eqns
    ]
    self.literals = [tuple(map(_literal_key, e.invars)) for e in self.jaxpr.eqns]
    self.out_literals = tuple(map(_literal_key, self.jaxpr.outvars))
    self.consts = [("const", _const_key(c)) for c in closed.consts]

  def _run(self, inputs: Sequence, consts: Sequence, combine, literal) -> list:
    env = dict(zip(self.jaxpr.constvars, consts))
    env.update(zip(self.jaxpr.invars, inputs))

    def read(atom, lit):
      return env[atom] if lit is None else literal(lit)

    for eqn, static, lits in zip(self.jaxpr.eqns, self.static, self.literals):
      ins = tuple(map(read, eqn.invars, lits))
      for n, var in enumerate(eqn.outvars):
        env[var] = combine(static, ins, n)
    return list(map(read, self.jaxpr.outvars, self.out_literals))

  def keys(self, inputs: Sequence[int], intern: dict) -> list[int]:
    """The interned key of each output, from the keys of the inputs."""

    def combine(static, ins, n):
      return intern.setdefault((static, ins, n), len(intern))

    def literal(key):
      return intern.setdefault(("literal", key), len(intern))

    consts = [intern.setdefault(c, len(intern)) for c in self.consts]
    return self._run(inputs, consts, combine, literal)

  def reads(self, inputs: Sequence[int]) -> list[int]:
    """The inputs each output depends on, as bitsets, from each input's own bitset."""

    def combine(static, ins, n):
      out = 0
      for x in ins:
        out |= x
      return out

    return self._run(inputs, [0] * len(self.consts), combine, lambda key: 0)


def classes(
  init: Program,
  update: Program,
  extra: tuple[int, int],
  leaves: Sequence[Hashable],
  places: Sequence[tuple[Hashable, int] | None],
) -> list[int]:
  """The representative of each state leaf: the first leaf of its class (see the module doc).

  Args:
    init: the program of ``params -> state leaves``.
    update: the program of ``(grads, state, params) -> state leaves``.
    extra: how many inputs lead each jaxpr (values closed over from a trace outside).
    leaves: each parameter leaf's layout (shape, dtype, multipliers), hashable.
    places: for each state leaf, ``(where, i)``: its place in the state with the path of
      parameter leaf ``i`` taken off its end, and that ``i``; None for a leaf at no
      parameter's path.
  """
  n, m = len(leaves), len(places)
  start, step = init, update
  # Dependencies: bit i for parameter (and gradient) leaf i; state leaf j as bit n + j.
  leaf_bits = [1 << i for i in range(n)]
  state_bits = [1 << (n + j) for j in range(m)]
  init_reads = start.reads([0] * extra[0] + leaf_bits)
  step_reads = step.reads([0] * extra[1] + leaf_bits + state_bits + leaf_bits)
  mask = (1 << n) - 1
  reads = [(a | b) & mask for a, b in zip(init_reads, step_reads)]
  states = [b >> n for b in step_reads]
  changed = True
  while changed:  # through any number of steps: a leaf reads what the states it reads read
    changed = False
    for j in range(m):
      total = reads[j]
      for k in _bits(states[j]):
        total |= reads[k]
      if total != reads[j]:
        reads[j], changed = total, True

  intern: dict = {}
  own = [intern.setdefault(("leaf", key), len(intern)) for key in leaves]
  grads = [intern.setdefault(("grad", key), len(intern)) for key in leaves]
  shared = [intern.setdefault(("outer", k), len(intern)) for k in range(max(extra))]
  colors = start.keys(shared[: extra[0]] + own, intern)
  while True:  # refine until no class splits: then histories of every length agree
    after = step.keys(shared[: extra[1]] + grads + colors + own, intern)
    refined = [intern.setdefault(("state", c, a), len(intern)) for c, a in zip(colors, after)]
    if len(set(refined)) == len(set(colors)):
      break
    colors = refined

  first: dict = {}
  out = []
  for j, (color, place) in enumerate(zip(colors, places)):
    read = list(_bits(reads[j]))
    if place is None or read != [place[1]]:
      out.append(j)  # reads several leaves, none, or not the one at its path
      continue
    out.append(first.setdefault((color, place[0], leaves[place[1]]), j))
  return out


def _bits(x: int):
  """The positions of the set bits of ``x``, lowest first."""
  while x:
    low = x & -x
    yield low.bit_length() - 1
    x ^= low


def closure(update: Program, extra: int, n: int, kept: Sequence[int]) -> list[int]:
  """``kept`` with every state leaf their updates read, through any number of steps."""
  bits = [1 << j for j in range(len(update.jaxpr.outvars))]
  reads = update.reads([0] * (extra + n) + bits + [0] * n)
  out, todo = set(kept), list(kept)
  while todo:
    for k in _bits(reads[todo.pop()]):
      if k not in out:
        out.add(k)
        todo.append(k)
  return sorted(out)


def reduced(closed: Any, outputs: Sequence[int]) -> tuple[Any, list[int]]:
  """``closed`` cut down to the outputs at ``outputs``, the equations they need (and those
  with effects) and the inputs those read; and the positions of those inputs."""
  jaxpr = closed.jaxpr
  outvars = [jaxpr.outvars[k] for k in outputs]
  needed = {v for v in outvars if not isinstance(v, jcore.Literal)}
  eqns = []
  for eqn in reversed(jaxpr.eqns):
    if eqn.effects or any(v in needed for v in eqn.outvars):
      eqns.append(eqn)
      needed.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
  used = [k for k, v in enumerate(jaxpr.invars) if v in needed]
  new = jaxpr_params.replaced(
    closed,
    invars=[jaxpr.invars[k] for k in used],
    outvars=outvars,
    eqns=eqns[::-1],
    debug_info=jaxpr.debug_info.with_unknown_names(),  # its names were the full program's
  )
  return new, used
