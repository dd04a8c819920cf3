"""The pipeline: jaxpr -> program -> candidates -> numeric confirmation -> declarations."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import core

from saggs_jax._src import paths
from saggs_jax._src.diagnostics import default_rtol
from saggs_jax._src.discovery import declarations, roles
from saggs_jax._src.discovery.candidates import Analysis, Candidate, group_options
from saggs_jax._src.discovery.confirmation import Checker, confirm
from saggs_jax._src.discovery.result import Discovery

_UNCONFIRMED = (
  "unconfirmed: rescaling side a alone does not change the output on the example"
  " inputs, even with all-zero parameters drawn at random, so no check could fail"
)
_ABSTRACT = (
  "unconfirmed: the parameters are abstract (jax.ShapeDtypeStruct or tracers), so no"
  " numerical check ran; call discover with concrete parameters to confirm"
)
_NOT_IN_REDUCED = (
  "unconfirmed: the reduced copy of the model (reduced=) does not confirm it in every layer"
)
_NO_MATCH = (
  "unconfirmed: the reduced copy of the model (reduced=) has other groupings to choose from"
  " (keep its head and KV-head structure: GQA for GQA, heads > 1)"
)
_REFUTED = "the jaxpr suggests it, but random factors change the output"
_INTERLEAVED = (
  "exact at {} groups on random factors, but {} interleaves its blocks along axis {} (one"
  " run of them every {} entries, as [q_0 k_0 v_0 q_1 k_1 v_1 ...]); a Block names"
  " contiguous parts only, so no Pair declares it: store the leaf with its blocks contiguous"
  " (q|k|v) to balance it"
)


def discover(
  apply_fn: Callable[..., Any],
  params: Any,
  *example_args,
  rtol: float | None = None,
  key: jax.Array | None = None,
  reduced: tuple | None = None,
  **example_kwargs,
) -> Discovery:
  """Finds the exact rescaling symmetries of ``apply_fn`` in ``params``.

  Proposes, from the jaxpr of ``apply_fn(params, *example_args, **example_kwargs)``,
  every rescaling of one parameter that another cancels, and keeps those that random
  factors in [1/4, 4] leave exact on the example inputs, every instance (layer) at once,
  at the finest exact grouping (docs/discover.md, docs/discover_pipeline.md). With
  abstract ``params`` only the jaxpr is read and nothing is confirmed.

  Args:
    apply_fn: ``apply_fn(params, *example_args, **example_kwargs)``, returning
      an array or a pytree.
    params: the parameter tree (an ``nnx.State``, a Linen dict, an Equinox module); its
      inexact arrays, concrete or abstract, are the parameters, other leaves static.
    *example_args: small example inputs (one short sequence is enough).
    rtol: relative tolerance of the check (>= 0); default 1e-4 in float32, 3e-2 with
      16-bit parameters or outputs.
    key: PRNG key of the random factors (default fixed).
    reduced: with abstract ``params``, ``(apply_fn, params, *args)`` of a copy of the
      model reduced in width and depth (same paths and head structure) to confirm on.
    **example_kwargs: keyword inputs of ``apply_fn``.

  Returns:
    A :class:`Discovery`: a sequence of :class:`~saggs_jax.Pair` covering every layer,
    with ``.rejected`` (and why), ``.roles`` (path patterns per role of
    :func:`saggs_jax.equivariant.symmetry_compatible`) and ``.confirmation``
    (``"parameters"``, ``"parameters, finite only"``, ``"reduced"`` or ``"none"``).

  Raises:
    ValueError: ``rtol`` is negative or NaN.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from saggs_jax.discovery import discover
    >>> def mlp(p, x): return jax.nn.relu(x @ p["up"]) @ p["down"]
    >>> params = {"up": jnp.ones((3, 4)), "down": jnp.ones((4, 2))}
    >>> [(p.a, p.b, p.axes) for p in discover(mlp, params, jnp.ones((2, 3)))]
    [('up', 'down', (1, 0))]
    >>> shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    >>> discover(mlp, shapes, jnp.ones((2, 3))).confirmation  # traced only
    'none'
  """
  if rtol is not None and not rtol >= 0:  # NaN too
    raise ValueError(f"rtol must be a non-negative number, got {rtol!r}.")
  if "seed" in example_kwargs:  # discover's own argument until it took key=, as check_symmetry
    raise TypeError(
      "discover takes key=jax.random.key(seed) for its random factors, not seed=; a model"
      " keyword named seed goes in through functools.partial(apply_fn, seed=...)."
    )
  seed = 0 if key is None else _seed(key)
  found = _trace(apply_fn, params, example_args, example_kwargs)
  analysis = found.analysis
  if found.concrete:
    outcomes, first_order = _check(found, example_args, example_kwargs, rtol, seed)
    confirmation = "parameters" if first_order else "parameters, finite only"
  elif reduced is not None:
    small_fn, small_params, *small_args = reduced
    small = _trace(small_fn, small_params, small_args, {})
    if not small.concrete:
      raise ValueError("discover: reduced=(apply_fn, params, *args) needs concrete parameters.")
    outcomes = _translate(found, small, _check(small, small_args, {}, rtol, seed)[0])
    confirmation = "reduced"
  else:
    outcomes = [(insts, 0, _ABSTRACT) for insts in found.groups_of.values()]
    confirmation = "none"
  pairs, rejections, confirmed = [], list(analysis.rejected), []
  for insts, groups, reason in outcomes:
    interleaved = _interleaved(analysis, insts[0])
    if reason is None and interleaved is not None:
      unit, part = interleaved
      reason = _INTERLEAVED.format(groups, repr(analysis.names[unit]), part.axis, part.period)
    if reason is None:
      confirmed.append(insts)
      pairs += declarations.declare(analysis.units, analysis.names, analysis.shapes, insts, groups)
    else:
      rejections += [_rejection(analysis, i, reason) for i in insts]
  patterns, copies = roles.roles(analysis, found.names, found.shapes, confirmed)
  return Discovery(pairs, declarations.rejected(rejections), patterns, confirmation, copies)


class _Traced(NamedTuple):
  """A model read: its function on a list of parameter leaves, and the candidates by kind."""

  fn: Callable[..., Any]
  leaves: list
  names: list[str]
  shapes: list[tuple[int, ...]]
  out_avals: list
  analysis: Analysis
  groups_of: dict[tuple, list[Candidate]]  # declarations.key -> instances, in tree order

  @property
  def concrete(self) -> bool:
    return not any(isinstance(x, (jax.ShapeDtypeStruct, core.Tracer)) for x in self.leaves)


def _trace(apply_fn, params, args, kwargs) -> _Traced:
  """``apply_fn(params, *args, **kwargs)`` traced on shapes and analysed."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  traced = [paths.is_parameter(x) for _, x in flat]
  names = [paths.path_str(k) for (k, _), t in zip(flat, traced) if t]
  leaves = [x for (_, x), t in zip(flat, traced) if t]

  def fn(arrays, *args, **kwargs):
    arrays = iter(arrays)
    tree = treedef.unflatten([next(arrays) if t else x for (_, x), t in zip(flat, traced)])
    return apply_fn(tree, *args, **kwargs)

  abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
  closed = jax.make_jaxpr(lambda p, a, k: fn(p, *a, **k))(abstract, args, kwargs)
  shapes = [tuple(x.shape) for x in leaves]
  floating = [bool(jnp.issubdtype(x.dtype, jnp.floating)) for x in leaves]
  analysis = Analysis(closed, names, shapes, floating)
  units = analysis.units
  groups_of: dict[tuple, list[Candidate]] = collections.defaultdict(list)
  for inst in sorted(
    analysis.candidates,  # in the order of the tree
    key=lambda i: (units[i.a[0][0]].leaf, i.a[0][0]),
  ):
    groups_of[declarations.key(units, analysis.names, analysis.shapes, inst)].append(inst)
  return _Traced(fn, leaves, names, shapes, list(closed.out_avals), analysis, dict(groups_of))


