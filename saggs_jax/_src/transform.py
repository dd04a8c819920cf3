"""SAGGS as optax transformations: balancing the norms inside every declared pair.

:func:`scale_by_saggs` (and its aliases :func:`saggs`, :func:`soft`) is a symmetry stage
with a ``before`` hook (:mod:`saggs_jax._src.stage`): on the updates that balance, its
factors move the parameters to the balanced representative ``T_c(p)`` and the chain moves
the gradient and the earlier moments with them, so the inner optimizer steps from there.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from saggs_jax._src import paths
from saggs_jax._src.balance import compute_factors
from saggs_jax._src.numerics import AxisName, Factors, is_explicit, ordered_control_flow, replicated
from saggs_jax._src.pairs import Pair
from saggs_jax._src.plan import Plan, resolve
from saggs_jax._src.shard_map_groups import (
  GlobalShapes,
  check_axis_name,
  check_global,
  check_whole_groups,
)
from saggs_jax._src.stage import Stage, SymmetryTransformation, stage_pairs, symmetry_stage
from saggs_jax._src.transport import register_transport
from saggs_jax._src.validation import check_number


class SaggsState(NamedTuple):
  """State of a SAGGS stage.

  Attributes:
    step: number of updates seen so far (not named ``count``, so that
      ``optax.tree_utils.tree_get(state, "count")`` finds the optimizer's own).
    factors: the factors applied by the latest update, keyed by pair instance
      (``"a_path|b_path"``), each of shape ``stacked_shape + (groups,)``; all
      ones after an update that ``every`` skipped. Log them to watch SAGGS work.
    residual: how far the joint solve of overlapping pairs was from converged
      when the latest balancing stopped: the largest move of a log-factor in
      its last sweep (see :func:`saggs_jax._src.balance.solve`). At most
      ``saggs_jax._src.balance.TOLERANCE`` when it converged; larger means it hit its
      iteration cap and the pairs are not exactly balanced. 0 without overlaps
      and on updates that do not balance. Read on the host; the update never
      syncs on it.
    global_shapes: with ``axis_name``, the parameters' shapes as ``init`` saw them
      (:class:`GlobalShapes`, no array); a leaf for ``optax.tree.map_params``' placeholder parameters.

  Example:
    >>> import jax.numpy as jnp, optax, saggs_jax as saggs
    >>> pairs = [saggs.Pair("up", "down", axes=(1, 0))]
    >>> params = {"up": jnp.full((2, 3), 4.0), "down": jnp.ones((3, 2))}
    >>> tx = saggs.chain(optax.sgd(0.0), saggs.saggs(pairs))
    >>> _, (_, stage) = tx.update(params, tx.init(params), params)
    >>> int(stage.step), stage.factors["up|down"].tolist()  # c = (||B_g|| / ||A_g||)^(1/2)
    (1, [0.5, 0.5, 0.5])
  """

  step: jax.Array
  factors: Factors | jax.Array  # a placeholder array when init sees no parameters
  residual: jax.Array
  global_shapes: GlobalShapes | jax.Array = GlobalShapes()


# An earlier symmetry stage's factors record what it applied; they are not moments.
register_transport(SaggsState, {})


def _no_balancing(plan, params, fn=None):
  """Factors of ones and residual 0: both branches of a ``lax.cond`` must agree in type.
  Without ``fn`` that is the plan's, float32 factors of each instance's ``factor_shape``;
  with it, the type ``fn(params)`` returns (its sharding under an Explicit mesh, its
  varying manual axes inside ``shard_map``), found by tracing the norms of every leaf."""
  if fn is None:
    return {i.key: jnp.ones(i.factor_shape, jnp.float32) for i in plan.instances}, jnp.float32(0)
  factors, residual = jax.eval_shape(fn, params)
  return jax.tree.map(jnp.ones_like, factors), jnp.zeros_like(residual)


def _typed(params) -> bool:
  """Whether the factors' type depends on more than the plan: on the shardings of
  Explicit-mode ``params``, or inside ``shard_map`` on their varying manual axes."""
  return bool(jax.sharding.get_abstract_mesh().manual_axes) or any(
    is_explicit(x) for x in jax.tree.leaves(params)
  )


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


def scale_by_saggs(
  pairs: Sequence[Pair], strength: float = 1.0, every: int = 1, axis_name: AxisName = None
) -> SymmetryTransformation:
  """Balances the Frobenius norms inside every declared symmetry pair.

  On updates ``1, every + 1, 2 * every + 1, ...`` the stage balances *before* the inner
  optimizer steps. For each pair instance and group g, with ``A_g``, ``B_g`` the group
  slices of the current parameters,

    c_g = (||B_g|| / ||A_g||) ** (strength / 2),   A_g <- c_g A_g,   B_g <- B_g / c_g,

  and :func:`saggs_jax.chain` moves the gradient (``g_A / c``, ``g_B * c``) and the moments
  of every stage before it with them; the update lands on ``T_c(p) + u``. ``strength=1``
  equalises the norms (the orbit's canonical member), so equivalent states follow one
  trajectory at ``every=1``; a smaller strength shrinks ``log(||A_g||/||B_g||)`` by
  ``1 - strength``. Norms are scale-safe, and one update moves a weight by at most
  ``2**±10`` in float32 (docs/how_it_works.md).

  Args:
    pairs: the :class:`~saggs_jax.Pair` declarations; none gives a stage that changes
      nothing.
    strength: in (0, 1]; 1 is hard SAGGS.
    every: balance on updates 1, every + 1, 2 * every + 1, ...
    axis_name: inside ``shard_map`` only: the mesh axes splitting each group's entries,
      whose partial norms are summed (``()`` when shards hold whole groups;
      docs/multi_host.md). Outside ``shard_map`` leave it None.

  Returns:
    A :class:`SymmetryTransformation`: chain it after the inner optimizer with
    :func:`saggs_jax.chain`, or wrap the optimizer with :func:`saggs_jax.wrap`.

  References:
    Bum Jun Kim, `Same Function, Different Trajectory: No Standard Optimizer Is
    Equivariant to Transformer Reparameterization`, preprint, 2026.

  Example:
    >>> import jax.numpy as jnp, optax, saggs_jax as saggs
    >>> params = {"q": jnp.full((2, 2), 4.0), "k": jnp.ones((2, 2))}  # norms 8 and 2
    >>> tx = saggs.chain(optax.sgd(0.0), saggs.scale_by_saggs([saggs.Pair("q", "k")]))
    >>> updates, state = tx.update(params, tx.init(params), params)
    >>> new = optax.apply_updates(params, updates)
    >>> float(jnp.linalg.norm(new["q"])), float(jnp.linalg.norm(new["k"])), float(state[1].factors["q|k"])
    (4.0, 4.0, 0.5)
  """
  pairs = stage_pairs(pairs, "saggs_jax.scale_by_saggs")
  check_axis_name(axis_name)
  check_number("strength", strength, lambda s: 0 < s <= 1, "in (0, 1]", integer=False)
  check_number("every", every, lambda k: k >= 1, ">= 1", integer=True)

  def factors_of(plan, params, axis_name=axis_name):
    return compute_factors(plan, params, strength, axis_name)

  def step_factors(plan, params):  # what one update applies: at most step_limits
    factors, residual = factors_of(plan, params)
    return _within_step(plan, params, factors), residual

  def scheduled_factors(plan, count, params):
    """The factors of update number ``count`` and the solve's residual: ones and 0 when it
    does not balance."""
    if every == 1:
      return step_factors(plan, params)
    scheduled = (count - 1) % every == 0
    typed = (lambda q: factors_of(plan, q)) if _typed(params) else None
    none = lambda p: _no_balancing(plan, p, typed)  # noqa: E731
    if ordered_control_flow():
      factors = jax.lax.cond(scheduled, lambda p: step_factors(plan, p), none, params)
    else:  # the norms' collectives must run on every update (see ordered_control_flow)
      factors = jax.tree.map(
        functools.partial(jnp.where, scheduled), step_factors(plan, params), none(params)
      )
    return jax.tree.map(replicated, factors)  # else XLA may shard them, then gather each update

  def init(params):  # may run outside shard_map: no axis to sum over
    step, zero = jnp.zeros([], jnp.int32), jnp.zeros([], jnp.float32)
    if not jax.tree.leaves(params):
      # optax.tree.map_params traces init on a leafless placeholder for the params to
      # find the params-shaped parts of a state; a leaf here stands for any subtree there.
      return SaggsState(step, jnp.ones([], jnp.float32), zero, zero)
    shapes = None  # only an update inside shard_map (axis_name given) checks against them
    if axis_name is not None and not jax.sharding.get_abstract_mesh().manual_axes:
      shapes = tuple((p, tuple(x.shape)) for p, x in paths.leaves_with_paths(params))
    # The factors' type is the plan's, the one an update's norms give without tracing them
    # (their cost grows with the leaves).
    factors, residual = _no_balancing(resolve(pairs, params), params)
    return SaggsState(step, factors, residual, GlobalShapes(shapes))

  def before(state, params, plan, **extra_args):
    del extra_args
    check_global(axis_name)
    check_whole_groups(plan, state.global_shapes, axis_name)
    step = jnp.asarray(optax.safe_increment(state.step))
    factors, residual = scheduled_factors(plan, step, params)
    return factors, SaggsState(step, factors, residual, state.global_shapes)

  name = "saggs_jax.saggs" if strength == 1 else "saggs_jax.soft"
  return symmetry_stage(Stage(name, pairs, init, before=before))


def saggs(
  pairs: Sequence[Pair], every: int = 1, axis_name: AxisName = None
) -> SymmetryTransformation:
  """Hard SAGGS: equalise the norms inside each pair on updates 1, every + 1, ...

  Alias of :func:`scale_by_saggs` with ``strength=1``.

  References:
    Bum Jun Kim, `Same Function, Different Trajectory: No Standard Optimizer Is
    Equivariant to Transformer Reparameterization`, preprint, 2026.

  Example:
    >>> import optax, saggs_jax as saggs
    >>> pairs = [saggs.Pair("attn/q_proj/kernel", "attn/k_proj/kernel", axes=(1, 1), groups=4)]
    >>> tx = saggs.chain(optax.adamw(3e-4), saggs.saggs(pairs, every=100))
    >>> wrapped = saggs.wrap(optax.adamw(3e-4), saggs.saggs(pairs, every=100))  # as one wrapper
  """
  pairs = stage_pairs(pairs, "saggs_jax.saggs")
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

  Example:
    >>> import optax, saggs_jax as saggs
    >>> pairs = [saggs.Pair("mlp/up_proj/kernel", "mlp/down_proj/kernel", axes=(1, 0))]
    >>> tx = saggs.chain(optax.adamw(3e-4, weight_decay=0.1), saggs.soft(pairs, strength=0.5))
  """
  pairs = stage_pairs(pairs, "saggs_jax.soft")
  return scale_by_saggs(pairs, strength=strength, every=every, axis_name=axis_name)
