"""Numeric confirmation: random factors on every instance of a candidate at once.

Every instance's members get per-group factors ``c = exp(u)``, ``u`` uniform in
``[-log 4, log 4]``, side a ``c`` and side b ``1/c``; with exponents ``t = (t_a, t_b)`` the
model is ``f(t) = f(A c^t_a, B c^-t_b)``. The candidate is exact at that grouping when the
outputs stay put on two counts (largest entries, relative to ``max|f(0, 0)|``):

* finite: ``|f(1, 1) - f(0, 0)| <= rtol``;
* first order: the tangent along the orbit, ``d/ds f(s, s)`` at ``s = 0``, is at most
  ``rtol`` times the change side a makes alone, ``|f(1, 0) - f(0, 0)|``.

The finite count catches what a derivative cannot see (a clip that the moved values cross);
the first-order count has the power the finite one lacks where a candidate moves the outputs
little next to their size: at init std 0.02 (norm gains included) attention logits are
~1e-3, and Q/K rescaled per channel, a wrong grouping under RoPE, moves an LM's logits by
~1e-5 of their size: under the finite count's tolerance (1e-4), and only ~100 times its
float32 noise (~1e-7 of that size, whatever moved), so no fixed tolerance separates the
two. A tangent carries no roundoff of the values it does not touch: along an exact orbit
it cancels to float32 precision relative to the terms that cancel, which scale with the
one-sided change, however small both are. The one-sided change
also tells whether the check could fail at all: behind a constant zero it is exactly zero. A
model that cannot be differentiated forward (a ``custom_vjp`` function) is checked on the
finite count alone, side a alone then having to move the outputs past ``rtol``.
"""

from __future__ import annotations

import collections
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from saggs_jax._src.diagnostics import Probe
from saggs_jax._src.discovery.candidates import Candidate, Unit
from saggs_jax._src.pairs import copy_positions