def _options(found: _Traced, instances: list[Candidate]) -> list[int]:
  """The groupings to try for a kind of candidate, finest first."""
  sizes = [found.analysis.shapes[unit][axis] for unit, axis in instances[0].a + instances[0].b]
  return group_options(sizes, set().union(*(i.splits for i in instances)))


def _seed(key: jax.Array) -> np.ndarray:
  """The NumPy seed of the numerical check's random factors, from a JAX PRNG key (typed, or
  the raw uint32 data of ``jax.random.PRNGKey``)."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  return np.asarray(key, np.uint32).ravel()


def _check(found: _Traced, args, kwargs, rtol, seed) -> tuple[list, bool]:
  """``(instances, groups, reason)`` per outcome (``reason`` None where confirmed), and
  whether the first-order count ran; the numerical check on ``found``'s parameters."""
  if not found.groups_of:  # the check compiles the model: only when there is something to check
    return [], True
  rtol = default_rtol(found.leaves + found.out_avals) if rtol is None else rtol
  analysis = found.analysis
  checker = Checker(
    found.fn, found.leaves, args, kwargs, rtol, seed, analysis.units, analysis.candidates
  )
  outcomes = []
  for instances in found.groups_of.values():
    passed, failed = confirm(checker, instances, _options(found, instances))
    outcomes += [
      (insts, groups, None if tested else _UNCONFIRMED) for insts, groups, tested in passed
    ]
    outcomes += [([i], 0, _REFUTED) for i in failed]
  return outcomes, checker.first_order


