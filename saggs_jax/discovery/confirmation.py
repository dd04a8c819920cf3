"""Numeric confirmation: random factors on every instance of a candidate at once.

Every instance's members get per-group factors ``c = exp(u)``, ``u`` uniform in
``[-log 4, log 4]``, side a ``c`` and side b ``1/c``; with exponents ``t = (t_a, t_b)`` the
model is ``f(t) = f(A c^t_a, B c^-t_b)``. The candidate is exact at that grouping when the
outputs stay put on two counts (largest entries, relative to ``max|f(0)|``):

* finite: ``|f(1, 1) - f(0)| <= rtol``;
* first order: the tangent along the orbit at the moved point, ``d/ds f(1 + s, 1 + s)``, is
  at most ``rtol`` times the change side a makes alone, ``|f(1, 0) - f(0)|``.

The finite count catches what a derivative cannot see (a clip that the moved values cross);
the first-order count has the power the finite one lacks where a candidate moves the outputs
little next to their size: at init std 0.02 (norm gains included) attention logits are
~1e-3, and Q/K rescaled per channel, a wrong grouping under RoPE, moves an LM's logits by
~1e-5 of their size, under any fixed tolerance of the finite count, whose float32 noise is
~1e-7 of that size whatever moved. A tangent carries no roundoff of the values it does not
touch: along an exact orbit it cancels to float32 precision relative to the terms that
cancel, which scale with the one-sided change, however small both are. The one-sided change
also tells whether the check could fail at all: behind a constant zero it is exactly zero. A
model that cannot be differentiated forward (a ``custom_vjp`` function) is checked on the
finite count alone, side a alone then having to move the outputs past ``rtol``.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from saggs_jax.discovery.candidates import Candidate, Unit


class Confirmed(NamedTuple):
  """``instances`` exact at ``groups`` groups; ``tested``: the check could fail on them (a
  finer grouping failed, or side a alone moves the outputs)."""

  instances: list[Candidate]
  groups: int
  tested: bool


class Verdict(NamedTuple):
  exact: bool
  live: bool  # side a rescaled alone moves the outputs: the check could fail


class Checker:
  """Rescales instances by random factors and tells whether the model's outputs stay put.

  The check runs on ``params`` made live: an all-zero leaf (a zero-initialised output
  projection, an adaLN-Zero gate) cuts the path it sits on, and every factor behind it would
  pass. Such leaves are drawn at random instead, at the RMS of the non-zero leaves of their
  rank; symmetries are structural, so what is exact on these parameters is exact on any.
  One jitted check, compiled once, scales inside the computation every (unit, axis) that a
  candidate scales, each by its own log-factors (zero where a check leaves it alone).
  """

  def __init__(
    self,
    apply_fn,
    leaves: list,
    args,
    kwargs,
    rtol: float,
    seed: int,
    units: list[Unit],
    candidates: list[Candidate],
  ):
    """``apply_fn(leaves, *args, **kwargs)``: the model on a list of its parameter leaves;
    ``candidates``: every instance that will be checked."""
    self.units = units
    self.rng = np.random.default_rng(seed)
    self.leaves = live(leaves, self.rng)
    self.outputs = lambda leaves: [
      o.astype(jnp.float32)
      for o in jax.tree.leaves(apply_fn(leaves, *args, **kwargs))
      if jnp.issubdtype(o.dtype, jnp.floating)
    ]
    self.slots: dict[tuple[int, int, int], int] = {}  # (unit, axis, stacked) -> its index
    for inst in candidates:
      for (unit, axis), _ in inst.scaled:
        self.slots.setdefault((unit, axis, inst.stacked), len(self.slots))
    self.first_order = True  # False once the model cannot be differentiated forward
    self._compiled = None
    # The outputs unscaled (zero exponents), by the same computation as the checks.
    self.base = self._run(
      [np.zeros((2,) + self._log_shape(*k), np.float32) for k in self.slots], (0.0, 0.0)
    )[0]
    self.scale = max(max(float(np.max(np.abs(b))) for b in self.base), np.finfo(np.float32).tiny)
    self.tolerance = rtol

  def _log_shape(self, unit: int, axis: int, stacked: int) -> tuple[int, ...]:
    """The log-factors of a slot: per copy (the stacked axes) and channel."""
    shape = _unit_shape(self.leaves, self.units[unit])
    return shape[:stacked] + (shape[axis],)

  def _scaled(self, leaves: list, logs: list, t: jax.Array) -> list:
    """``leaves`` with each slot's unit scaled along its axis by ``exp(t[0] * log[0] + t[1] *
    log[1])``: side a's and side b's log-factors (signs included), ``t`` their exponents."""
    leaves = list(leaves)
    for (unit, axis, stacked), log in zip(self.slots, logs):
      leaf, part = self.units[unit]
      x = leaves[leaf]
      block = (slice(None),) * part.axis + (slice(part.lo, part.hi),) if part else ()
      v = x[block]
      shape = v.shape[:stacked] + (1,) * (axis - stacked) + (v.shape[axis],)
      factor = jnp.exp(t[0] * log[0] + t[1] * log[1]).reshape(shape + (1,) * (v.ndim - axis - 1))
      v = (v.astype(jnp.float32) * factor).astype(x.dtype)
      leaves[leaf] = x.at[block].set(v) if part else v
    return leaves

  def _check(self):
    """The jitted ``(leaves, logs, t) -> (outputs, orbit)``: the outputs at exponents ``t`` and
    the largest entry of their tangent along the orbit, ``t -> t + (s, s)`` (NaN without the
    first-order count)."""
    if self._compiled is None:
      first_order = self.first_order

      def check(leaves, logs, t):
        def f(t):
          return self.outputs(self._scaled(leaves, logs, t))

        if not first_order:
          return f(t), jnp.float32(jnp.nan)
        out, tangent = jax.jvp(f, (t,), (jnp.ones(2, jnp.float32),))
        return out, jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in tangent]))

      self._compiled = jax.jit(check)
    return self._compiled

  def _run(self, logs: list, t) -> tuple[list[np.ndarray], float]:
    with jax.default_matmul_precision("highest"):
      try:
        out, orbit = self._check()(self.leaves, logs, jnp.asarray(t, jnp.float32))
      except TypeError:  # jvp of a custom_vjp function: the finite count alone
        if not self.first_order:
          raise
        self.first_order, self._compiled = False, None
        return self._run(logs, t)
    return [np.asarray(o) for o in out], float(orbit)

  def _moved(self, out: list[np.ndarray]) -> float:
    """The largest change of the outputs from the unscaled ones, relative to their size."""
    return max(float(np.max(np.abs(o - b))) for o, b in zip(out, self.base)) / self.scale

  def check(self, instances: list[Candidate], groups: int) -> Verdict:
    """Whether random per-group factors on every instance leave the outputs in place."""
    logs = [np.zeros((2,) + self._log_shape(*key), np.float32) for key in self.slots]
    for inst in instances:
      stacked_shape = tuple(self.leaves[self.units[inst.a[0][0]].leaf].shape[: inst.stacked])
      u = self.rng.uniform(-np.log(4), np.log(4), stacked_shape + (groups,))
      for (unit, axis), sign in inst.scaled:
        log = logs[self.slots[unit, axis, inst.stacked]]
        log[int(sign < 0)] += sign * np.repeat(u, log.shape[-1] // groups, axis=-1)
    tol = self.tolerance
    out, orbit = self._run(logs, (1.0, 1.0))
    orbit /= self.scale
    one_sided = self._moved(self._run(logs, (1.0, 0.0))[0])
    if self.first_order:  # NaN fails every comparison
      return Verdict(self._moved(out) <= tol and orbit <= tol * one_sided, one_sided > 0)
    return Verdict(self._moved(out) <= tol, one_sided > tol)


def _unit_shape(leaves: list, unit: Unit) -> tuple[int, ...]:
  leaf, part = unit
  shape = tuple(np.shape(leaves[leaf]))
  return (
    shape if part is None else shape[: part.axis] + (part.hi - part.lo,) + shape[part.axis + 1 :]
  )


def live(leaves: list, rng: np.random.Generator) -> list:
  """``leaves`` as JAX arrays, every all-zero floating one drawn from N(0, s^2), s the mean RMS
  of the non-zero floating leaves of the same rank (1 if there is none). Leaves are read one at
  a time (a view on the CPU), and the RMS taken only if some leaf is all zero."""
  floating = [
    i
    for i, x in enumerate(leaves)
    if jnp.issubdtype(jnp.result_type(x), jnp.floating) and np.size(x) > 0
  ]
  zero = {i for i in floating if not np.asarray(leaves[i]).any()}
  out = [jnp.asarray(x) for x in leaves]
  if zero:
    rms = collections.defaultdict(list)
    for i in floating:
      if i not in zero:
        v = np.asarray(leaves[i], np.float32)
        rms[v.ndim].append(float(np.sqrt(np.mean(v * v))))
    for i in sorted(zero):
      x = leaves[i]
      s = np.mean(rms[np.ndim(x)] or [1.0])
      out[i] = jnp.asarray(rng.standard_normal(np.shape(x)) * s, jnp.result_type(x))
  return out


def confirm(
  checker: Checker, instances: list[Candidate], options: list[int]
) -> tuple[list[Confirmed], list[Candidate]]:
  """The instances confirmed at their finest exact grouping among ``options``, and those none
  fits (found by bisection)."""
  for k, groups in enumerate(options):
    verdict = checker.check(instances, groups)
    if verdict.exact:
      return [Confirmed(instances, groups, k > 0 or verdict.live)], []
  if len(instances) == 1:
    return [], instances
  half = len(instances) // 2
  (ok1, bad1), (ok2, bad2) = (
    confirm(checker, part, options) for part in (instances[:half], instances[half:])
  )
  return ok1 + ok2, bad1 + bad2
