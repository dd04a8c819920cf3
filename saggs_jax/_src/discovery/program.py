"""The jaxpr as one flat program of equations on integer value ids.

``pjit``, ``custom_jvp``/``custom_vjp``, ``remat`` and other calls are inlined; a
``scan`` becomes one iteration between a ``scan_slice`` of its ``xs`` and a
``scan_stack`` of its ``ys``; a ``cond`` becomes every branch inlined and a
``select_n`` on the index; jax 0.12's ``unstack`` becomes the ``split`` and
``squeeze`` that older jaxes emit; equations whose values reach no output are dropped (a
product computed and thrown away uses a leaf in no way that matters); a ``gather`` carries its dimension numbers read
(``params["gather"]``), a ``ragged_dot_general`` its group axes
(``params["ragged_groups"]``). Nothing here knows what a primitive does; the equations'
parameters are read through :mod:`saggs_jax._src.jaxpr_params`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from saggs_jax._src import jaxpr_params


def _shape(var: jcore.Var | jcore.Literal) -> tuple[int, ...]:
  return tuple(var.aval.shape)  # pyright: ignore[reportAttributeAccessIssue]  (a ShapedArray)


class Eqn(NamedTuple):
  """``outs = prim(*ins, **params)`` on value ids."""

  prim: str
  ins: list[int]
  outs: list[int]
  params: dict[str, Any]


class Program:
  """A closed jaxpr flattened, its first ``num_leaves`` inputs the parameters.

  Attributes:
    eqns: the equations in program order (a topological order).
    shapes: the shape of every value id.
    leaf_ids, input_ids: the value ids of the parameters and of the other inputs.
    outputs: the value ids the program returns; every equation left reaches one (or a scan's
      carry, which the next iteration reads).
    zeros: the constants (literals, closed-over arrays) that are all zero.
  """

  def __init__(self, closed: Any, num_leaves: int):
    self.eqns: list[Eqn] = []
    self.shapes: list[tuple[int, ...]] = []
    self.zeros: set[int] = set()
    self._carried: set[int] = set()  # a scan body's carry out: the next iteration reads it
    jaxpr, consts = jaxpr_params.opened(closed)
    ids = [self._new(_shape(v)) for v in jaxpr.invars]
    self.leaf_ids, self.input_ids = ids[:num_leaves], ids[num_leaves:]
    self.outputs = set(self._inline(jaxpr, ids, consts))
    self._prune()

  def _prune(self) -> None:
    """Drops the equations none of whose values reaches an output (dead code, as jaxpr DCE):
    a leaf read only there is not used at all, and no rescaling has to keep what they make."""
    live, kept = self.outputs | self._carried, []
    for eqn in reversed(self.eqns):
      if live.intersection(eqn.outs):
        live.update(eqn.ins)
        kept.append(eqn)
    self.eqns = kept[::-1]

  def _new(self, shape: Sequence[int]) -> int:
    self.shapes.append(tuple(shape))
    return len(self.shapes) - 1

  def _emit(self, prim: str, ins: list[int], out_shapes, params: dict[str, Any]) -> list[int]:
    outs = [self._new(s) for s in out_shapes]
    self.eqns.append(Eqn(prim, ins, outs, params))
    return outs

  def _const(self, var, value=None) -> int:
    """A literal or a closed-over constant: it depends on nothing."""
    i = self._new(_shape(var))
    dtype = getattr(value, "dtype", None)
    dtype = np.result_type(value) if dtype is None and isinstance(value, (int, float)) else dtype
    if dtype is not None and jnp.issubdtype(dtype, jnp.number) and not np.any(value):
      self.zeros.add(i)
    return i

  def _inline(self, jaxpr: jcore.Jaxpr, in_ids: list[int], consts: Sequence[Any] = ()) -> list[int]:
    env = dict(zip(jaxpr.invars, in_ids))
    for k, v in enumerate(jaxpr.constvars):
      env[v] = self._const(v, consts[k] if k < len(consts) else None)

    def read(x) -> int:
      return self._const(x, x.val) if isinstance(x, jcore.Literal) else env[x]

    for eqn in jaxpr.eqns:
      ins = [read(x) for x in eqn.invars]
      name = eqn.primitive.name
      body = jaxpr_params.call_body(eqn)
      if name == "scan":
        outs = self._scan(eqn, ins)
      elif name == "cond":
        outs = self._cond(eqn, ins)
      elif name == "unstack":
        outs = self._unstack(eqn, ins)
      elif body is not None:
        outs = self._inline(body[0], ins, body[1])
      else:
        jaxpr_params.check(eqn)
        params = dict(eqn.params)
        if name == "gather":
          params["gather"] = jaxpr_params.gather(eqn)
        elif name == "ragged_dot_general":
          params["ragged_groups"] = jaxpr_params.ragged_groups(eqn)
        outs = self._emit(name, ins, [_shape(v) for v in eqn.outvars], params)
      env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]

  def _scan(self, eqn: jcore.JaxprEqn, ins: list[int]) -> list[int]:
    """One iteration: per-step slices of ``xs`` in, stacked ``ys`` out."""
    body, consts, nc, ncarry = jaxpr_params.scan(eqn)
    xs = [self._emit("scan_slice", [i], [self.shapes[i][1:]], {})[0] for i in ins[nc + ncarry :]]
    outs = self._inline(body, ins[: nc + ncarry] + xs, consts)
    self._carried.update(outs[:ncarry])
    ys = [
      self._emit("scan_stack", [o], [_shape(v)], {})[0]
      for o, v in zip(outs[ncarry:], eqn.outvars[ncarry:])
    ]
    return outs[:ncarry] + ys

  def _cond(self, eqn: jcore.JaxprEqn, ins: list[int]) -> list[int]:
    """Every branch inlined on the operands, their outputs chosen by ``select_n`` on the index."""
    outs = [self._inline(b, ins[1:], consts) for b, consts in jaxpr_params.cond_branches(eqn)]
    return [
      self._emit("select_n", [ins[0], *cases], [_shape(v)], {})[0]
      for cases, v in zip(zip(*outs), eqn.outvars)
    ]

  def _unstack(self, eqn: jcore.JaxprEqn, ins: list[int]) -> list[int]:
    """``unstack`` (jax >= 0.12 unpacks an array with it) as older jaxes wrote it: a ``split``
    into ones along the axis, each part squeezed."""
    axis, shape = jaxpr_params.param(eqn, "axis"), self.shapes[ins[0]]
    one = shape[:axis] + (1,) + shape[axis + 1 :]
    parts = self._emit(
      "split", ins, [one] * shape[axis], {"axis": axis, "sizes": (1,) * shape[axis]}
    )
    return [
      self._emit("squeeze", [i], [_shape(v)], {"dimensions": (axis,)})[0]
      for i, v in zip(parts, eqn.outvars)
    ]