def _translate(found: _Traced, small: _Traced, small_outcomes: list) -> list:
  """``found``'s candidates as a width-reduced copy's outcomes confirm them: a kind confirmed
  there in every instance at once is confirmed here at the grouping of the same rank among
  its options (per channel, per head, per KV head, ..., one group), if both have as many."""
  small_key = {_kind(k): k for k in small.groups_of}
  key_of = {id(i): k for k, insts in small.groups_of.items() for i in insts}
  there = collections.defaultdict(list)
  for outcome in small_outcomes:
    there[key_of[id(outcome[0][0])]].append(outcome)
  outcomes = []
  for key, instances in found.groups_of.items():
    k = small_key.get(_kind(key))
    done = there[k] if k is not None else []
    options, reason = _options(found, instances), _NOT_IN_REDUCED
    if k is not None and len(done) == 1 and done[0][2] is None:
      small_options = _options(small, small.groups_of[k])
      if len(small_options) == len(options):
        outcomes.append((instances, options[small_options.index(done[0][1])], None))
        continue
      reason = _NO_MATCH
    elif done and all(r == _REFUTED for *_, r in done):
      reason = _REFUTED
    outcomes.append((instances, 0, reason))
  return outcomes


def _kind(key: tuple) -> tuple:
  """A kind's key without sizes (a fused leaf's blocks by index, no shapes), to match a reduced
  copy."""
  name, rel, parts, counts, axes, stacked, _ = key
  parts = tuple(p and (p.axis, p.bounds.index((p.lo, p.hi)), len(p.bounds)) for p in parts)
  return name, rel, parts, counts, axes, stacked


def _interleaved(analysis: Analysis, inst: Candidate):
  """``(unit, part)`` of a member of ``inst`` that is a block interleaved with others, if one."""
  for unit, _ in inst.a + inst.b + inst.follow_a + inst.follow_b:
    part = analysis.units[unit].part
    if part is not None and part.period:
      return unit, part
  return None


def _rejection(analysis: Analysis, inst: Candidate, reason: str):
  return analysis.rejection([u for u, _ in inst.a], [u for u, _ in inst.b], reason)
