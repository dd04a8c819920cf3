"""An optimizer's update with every gate that depends on the gradients' size open.

The transport degree of a state leaf is the one it has where every scale-dependent gate of
the optimizer is open (docs/moments.md): clips that do not clip, additive constants that are
negligible. The degree probe (:mod:`saggs_jax._src.degrees`) makes the additive constants
negligible by the size of its gradients, and opens the gates with :func:`opened`.

A *gate* is an equation that compares a *hot* value (computed from the gradients or the
optimizer's float state) with a *cold* one (a threshold, a norm of the parameters, a
constant): ``lt``, ``le``, ``gt``, ``ge``, ``eq``, ``ne``, ``max``, ``min`` and ``clamp``.
:func:`opened` evaluates a jaxpr with every cold operand of a gate that is not zero taken to
infinity: the bound of a ``max`` or ``min`` (``clamp``) on the side that lets the hot operand
pass (``clip(g, -t, t)`` is ``g``, ``maximum(norm, eps)`` is the norm), either side of a
comparison with its sign (``norm < max_norm`` holds: ``clip_by_global_norm``,
``adaptive_grad_clip``, ``clip_by_block_rms`` do not clip). A cold zero is kept: a comparison with zero or a
``maximum(x, 0)`` tests a sign, which no positive scale changes. A positive floor reads as an
``eps``: ``clip_by_block_rms`` divides by ``maximum(1, rms / t)``, the rms floored at ``t``,
so it is measured as the normaliser it is when it clips. Equations whose operands are
all hot or all cold run as written, so are those inside loops; calls and ``cond`` branches are
evaluated equation by equation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from saggs_jax._src import jaxpr_params

GATES = frozenset({"lt", "le", "gt", "ge", "eq", "ne", "max", "min", "clamp"})
"""The primitives that compare their operands (see the module doc)."""


def _open(x: Any, sign: Any) -> Any:
  """A cold operand of a gate taken to infinity with the sign ``sign`` (an array: ``x``'s
  own); zero kept."""
  return jnp.where(x == 0, x, jnp.copysign(jnp.asarray(jnp.inf, x.dtype), sign))


def _opened_operands(name: str, args: list, warm: list) -> list:
  """The operands of a gate with its cold ones open: the bound of a ``max`` (or ``clamp``'s
  lower bound) to -inf, of a ``min`` (or ``clamp``'s upper) to +inf, so that the hot operand
  passes; either side of a comparison to infinity with its sign."""
  sign = {"max": [-1.0] * 2, "min": [1.0] * 2, "clamp": [-1.0, 0.0, 1.0]}.get(name)
  return [
    x if h else _open(x, x if sign is None else jnp.asarray(sign[k], x.dtype))
    for k, (x, h) in enumerate(zip(args, warm))
  ]


def _bind(eqn: Any, args: list) -> list:
  found = eqn.primitive.get_bind_params(eqn.params)
  subfuns, params = found if isinstance(found, tuple) else ((), found)
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*subfuns, *args, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def _hot(v: Any) -> bool:
  return jnp.issubdtype(v.aval.dtype, jnp.floating)


def _evaluate(closed: Any, args: Sequence, hot: Sequence[bool]) -> tuple[list, list]:
  """The outputs of ``closed`` (a closed or open jaxpr) on ``args`` with its gates open, and
  which of them are hot; ``hot`` says which inputs are."""
  jaxpr = getattr(closed, "jaxpr", closed)
  env: dict = dict(zip(jaxpr.constvars, getattr(closed, "consts", ())))
  heat: set = set()

  def read(v):
    return v.val if isinstance(v, jcore.Literal) else env[v]

  def is_hot(v):
    return not isinstance(v, jcore.Literal) and v in heat

  for v, x, h in zip(jaxpr.invars, args, hot):
    env[v] = x
    if h and _hot(v):
      heat.add(v)
  for eqn in jaxpr.eqns:
    ins, warm = [read(v) for v in eqn.invars], [is_hot(v) for v in eqn.invars]
    name, body = eqn.primitive.name, jaxpr_params.CALLS.get(eqn.primitive.name)
    if not any(warm):
      outs, out_hot = _bind(eqn, ins), [False] * len(eqn.outvars)
    elif body is not None and name != "shard_map":
      outs, out_hot = _evaluate(eqn.params[body], ins, warm)
    elif name == "cond":  # every branch, then the one the index picks
      index, operands = ins[0], ins[1:]
      runs = [_evaluate(b, operands, warm[1:]) for b in eqn.params["branches"]]
      outs = [jax.lax.select_n(index, *xs) for xs in zip(*(r[0] for r in runs))]
      out_hot = [any(hs) for hs in zip(*(r[1] for r in runs))]
    else:
      if name in GATES:
        ins = _opened_operands(name, ins, warm)
      outs, out_hot = _bind(eqn, ins), [True] * len(eqn.outvars)
    for v, x, h in zip(eqn.outvars, outs, out_hot):
      env[v] = x
      if h and _hot(v):
        heat.add(v)
  return [read(v) for v in jaxpr.outvars], [is_hot(v) for v in jaxpr.outvars]


def opened(closed: Any, hot: Sequence[bool]) -> Callable[..., list]:
  """``closed`` (a ``ClosedJaxpr``) as a function of its inputs with every gate open; ``hot``
  says which inputs are hot (the gradients and the state; their float values are).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> clip = optax.clip_by_global_norm(1.0)
    >>> g = {"w": jnp.full(4, 3.0)}
    >>> closed = jax.make_jaxpr(lambda g: clip.update(g, clip.init(g))[0])(g)
    >>> jax.jit(opened(closed, [True]))(*jax.tree.leaves(g))[0].tolist()  # not clipped
    [3.0, 3.0, 3.0, 3.0]
  """
  return lambda *args: _evaluate(closed, args, hot)[0]
