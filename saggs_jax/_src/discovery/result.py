"""The result of :func:`~saggs_jax.discover`: the pairs found, and what was rejected."""

from __future__ import annotations

import collections.abc
from collections.abc import Sequence
from types import MappingProxyType
from typing import NamedTuple, cast

from saggs_jax._src.equivariant.roles import role_dimension_numbers
from saggs_jax._src.pairs import Pair, Spec


class Rejected(NamedTuple):
  """A rescaling that is no exact symmetry: ``a`` against ``b``, and why."""

  a: str | tuple[str, ...]
  b: str | tuple[str, ...]
  reason: str


# How the pairs were confirmed (``Discovery.confirmation``), as the report says it.
CONFIRMATIONS = MappingProxyType(
  {
    "parameters": (
      "numerically, on the given parameters and example inputs (finite moves and first order)"
    ),
    "parameters, finite only": (
      "numerically, on the given parameters and example inputs, finite moves only (the model"
      " cannot be differentiated forward: a custom_vjp function)"
    ),
    "reduced": (
      "numerically, on a width-reduced copy of the model (reduced=), each pair at the grouping"
      " of the same rank"
    ),
    "none": "not checked (abstract parameters): no pair is confirmed",
  }
)


class Discovery(collections.abc.Sequence):
  """What :func:`~saggs_jax.discover` found: a sequence of :class:`~saggs_jax.Pair`, and what it rejected.

  Pass it wherever pairs go (``saggs.saggs(discovery)``, ``saggs.describe``,
  ``saggs.check_symmetry``). ``repr`` is Python that rebuilds it;
  :meth:`report` is a readable summary. ``roles`` maps the roles of
  :func:`saggs_jax.equivariant.symmetry_compatible` to path patterns
  (``patterns=discovery.roles`` routes a model of any naming). ``confirmation`` says how the
  pairs were checked, one of :data:`CONFIRMATIONS`: ``"parameters"`` (on the given parameters
  and example inputs), ``"parameters, finite only"``, ``"reduced"`` (on a width-reduced copy
  of an abstract model), or ``"none"`` (the parameters were abstract: nothing is confirmed,
  every candidate is in ``rejected``). ``copy_axes`` maps the path of every matrix of
  ``roles`` that has copy axes to their positions, read from the program: the axes a scan
  slices (layers, wherever they sit: MaxText's at 1) and an expert's expert axis.
  """

  def __init__(
    self,
    pairs: Sequence[Pair] = (),
    rejected: Sequence[Rejected] = (),
    roles: dict[str, tuple[str, ...]] | None = None,
    confirmation: str = "parameters",
    copy_axes: dict[str, tuple[int, ...]] | None = None,
  ):
    if confirmation not in CONFIRMATIONS:
      raise ValueError(f"confirmation must be one of {list(CONFIRMATIONS)}, got {confirmation!r}.")
    self.pairs, self.rejected, self.roles = tuple(pairs), tuple(rejected), dict(roles or {})
    self.confirmation = confirmation
    self.copy_axes = {path: tuple(axes) for path, axes in (copy_axes or {}).items()}

  def __getitem__(self, i):
    return self.pairs[i]

  def __len__(self):
    return len(self.pairs)

  def __eq__(self, other):
    return (
      isinstance(other, Discovery)
      and self.pairs == other.pairs
      and self.rejected == other.rejected
      and self.roles == other.roles
      and self.confirmation == other.confirmation
      and self.copy_axes == other.copy_axes
    )

  def __repr__(self):
    def block(items):
      return "".join(f"\n    {x!r}," for x in items) + ("\n" if items else "")

    roles = f", roles={self.roles!r}" if self.roles else ""
    copies = f", copy_axes={self.copy_axes!r}" if self.copy_axes else ""
    return (
      f"Discovery(pairs=[{block(self.pairs)}], rejected=[{block(self.rejected)}]{roles},"
      f" confirmation={self.confirmation!r}{copies})"
    )

  def report(self) -> str:
    """Found and rejected symmetries, one line each."""

    def side(p: Pair, k: int) -> str:  # a side's patterns (names or Blocks) with their axes
      return ", ".join(
        f"{n!r} ({'whole' if a is None else f'axis {a}'})"
        for n, a in zip(p.patterns(k), p.side_axes(k))
      )

    lines = [f"Found {len(self.pairs)} symmetr{'y' if len(self.pairs) == 1 else 'ies'}:"]
    for p in self.pairs:
      extra = [f"{p.groups} groups"] if p.groups else []
      extra += [f"stacked={p.stacked}"] if p.stacked else []
      extra += [f"bias {', '.join(map(repr, _followers(p)))}"] if (p.follow_a or p.follow_b) else []
      lines.append(
        f"  {p.label}: {side(p, 0)} x c  against  {side(p, 1)}"
        f" x 1/c{'; ' + ', '.join(extra) if extra else ''}"
      )
    lines.append(f"Rejected {len(self.rejected)}:")
    lines += [f"  {r.a!r} against {r.b!r}: {r.reason}" for r in self.rejected]
    lines.append(f"Confirmation: {CONFIRMATIONS[self.confirmation]}.")
    return "\n".join(lines)

  __str__ = report

  def muon_dimension_numbers(self, params):
    """The ``optax.contrib.muon`` tree of ``MuonDimensionNumbers`` for the matrices of
    :attr:`roles`, ``None`` elsewhere (see :func:`saggs_jax.equivariant.role_dimension_numbers`):
    each kernel's :attr:`copy_axes` batched, its other axes its inputs and outputs."""
    return role_dimension_numbers(params, self.roles, copy_axes=self.copy_axes)


def _followers(pair: Pair) -> tuple[Spec, ...]:
  """``pair``'s followers (a Pair holds them as tuples)."""
  return cast("tuple[Spec, ...]", pair.follow_a) + cast("tuple[Spec, ...]", pair.follow_b)