# A tangent along a zero direction must be exactly zero: one that is not is the backend's fault.
_FAULTY = (
  "discover: the model's tangent along a zero direction is not zero on the {} backend (jax"
  " {}), so its first-order symmetry checks cannot be trusted; they are skipped and each"
  " candidate is judged on its finite count alone."
)


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
  The finite count runs the model on copies of the moved leaves (one compilation, shared with
  every check); the first-order count, only where the finite one passes, is one jitted
  ``jax.jvp`` whose tangent moves every (unit, axis) that some candidate scales, by zero
  log-factors but for the candidate checked (one compilation too).
  """

  def __init__(
    self,
    apply_fn,
    leaves: list,
    args,
    kwargs,
    rtol: float,
    seed: int | np.ndarray,
    units: list[Unit],
    candidates: list[Candidate],
  ):
    """``apply_fn(leaves, *args, **kwargs)``: the model on a list of its parameter leaves;
    ``candidates``: every instance that will be checked."""
    self.units = units
    self.rng = np.random.default_rng(seed)
    self.leaves = live(leaves, self.rng)
    self.probe = Probe(apply_fn, self.leaves, args, kwargs, rtol=rtol)
    self.outputs = lambda leaves: [
      o.astype(jnp.float32)
      for o in jax.tree.leaves(apply_fn(leaves, *args, **kwargs))
      if jnp.issubdtype(o.dtype, jnp.floating)
    ]
    self.slots: dict[tuple, int] = {}  # (unit, axis, stacked) -> its index
    for inst in candidates:
      for (unit, axis), _ in inst.scaled:
        self.slots.setdefault((unit, axis, inst.stacked), len(self.slots))
    self.first_order = True  # False once the model cannot be differentiated forward
    self._orbit_fn = None

  def _deviation(self, instances: list[Candidate], logs: list, signs: tuple[int, ...]) -> float:
    """The finite count: the outputs' change when the members of ``signs`` take their factors
    (``logs``: per instance, the log-factors per copy and group), the moved leaves copied."""
    changed = {}
    for inst, u in zip(instances, logs):
      for (unit, axis), sign in inst.scaled:
        if sign not in signs:
          continue
        leaf, part = self.units[unit]
        x = changed.get(leaf)
        x = np.array(self.leaves[leaf], np.float32) if x is None else x
        block = part.index(x.shape[part.axis]) if part else ()
        x[block] = x[block] * _expand(np.exp(sign * u), x[block].shape, axis, inst.stacked)
        changed[leaf] = x
    leaves = [
      jnp.asarray(changed[i], x.dtype) if i in changed else x for i, x in enumerate(self.leaves)
    ]
    return self.probe.deviation(leaves)

  def _log_shape(self, unit: int, axis: int, stacked) -> tuple[int, ...]:
    """A slot's log-factors: per copy (the stacked axes) and channel."""
    shape = _unit_shape(self.leaves, self.units[unit])
    return tuple(shape[i] for i in copy_positions(stacked)) + (shape[axis],)

  def _direction(self, leaves: list, logs: list) -> list:
    """The tangent of ``leaves`` along the orbit: each slot's unit times its log-factors along
    its axis (``log``: per copy and channel, signs included), zero elsewhere."""
    tangents = [jnp.zeros_like(x) for x in leaves]
    for (unit, axis, stacked), log in zip(self.slots, logs):
      leaf, part = self.units[unit]
      block = part.index(leaves[leaf].shape[part.axis]) if part else ()
      v = leaves[leaf][block]
      d = (v.astype(jnp.float32) * _expand(log, v.shape, axis, stacked)).astype(v.dtype)
      tangents[leaf] = tangents[leaf].at[block].add(d) if part else tangents[leaf] + d
    return tangents

  def _orbit(self, instances: list[Candidate], logs: list) -> float | None:
    """The first-order count: the largest entry of the outputs' tangent along the orbit,
    ``d/ds f(A c^s, B c^-s)`` at ``s = 0``; None if the model cannot be differentiated
    forward. One jitted function moves every slot, by zero log-factors where ``instances``
    have no member."""
    slot_logs = [np.zeros(self._log_shape(*key), np.float32) for key in self.slots]
    for inst, u in zip(instances, logs):
      for (unit, axis), sign in inst.scaled:
        log = slot_logs[self.slots[unit, axis, inst.stacked]]
        log += sign * np.repeat(u, log.shape[-1] // u.shape[-1], axis=-1)
    try:
      if self._orbit_fn is None:
        self._orbit_fn = jax.jit(
          lambda leaves, logs: jax.jvp(self.outputs, (leaves,), (self._direction(leaves, logs),))[1]
        )
        if self._largest([np.zeros_like(x) for x in slot_logs]) != 0:  # the control
          warnings.warn(
            _FAULTY.format(jax.default_backend(), jax.__version__), RuntimeWarning, stacklevel=2
          )
          self.first_order = False
          return None
      return self._largest(slot_logs) / self.probe.scale
    except TypeError:  # jvp of a custom_vjp function: the finite count alone
      self.first_order = False
      return None

  def _largest(self, slot_logs: list) -> float:
    """The largest entry of the outputs' tangent, reduced on the host: a reduction fused with
    the model's last dot inside the jit has returned garbage on XLA:CPU (YNNPACK)."""
    assert self._orbit_fn is not None  # made by _orbit
    with jax.default_matmul_precision("highest"):
      tangent = self._orbit_fn(self.leaves, slot_logs)
    return max(float(np.max(np.abs(np.asarray(x)), initial=0.0)) for x in tangent)

  def check(self, instances: list[Candidate], groups: int) -> Verdict:
    """Whether random per-group factors on every instance leave the outputs in place: the
    finite count first, the first-order one only where it passes."""
    logs = [
      self.rng.uniform(
        -np.log(4),
        np.log(4),
        self._log_shape(i.a[0][0], i.a[0][1], i.stacked)[:-1] + (groups,),
      )
      for i in instances
    ]
    tol = self.probe.tolerance
    if not self._deviation(instances, logs, (1, -1)) <= tol:  # NaN fails
      return Verdict(False, False)
    one_sided = self._deviation(instances, logs, (1,))
    orbit = self._orbit(instances, logs) if self.first_order else None
    if orbit is None:
      return Verdict(True, one_sided > tol)
    return Verdict(orbit <= tol * one_sided, one_sided > 0)


def _expand(factors, shape: tuple[int, ...], axis: int, stacked):
  """Per-group ``factors`` (copies..., groups) as a multiplier of a leaf of ``shape`` whose
  copy axes ``stacked`` names (a number of leading axes, or their positions; NumPy or JAX
  arrays)."""
  copy = copy_positions(stacked)
  n = shape[axis]
  xp = np if isinstance(factors, np.ndarray) else jnp
  factors = xp.repeat(factors, n // factors.shape[-1], axis=-1)
  k = sum(c < axis for c in copy)  # the group axis's place among the copy axes, in leaf order
  factors = factors.transpose((*range(k), factors.ndim - 1, *range(k, factors.ndim - 1)))
  return factors.reshape(tuple(m if i in copy or i == axis else 1 for i, m in enumerate(shape)))


def _unit_shape(leaves: list, unit: Unit) -> tuple[int, ...]:
  leaf, part = unit
  shape = tuple(np.shape(leaves[leaf]))
  return (
    shape
    if part is None
    else shape[: part.axis] + (part.size(shape[part.axis]),) + shape[part.axis + 1 :]
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
