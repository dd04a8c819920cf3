"""The jaxpr equation parameters the library reads, in one place for every supported JAX.

JAX renames equation parameters between releases: jax 0.11 replaced ``scan``'s
``num_consts``/``num_carry`` with ``ft_in`` (the flat trees of consts, carry and
``xs``) and hands sub-jaxprs over open, their constants hoisted to inputs. Every
read of a parameter goes through this module, so a jax that renames one fails
here, naming the primitive, the parameter and the jax version, not with a
KeyError deep in :func:`saggs_jax.discover`.

:data:`READS` lists, per primitive, the parameters the discovery's rules read;
``tests/test_jaxpr_params.py`` checks them, and every structural reader below,
against the jaxprs of the running jax.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
from jax.extend import core as jcore

READS = MappingProxyType(
  {
    "transpose": ("permutation",),
    "broadcast_in_dim": ("broadcast_dimensions",),
    "squeeze": ("dimensions",),
    "split": ("axis", "sizes"),
    "slice": ("start_indices", "limit_indices", "strides"),
    "dot_general": ("dimension_numbers",),
    "gather": ("dimension_numbers", "slice_sizes"),
    "ragged_dot_general": ("ragged_dot_dimension_numbers",),  # an MoE's grouped matmul
    "unstack": ("axis",),  # jax >= 0.12
    **{p: ("axes",) for p in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod")},
    **{p: ("axes",) for p in ("argmax", "argmin")},
  }
)
"""Per primitive, the parameters the discovery reads (``check`` looks for them)."""

CALLS = MappingProxyType(
  {
    "jit": "jaxpr",
    "remat2": "jaxpr",  # jax.checkpoint / jax.remat
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "shard_map": "jaxpr",
  }
)
"""Call-like primitives inlined by the discovery, and the parameter that holds the body."""


def _missing(eqn: jcore.JaxprEqn, name: str) -> KeyError:
  return KeyError(
    f"saggs_jax does not know the {eqn.primitive.name!r} equations of jax {jax.__version__}:"
    f" they lack {name!r}, and have {sorted(eqn.params)}. Please report it with your jax version."
  )


def param(eqn: jcore.JaxprEqn, name: str) -> Any:
  """``eqn.params[name]``, or an error naming the primitive, the parameter and jax."""
  try:
    return eqn.params[name]
  except KeyError:
    raise _missing(eqn, name) from None


def check(eqn: jcore.JaxprEqn) -> None:
  """Raises the error of :func:`param` if ``eqn`` lacks a parameter in :data:`READS`."""
  for name in READS.get(eqn.primitive.name, ()):
    param(eqn, name)


def opened(jaxpr: Any) -> tuple[jcore.Jaxpr, Sequence[Any]]:
  """A jaxpr and its constants: a ``ClosedJaxpr``'s, or an open one's (none). Read by
  attribute: jax 0.12 folds ``ClosedJaxpr`` into ``Jaxpr``, which then has both."""
  return getattr(jaxpr, "jaxpr", jaxpr), getattr(jaxpr, "consts", ())


def replaced(closed: Any, **changes: Any) -> Any:
  """``closed`` (a ``ClosedJaxpr``, or jax 0.12's ``Jaxpr`` that holds its constants) with
  fields of its jaxpr replaced, its constants kept."""
  jaxpr = closed.jaxpr.replace(**changes)
  return jaxpr if closed.jaxpr is closed else closed.replace(jaxpr=jaxpr)


def call_body(eqn: jcore.JaxprEqn) -> tuple[jcore.Jaxpr, Sequence[Any]] | None:
  """The body of a call-like equation (:data:`CALLS`) that takes the equation's inputs, or
  None for any other equation."""
  name = CALLS.get(eqn.primitive.name)
  if name is None:
    return None
  body, consts = opened(param(eqn, name))
  return (body, consts) if len(body.invars) == len(eqn.invars) else None


class Scan(NamedTuple):
  """A ``scan`` equation read: its inputs are ``consts + carry + xs``."""

  body: jcore.Jaxpr
  consts: Sequence[Any]  # the body's own constants
  num_consts: int
  num_carry: int


def scan(eqn: jcore.JaxprEqn) -> Scan:
  """The body and the input counts of a ``scan`` equation."""
  body, consts = opened(param(eqn, "jaxpr"))
  if "ft_in" in eqn.params:  # jax >= 0.11: a tuple of flat trees, (consts, carry, xs)
    consts_tree, carry_tree, _ = eqn.params["ft_in"].unpack()
    num_consts, num_carry = len(consts_tree), len(carry_tree)
  else:
    num_consts, num_carry = param(eqn, "num_consts"), param(eqn, "num_carry")
  return Scan(body, consts, num_consts, num_carry)


def cond_branches(eqn: jcore.JaxprEqn) -> list[tuple[jcore.Jaxpr, Sequence[Any]]]:
  """The branches of a ``cond`` equation (its inputs: the index, then the operands)."""
  return [opened(b) for b in param(eqn, "branches")]


class Gather(NamedTuple):
  """A ``gather`` equation's dimension numbers and slice sizes (``jax.lax.GatherDimensionNumbers``)."""

  offset_dims: tuple[int, ...]
  collapsed_slice_dims: tuple[int, ...]
  start_index_map: tuple[int, ...]
  operand_batching_dims: tuple[int, ...]
  slice_sizes: tuple[int, ...]


def gather(eqn: jcore.JaxprEqn) -> Gather:
  """What a ``gather`` equation takes from its operand."""
  dims = param(eqn, "dimension_numbers")
  return Gather(
    tuple(dims.offset_dims),
    tuple(dims.collapsed_slice_dims),
    tuple(dims.start_index_map),
    tuple(getattr(dims, "operand_batching_dims", ())),
    tuple(param(eqn, "slice_sizes")),
  )


def ragged_groups(eqn: jcore.JaxprEqn) -> tuple[int, ...]:
  """The group axes of a ``ragged_dot_general``'s right operand (``lax.ragged_dot``'s
  (groups, in, out) matrices, one per run of rows ``group_sizes`` counts: an MoE's experts)."""
  return tuple(param(eqn, "ragged_dot_dimension_numbers").rhs_group_dimensions)
