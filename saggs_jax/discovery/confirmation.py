"""Numeric confirmation: random factors on every instance of a candidate at once."""

from __future__ import annotations

import collections
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from saggs_jax.diagnostics import Probe
from saggs_jax.discovery.candidates import Candidate, Unit


class Confirmed(NamedTuple):
  """``instances`` exact at ``groups`` groups; ``tested``: a finer grouping failed, so the
  check could fail on them."""

  instances: list[Candidate]
  groups: int
  tested: bool


class Checker:
  """Rescales instances by random factors and tells whether the model's outputs stay put.

  The check runs on ``params`` made live: an all-zero leaf (a zero-initialised output
  projection, an adaLN-Zero gate) cuts the path it sits on, and every factor behind it would
  pass. Such leaves are drawn at random instead, at the RMS of the non-zero leaves of their
  rank; symmetries are structural, so what is exact on these parameters is exact on any.
  """

  def __init__(
    self, apply_fn, leaves: list, args, kwargs, rtol: float | None, seed: int, units: list[Unit]
  ):
    """``apply_fn(leaves, *args, **kwargs)``: the model on a list of its parameter leaves."""
    self.units = units
    self.rng = np.random.default_rng(seed)
    self.leaves = live(leaves, self.rng)
    self.probe = Probe(apply_fn, self.leaves, args, kwargs, rtol=rtol)

  def _moved(self, instances: list[Candidate], groups: int, signs: tuple[int, ...]) -> float:
    """The deviation when every instance's members of ``signs`` take random factors."""
    changed = {}
    for inst in instances:
      stacked_shape = tuple(self.leaves[self.units[inst.a[0][0]].leaf].shape[: inst.stacked])
      factors = np.exp(self.rng.uniform(-np.log(4), np.log(4), stacked_shape + (groups,)))
      for (unit, axis), sign in inst.scaled:
        if sign not in signs:
          continue
        leaf, part = self.units[unit]
        x = changed.get(leaf)
        x = np.array(self.leaves[leaf], np.float32) if x is None else x
        block = (slice(None),) * part.axis + (slice(part.lo, part.hi),) if part else ()
        x[block] = x[block] * _expand(factors**sign, x[block].shape, axis, inst.stacked)
        changed[leaf] = x
    leaves = [
      jnp.asarray(changed[i], x.dtype) if i in changed else x for i, x in enumerate(self.leaves)
    ]
    return self.probe.deviation(leaves)

  def exact(self, instances: list[Candidate], groups: int) -> bool:
    return bool(self._moved(instances, groups, (1, -1)) <= self.probe.tolerance)  # NaN fails

  def could_fail(self, instances: list[Candidate], groups: int) -> bool:
    """Whether the check of ``instances`` could have failed: side a rescaled alone, a move
    that is no symmetry, must fail it (it passes behind a constant zero, say)."""
    return bool(self._moved(instances, groups, (1,)) > self.probe.tolerance)


def live(leaves: list, rng: np.random.Generator) -> list:
  """``leaves`` with every all-zero floating array drawn from N(0, s^2), s the mean RMS of the
  non-zero floating leaves of the same rank (1 if there is none)."""

  def floating(x):
    return jnp.issubdtype(jnp.result_type(x), jnp.floating) and np.size(x) > 0

  values = [np.asarray(x, np.float32) if floating(x) else None for x in leaves]
  rms = collections.defaultdict(list)
  for v in values:
    if v is not None and v.any():
      rms[v.ndim].append(float(np.sqrt(np.mean(v * v))))
  return [
    jnp.asarray(rng.standard_normal(v.shape) * np.mean(rms[v.ndim] or [1.0]), x.dtype)
    if v is not None and not v.any()
    else x
    for x, v in zip(leaves, values)
  ]


def _expand(factors: np.ndarray, shape: tuple[int, ...], axis: int, stacked: int) -> np.ndarray:
  """Per-group ``factors`` (stacked..., groups) as a multiplier of a leaf of ``shape``."""
  n = shape[axis]
  factors = np.repeat(factors, n // factors.shape[-1], axis=-1)
  return factors.reshape(
    factors.shape[:-1] + (1,) * (axis - stacked) + (n,) + (1,) * (len(shape) - axis - 1)
  )


def confirm(
  checker: Checker, instances: list[Candidate], options: list[int]
) -> tuple[list[Confirmed], list[Candidate]]:
  """The instances confirmed at their finest exact grouping among ``options``, and those none
  fits (found by bisection)."""
  for k, groups in enumerate(options):
    if checker.exact(instances, groups):
      return [Confirmed(instances, groups, k > 0)], []
  if len(instances) == 1:
    return [], instances
  half = len(instances) // 2
  (ok1, bad1), (ok2, bad2) = (
    confirm(checker, part, options) for part in (instances[:half], instances[half:])
  )
  return ok1 + ok2, bad1 + bad2
