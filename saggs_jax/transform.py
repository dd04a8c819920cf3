"""SAGGS as optax transformations, and a chain that transports earlier moments.

A symmetry stage sits last in :func:`chain`, after the inner optimizer. On the
updates that balance, it moves the parameters to the balanced representative
``T_c(p)``, transports the incoming gradient and the moments of every earlier
stage with the same factors, lets the inner optimizer step from there, and
returns the updates that land on ``T_c(p) + u``. The rescaling happens on the
inner optimizer's inputs, so it fuses into that optimizer's own kernels.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from saggs_jax import paths
from saggs_jax.balance import (
  AxisName,
  Factors,
  compute_dtype,
  compute_factors,
  leaf_multiplier,
  replicated,
  scale_tree,
)
from saggs_jax.degrees import measure
from saggs_jax.numerics import is_explicit, ordered_control_flow
from saggs_jax.pairs import Pair, Plan, as_pairs, resolve
from saggs_jax.scaling import Shared
from saggs_jax.transport import register_transport, transport


class SaggsState(NamedTuple):
  """State of a SAGGS stage.

  Attributes:
    count: number of updates seen so far.
    factors: the factors applied by the latest update, keyed by pair instance
      (``"a_path|b_path"``), each of shape ``stacked_shape + (groups,)``; all
      ones after an update that ``every`` skipped. Log them to watch SAGGS work.
    residual: how far the joint solve of overlapping pairs was from converged
      when the latest balancing stopped: the largest move of a log-factor in
      its last sweep (see :func:`saggs_jax.balance.solve`). At most
      ``saggs_jax.balance.TOLERANCE`` when it converged; larger means it hit its
      iteration cap and the pairs are not exactly balanced. 0 without overlaps
      and on updates that do not balance. Read on the host; the update never
      syncs on it.

  Example::

    >>> import jax.numpy as jnp, optax, saggs_jax as saggs
    >>> pairs = [saggs.Pair("up", "down", axes=(1, 0))]
    >>> params = {"up": jnp.full((2, 3), 4.0), "down": jnp.ones((3, 2))}
    >>> tx = saggs.chain(optax.sgd(0.0), saggs.saggs(pairs))
    >>> _, (_, stage) = tx.update(params, tx.init(params), params)
    >>> int(stage.count), stage.factors["up|down"].tolist()  # c = (||B_g|| / ||A_g||)^(1/2)
    (1, [0.5, 0.5, 0.5])
  """

  count: jax.Array
  factors: Factors | jax.Array  # a placeholder array when init sees no parameters
  residual: jax.Array


# An earlier symmetry stage's factors record what it applied; they are not moments.
register_transport(SaggsState, {})


class SymmetryTransformation(optax.GradientTransformationExtraArgs):
  """An optax transformation that also acts on the stages before it.

  ``around(prior, grads, state, prior_states, params, degrees=None, **extra_args)`` runs
  ``prior``, the stages before this one as ``prior(grads, prior_states, params)
  -> (updates, prior_states)``, itself (so it can transform their inputs, their
  outputs or both) and returns ``(updates, state, prior_states)``; ``degrees``
  are the transport degrees of ``prior_states`` that :func:`chain` measured
  (:func:`saggs_jax.degrees.measure`) on the pairs ``resolve(params)`` gives;
  ``extra_args`` are the keyword arguments of the chain's ``update``
  (:func:`saggs_jax.qk_clip` reads ``max_logits`` there), which ``prior``
  passes on to the stages before it.
  :func:`chain` calls it; a plain ``optax.chain`` calls ``update``, which can
  balance the parameters only.

  Example::

    >>> import optax, saggs_jax as saggs
    >>> stage = saggs.saggs([saggs.Pair("up", "down", axes=(1, 0))])
    >>> isinstance(stage, saggs.SymmetryTransformation), callable(stage.around)
    (True, True)
  """

  around: Callable[..., tuple]
  resolve: Callable[..., Plan] | None

  def __new__(
    cls,
    init: optax.TransformInitFn,
    update: optax.TransformUpdateExtraArgsFn,
    around: Callable[..., tuple],
    resolve: Callable[..., Plan] | None = None,
  ) -> SymmetryTransformation:
    self = super().__new__(cls, init, update)
    self.around, self.resolve = around, resolve
    return self


def _no_balancing(fn, params, types: dict):
  """Factors of ones and residual 0, of the type ``fn(params)`` returns (shape, dtype and,
  under an Explicit mesh, sharding), found by tracing only: both branches of a
  ``lax.cond`` must agree. ``types`` keeps them per type of ``params``, so that an update
  traces the balancing once, not twice."""
  key = (jax.tree.structure(params), tuple(jax.typeof(x) for x in jax.tree.leaves(params)))
  if key not in types:
    types[key] = jax.eval_shape(fn, params)
  factors, residual = types[key]
  return jax.tree.map(jnp.ones_like, factors), jnp.zeros_like(residual)


# An update may shrink a weight by at most 2**-k, k as large as keeps the landed weight's
# relative error within 2**-ERROR_BITS (see step_limits).
ERROR_BITS = 14


def step_limits(plan: Plan, params: Any) -> dict[str, float]:
  """Per pair instance, the largest ``|log c|`` one update applies.

  The update lands on ``p * m`` (``m`` the product of a leaf's factors) as
  ``p + (p * m - p)`` in the leaf's dtype: when ``m`` is tiny, ``p * m - p`` rounds
  at the precision of ``p``, and the result loses ``log2(1 / m)`` bits
  (``q * 1e-25`` would land on 0). With unit roundoff ``2**-b`` the error is at most
  ``(1 / m + 1) 2**-b`` relative, so ``m >= 2**-k`` with
  ``k = max(1, b - ERROR_BITS)`` keeps it within ``2**-ERROR_BITS + 2**-b``; at
  ``k = 1`` (bfloat16, float16) ``p * m - p`` is exact (Sterbenz) and the update lands on
  ``p * m`` exactly. float32 allows ``2**-10`` per update, float64 ``2**-39``. A leaf in
  ``n`` instances splits its bound among them (disjoint blocks of a leaf count
  apart: an entry moves by the factors of its own piece only). A larger imbalance
  is balanced over several updates, each within the bound.
  """
  dtypes = {path: leaf.dtype for path, leaf in paths.leaves_with_paths(params)}

  def bits(name, key):  # k for the leaf's dtype, shared by the factors of each entry
    b = jnp.finfo(dtypes[plan.part(name).path]).nmant + 1
    return max(1, b - ERROR_BITS) / max(
      len(plan.pieces[k].slots) for k in plan.pieces_of(name, key)
    )

  return {
    i.key: float(np.log(2.0))
    * min(bits(n, i.key) for n in i.members_a + i.members_b + i.followers_a + i.followers_b)
    for i in plan.instances
  }


def _within_step(plan, params, factors):
  """``factors`` clipped to :func:`step_limits`."""
  limits = step_limits(plan, params)
  return {
    k: jnp.clip(f, np.exp(-limits[k]), np.exp(limits[k])).astype(f.dtype)
    for k, f in factors.items()
  }


def _land_on(params, updates, target, plan, factors):
  """Updates that move the declared leaves of ``params`` to ``target``; others untouched.

  Where the factor is 1 (which includes every group with a zero or non-finite
  norm) the inner update is kept bit for bit: ``target - params`` would
  perturb it by rounding, and turn an inf parameter into NaN (inf - inf).
  """

  def visit(key_path, u, p, t):
    slots = plan.slots.get(paths.path_str(key_path))
    if slots is None:
      return u
    dtype = compute_dtype(p.dtype)
    moved = (t.astype(dtype) - p.astype(dtype)).astype(u.dtype)
    return jnp.where(leaf_multiplier(slots, p, factors, 1.0, dtype) == 1, u, moved)

  return jax.tree_util.tree_map_with_path(visit, updates, params, target)


def _check_number(name, value, ok, interval, integer):
  kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
  if isinstance(value, bool) or not isinstance(value, kinds) or not ok(value):
    raise ValueError(
      f"{name} must be {'an int' if integer else 'a number'} {interval}, got {value!r}."
    )


def _check_axis_name(axis_name) -> None:
  if not (
    axis_name is None
    or isinstance(axis_name, str)
    or (isinstance(axis_name, (tuple, list)) and all(isinstance(a, str) for a in axis_name))
  ):
    raise ValueError(
      f"axis_name must be None, a mesh axis name or a tuple of them, got {axis_name!r}."
    )


def _check_global(axis_name) -> None:
  """Inside ``shard_map`` a leaf is a shard: its norms alone would balance per shard."""
  manual = jax.sharding.get_abstract_mesh().manual_axes
  if manual and axis_name is None:
    raise ValueError(
      f"SAGGS is traced inside shard_map (manual mesh axes {manual}), where each device sees"
      " only its shard and would balance it on its own. Pass axis_name= the mesh axes that"
      " split the parameters' groups (FSDP or data axes; the norms are summed over them), or"
      " axis_name=() if every shard holds whole groups."
    )


def _check_whole_groups(plan, global_shapes, axis_name) -> None:
  """Inside ``shard_map`` a pair is resolved on each device's shard. Declared ``groups``
  along an axis that the shards split would resolve there to smaller groups (and the
  psum over ``axis_name`` would add different groups together): refuse it. The global
  shapes are those ``init`` saw outside ``shard_map``; without them, a psum over
  ``axis_name`` could add pieces of different groups, and nothing inside ``shard_map``
  says which axes the shards split: refuse that too."""
  if not jax.sharding.get_abstract_mesh().manual_axes:
    return
  for inst in plan.instances:
    if inst.pair.groups is None:
      continue
    for name in inst.members_a + inst.members_b + inst.followers_a + inst.followers_b:
      axis, path = plan.slot(name, inst.key).axis, plan.part(name).path
      local, whole = plan.shapes[path], global_shapes.get(path)
      if axis is None:
        continue
      if whole is None and axis_name:
        raise ValueError(
          f"{inst.pair!r} declares groups={inst.pair.groups} along axis {axis} of {path!r}"
          f" (shape {local} per device) inside shard_map, where axis_name={axis_name!r} sums"
          " its norms over shards; if the shards split that axis, pieces of different groups"
          " would be summed as one. The global shapes tell: call tx.init on the global"
          " parameters outside shard_map (jit on the mesh), or balance outside shard_map."
        )
      if whole is not None and local[axis] != whole[axis]:
        raise ValueError(
          f"{inst.pair!r} declares groups={inst.pair.groups} along axis {axis} of {path!r},"
          f" which shard_map splits over devices (shape {whole} holds {local} per device):"
          " each device would balance its slices as groups of their own. Keep that axis"
          " whole on every device, or balance outside shard_map (jit on a mesh)."
        )


def _caller():
  """The innermost frame outside saggs_jax, optax and jax: the user's line."""
  internal = tuple(os.path.dirname(m.__file__ or "") for m in (optax, jax)) + (
    os.path.dirname(__file__),
  )
  frame = sys._getframe(1)
  while frame is not None and frame.f_code.co_filename.startswith(internal):
    frame = frame.f_back
  return frame


def scale_by_saggs(
  pairs: Sequence[Pair], strength: float = 1.0, every: int = 1, axis_name: AxisName = None
) -> SymmetryTransformation:
  """Balances the Frobenius norms inside every declared symmetry pair.

  On updates ``1, every + 1, 2 * every + 1, ...`` (the first update is number
  1) the stage balances *before* the inner optimizer steps. For each pair
  instance and group g, with ``A_g``, ``B_g`` the group slices of the current
  parameters,

    c_g = (||B_g|| / ||A_g||) ** (strength / 2),   A_g <- c_g A_g,   B_g <- B_g / c_g,

  the incoming gradient is transported with them (``g_A / c``, ``g_B * c``:
  the gradient at the balanced point) and, through :func:`saggs_jax.chain`,
  so are the moments of every stage before it. The inner optimizer then steps
  from the balanced state: the update returned lands on ``T_c(p) + u``.

  ``strength=1`` equalises the two norms (the canonical representative of the
  symmetry orbit); a smaller strength shrinks ``log(||A_g||/||B_g||)`` by the
  factor ``1 - strength``. The function computed by the model is unchanged by
  the balancing. With hard SAGGS and ``every=1`` the whole optimizer is a
  function of the orbit: equivalent states (same function, transported
  moments, same count) follow one trajectory. On updates that do not balance
  the factors are ones from a ``lax.cond`` that computes no norms and
  communicates nothing (on XLA:CPU across processes the norms run on every update
  and are discarded: no collective may sit in a ``lax.cond`` there, see
  :func:`~saggs_jax.numerics.ordered_control_flow`).

  Inside a plain ``optax.chain`` the stage cannot reach the optimizer before
  it: on the same updates it balances the parameters *after* that optimizer's
  step (so the function trained is the inner optimizer's), leaves its moments
  untransported, and warns once.

  Norms are scale-safe and a factor never overflows a leaf's dtype (see
  :mod:`saggs_jax.balance`). One update rescales a weight by at most
  :func:`step_limits` (``2**±10`` in float32), so that adding the update keeps
  the function; a larger imbalance is balanced over several updates.

  Args:
    pairs: the :class:`~saggs_jax.Pair` declarations; none (a
      :func:`saggs_jax.discover` that found nothing) gives a stage that
      changes nothing.
    strength: in (0, 1]; 1 is hard SAGGS.
    every: balance on updates 1, every + 1, 2 * every + 1, ...
    axis_name: inside ``shard_map`` only: the mesh axes over which each
      group's entries are split (FSDP or data axes), whose partial norms are
      summed; ``()`` when every shard holds whole groups. Outside
      ``shard_map`` leave it None: jit sees global arrays.

  Returns:
    A :class:`SymmetryTransformation`. Chain it last, after the inner
    optimizer, with :func:`saggs_jax.chain`.

  References:
    Bum Jun Kim, `Same Function, Different Trajectory: No Standard Optimizer Is
    Equivariant to Transformer Reparameterization`, preprint, 2026 (SAGGS
    and its damped variant, Soft SAGGS).

  Example::

    >>> import jax.numpy as jnp, optax, saggs_jax as saggs
    >>> params = {"q": jnp.full((2, 2), 4.0), "k": jnp.ones((2, 2))}  # norms 8 and 2
    >>> tx = saggs.chain(optax.sgd(0.0), saggs.scale_by_saggs([saggs.Pair("q", "k")]))
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state, params)
    >>> new = optax.apply_updates(params, updates)
    >>> float(jnp.linalg.norm(new["q"])), float(jnp.linalg.norm(new["k"]))
    (4.0, 4.0)
    >>> float(state[1].factors["q|k"])  # c = sqrt(2 / 8)
    0.5
  """
  pairs = as_pairs(pairs)
  _check_axis_name(axis_name)
  _check_number("strength", strength, lambda s: 0 < s <= 1, "in (0, 1]", integer=False)
  _check_number("every", every, lambda k: k >= 1, ">= 1", integer=True)
  warned, global_shapes = [], {}  # the shapes init saw outside shard_map
  types = {}  # the factors' types per parameter type (see _no_balancing)

  def factors_of(params, axis_name=axis_name):
    return compute_factors(resolve(pairs, params), params, strength, axis_name)

  def step_factors(params):  # what one update applies: at most step_limits
    factors, residual = factors_of(params)
    return _within_step(resolve(pairs, params), params, factors), residual

  def scheduled_factors(count, params):
    """The factors of update number ``count`` and the solve's residual: ones and 0 when it
    does not balance."""
    if every == 1:
      return step_factors(params)
    scheduled, none = (count - 1) % every == 0, lambda p: _no_balancing(factors_of, p, types)
    if ordered_control_flow():
      factors = jax.lax.cond(scheduled, step_factors, none, params)
    else:  # the norms' collectives must run on every update (see ordered_control_flow)
      factors = jax.tree.map(partial(jnp.where, scheduled), step_factors(params), none(params))
    return jax.tree.map(replicated, factors)  # else XLA may shard them, then gather each update

  def init(params):  # may run outside shard_map: no axis to sum over
    count = jnp.zeros([], jnp.int32)
    if not jax.sharding.get_abstract_mesh().manual_axes:
      global_shapes.update((p, tuple(x.shape)) for p, x in paths.leaves_with_paths(params))
    if not jax.tree.leaves(params):
      # optax.tree.map_params traces init on a leafless placeholder for the params to
      # find the params-shaped parts of a state; the factors are not one of them.
      return SaggsState(count, jnp.ones([], jnp.float32), jnp.zeros([], jnp.float32))
    if any(is_explicit(x) for x in jax.tree.leaves(params)):  # their sharding comes from tracing
      fn = lambda p: factors_of(p, axis_name=None)  # noqa: E731
      return SaggsState(count, *_no_balancing(fn, params, types))
    # Else their type is the plan's: float32 factors of each instance's factor_shape, the
    # ones _no_balancing would find by tracing the norms of every leaf at full size.
    plan = resolve(pairs, params)
    factors = {i.key: jnp.ones(i.factor_shape, jnp.float32) for i in plan.instances}
    return SaggsState(count, factors, jnp.zeros([], jnp.float32))

  def start(state, params):  # -> the plan, the next count, and the params, checked present
    if params is None:
      raise ValueError("SAGGS needs the current parameters: call update(updates, state, params).")
    _check_global(axis_name)
    plan = resolve(pairs, params)
    _check_whole_groups(plan, global_shapes, axis_name)
    return plan, jnp.asarray(optax.safe_increment(state.count)), params

  def around(prior, grads, state, prior_states, params, degrees=None, **extra_args):
    del extra_args  # the stages before it receive them through prior
    plan, count, params = start(state, params)
    factors, residual = scheduled_factors(count, params)
    shared = Shared(factors)  # the same multipliers for parameters, gradients and moments
    balanced = scale_tree(plan, params, shared, 1.0)
    updates, prior_states = prior(
      scale_tree(plan, grads, shared, -1.0),
      transport(plan, prior_states, shared, degrees=degrees),
      balanced,
    )
    updates = _land_on(params, updates, optax.apply_updates(balanced, updates), plan, shared)
    return updates, SaggsState(count, factors, residual), prior_states

  def update(updates, state, params=None, **extra_args):
    del extra_args
    if not warned:
      warned.append(True)
      frame = _caller()
      warnings.warn_explicit(
        "A SAGGS stage outside saggs_jax.chain balances the parameters after the optimizer's"
        " step but cannot transport that optimizer's moments; use saggs_jax.chain(...)"
        " instead of optax.chain(...).",
        UserWarning,
        frame.f_code.co_filename if frame else "<unknown>",
        frame.f_lineno if frame else 0,
      )
    plan, count, params = start(state, params)
    stepped = optax.apply_updates(params, updates)
    factors, residual = scheduled_factors(count, stepped)
    target = scale_tree(plan, stepped, factors, 1.0)
    return _land_on(params, updates, target, plan, factors), SaggsState(count, factors, residual)

  return SymmetryTransformation(init, update, around, lambda params: resolve(pairs, params))


def saggs(
  pairs: Sequence[Pair], every: int = 1, axis_name: AxisName = None
) -> SymmetryTransformation:
  """Hard SAGGS: equalise the norms inside each pair on updates 1, every + 1, ...

  Alias of :func:`scale_by_saggs` with ``strength=1``.

  References:
    Bum Jun Kim, `Same Function, Different Trajectory: No Standard Optimizer Is
    Equivariant to Transformer Reparameterization`, preprint, 2026.

  Example::

    >>> import optax, saggs_jax as saggs
    >>> pairs = [saggs.Pair("attn/q_proj/kernel", "attn/k_proj/kernel", axes=(1, 1), groups=4)]
    >>> tx = saggs.chain(optax.adamw(3e-4), saggs.saggs(pairs, every=100))
  """
  return scale_by_saggs(pairs, strength=1.0, every=every, axis_name=axis_name)


def soft(
  pairs: Sequence[Pair], strength: float = 0.5, every: int = 1, axis_name: AxisName = None
) -> SymmetryTransformation:
  """Soft SAGGS: move ``strength`` of the way (in log-norm) towards balance.

  Alias of :func:`scale_by_saggs`. Each application multiplies the
  log-imbalance ``log(||A_g||/||B_g||)`` by ``1 - strength``.

  References:
    Bum Jun Kim, `Same Function, Different Trajectory: No Standard Optimizer Is
    Equivariant to Transformer Reparameterization`, preprint, 2026 (Soft
    SAGGS).

  Example::

    >>> import optax, saggs_jax as saggs
    >>> pairs = [saggs.Pair("mlp/up_proj/kernel", "mlp/down_proj/kernel", axes=(1, 0))]
    >>> tx = saggs.chain(optax.adamw(3e-4, weight_decay=0.1), saggs.soft(pairs, strength=0.5))
  """
  return scale_by_saggs(pairs, strength=strength, every=every, axis_name=axis_name)


class Chain(optax.GradientTransformationExtraArgs):
  """What :func:`chain` returns: an optax transformation that also names its optimizer.

  Attributes:
    optimizer: the stages before the first symmetry stage, as one transformation
      whose state is the chain state's first entries (``tx.init(params)[:n]``, one
      per such stage); None when no stage is a symmetry stage. The later entries
      are the symmetry stages' own states, which hold no moments.
      :func:`saggs_jax.checkpoint.restore` transports a saved chain state by the
      degrees measured on it.

  Example::

    >>> import jax.numpy as jnp, optax, saggs_jax as saggs
    >>> tx = saggs.chain(optax.adamax(1e-3), saggs.saggs([saggs.Pair("q", "k")]))
    >>> params = {"q": jnp.ones((2, 2)), "k": jnp.ones((2, 2))}
    >>> len(tx.init(params)), len(tx.optimizer.init(params))
    (2, 1)
  """

  optimizer: optax.GradientTransformationExtraArgs | None

  def __new__(cls, init, update, optimizer=None) -> Chain:
    self = super().__new__(cls, init, update)
    self.optimizer = optimizer
    return self


def chain(*transforms: optax.GradientTransformation) -> Chain:
  """``optax.chain`` whose symmetry stages also transport earlier stages' moments.

  The state is a tuple of stage states, as with ``optax.chain``. When a
  :class:`SymmetryTransformation` rescales the parameters by factors ``c``, the
  states of every stage before it are transported (``mu -> mu / c``,
  ``nu -> nu / c**2`` on the A side, the inverse on the B side; see
  :func:`saggs_jax.register_transport`), each leaf by the degree it has at its
  place in the chain: ``init`` (or the first update of a parameter layout)
  measures them on a probe history of a small proxy of the parameters, from
  their shapes alone and once per layout (:func:`saggs_jax.degrees.measure`),
  and raises a TypeError naming the state and the path of a leaf that no
  degree transports, as when a stage before it clips by a global norm.

  Example::

    >>> import optax, saggs_jax as saggs
    >>> pairs = [saggs.Pair("attn/v_proj/kernel", "attn/o_proj/kernel", axes=(1, 0), groups=4)]
    >>> tx = saggs.chain(optax.adamw(3e-4), saggs.soft(pairs, strength=0.5))
  """
  stages = [
    t if isinstance(t, SymmetryTransformation) else optax.with_extra_args_support(t)
    for t in transforms
  ]
  symmetric = [isinstance(t, SymmetryTransformation) for t in stages]
  first = symmetric.index(True) if any(symmetric) else len(stages)
  if any(symmetric):
    if first == 0 or not all(symmetric[first:]):
      raise ValueError(
        f"saggs_jax.chain: the symmetry stage at position {first} must come after the optimizer"
        " it balances, and only symmetry stages may follow it (their updates land on the"
        " balanced parameters, which a later stage would change); stages are"
        f" {['symmetry' if s else 'optimizer' for s in symmetric]}. Write"
        " saggs_jax.chain(optax.adamw(...), saggs_jax.saggs(pairs))."
      )

  # The optimizer stages alone, built once: what a symmetry stage measures degrees on
  # (measure keeps them per layout), and what saggs_jax.checkpoint.restore transports a
  # saved chain state by.
  optimizer = optax.GradientTransformationExtraArgs(
    lambda params: tuple(t.init(params) for t in stages[:first]),
    lambda updates, state, params=None, **extra: run(stages[:first], updates, state, params, extra),
  )

  def degrees(n, params):
    """The degrees of the states before stage ``n`` (a symmetry stage).

    They are measured on the optimizer stages alone: a symmetry stage between them and
    stage ``n`` holds no moments (its state's rule keeps it as it is) and only moves
    theirs along the orbit, which changes no degree; probing it would need its extra
    arguments (a qk_clip's logits)."""
    if stages[n].resolve is None:
      return None
    found = measure(optimizer, params, stages[n].resolve(params))
    return None if found is None else (*found, *(None,) * (n - first))

  def init(params):
    if jax.tree.leaves(params):  # not optax.tree.map_params' leafless placeholder
      for n, s in enumerate(symmetric):
        if s:
          degrees(n, params)
    return tuple(t.init(params) for t in stages)

  def run(stages, grads, states, params, extra_args):
    if not isinstance(stages[-1], SymmetryTransformation):
      return optax.chain(*stages).update(grads, states, params, **extra_args)
    # The last symmetry stage runs everything before it, balancing its inputs.
    prior = lambda g, s, p: run(stages[:-1], g, s, p, extra_args)  # noqa: E731
    updates, state, prior_states = stages[-1].around(
      prior,
      grads,
      states[-1],
      tuple(states[:-1]),
      params,
      degrees=degrees(len(stages) - 1, params) if params is not None else None,
      **extra_args,
    )
    return updates, (*prior_states, state)

  def update(updates, state, params=None, **extra_args):
    if len(state) != len(stages):
      raise ValueError(f"State has {len(state)} stages but the chain has {len(stages)}.")
    return run(stages, updates, state, params, extra_args)

  return Chain(init, update, optimizer if any(symmetric) else None)
