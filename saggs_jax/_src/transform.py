"""SAGGS as optax transformations, and a chain that transports earlier moments.

A symmetry stage sits last in :func:`chain`, after the inner optimizer. On the
updates that balance, it moves the parameters to the balanced representative
``T_c(p)``, transports the incoming gradient and the moments of every earlier
stage with the same factors, lets the inner optimizer step from there, and
returns the updates that land on ``T_c(p) + u``. The rescaling happens on the
inner optimizer's inputs, so it fuses into that optimizer's own kernels.

Every transformation here is an ordinary optax NamedTuple of ``init`` and
``update``: a stage's ``update`` is a :class:`Stage` (what :func:`chain` runs
around the stages before it), a chain's a :class:`ChainUpdate` (which names its
optimizer), so ``_replace``, ``copy`` and optax's wrappers keep them. The
wrapper :func:`wrap` ``(inner, stage)`` is ``chain(inner, stage)`` with its state as
``SymmetryState(inner_state, stage_state)``. Each
update resolves a stage's pairs once and passes the plan down; nothing is kept
between calls: the shapes ``init`` saw outside ``shard_map``, against which a
``shard_map`` update checks its shards, travel in the state (:class:`GlobalShapes`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from saggs_jax._src import paths
from saggs_jax._src.balance import compute_factors
from saggs_jax._src.degrees import measure
from saggs_jax._src.numerics import AxisName, Factors, is_explicit, ordered_control_flow, replicated
from saggs_jax._src.pairs import Pair, Plan, as_pairs, resolve
from saggs_jax._src.scaling import Shared, land_on, scale_tree
from saggs_jax._src.transport import NESTED, register_transport, transport
from saggs_jax._src.validation import check_number


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class GlobalShapes:
  """The shapes of the parameters ``init`` saw outside ``shard_map`` (None inside it), against
  which an update inside ``shard_map`` checks that its shards hold whole groups. A pytree
  without leaves: static, so it costs nothing, is the same in every update's trace and goes
  with the state wherever the state goes (a restored one, another instance of the optimizer).

  Attributes:
    shapes: ``(path, shape)`` per parameter leaf, or None where ``init`` saw shards.
  """

  shapes: tuple[tuple[str, tuple[int, ...]], ...] | None = None

  def get(self, path: str) -> tuple[int, ...] | None:
    return dict(self.shapes or ()).get(path)


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


class Correction(NamedTuple):
  """What a stage's ``after`` hook asks of the chain once the optimizers before it stepped.

  Attributes:
    plan: the plan ``factors`` are laid out on (a finer one than the stage's pairs may be).
    factors: multipliers of the stepped parameters ``params + updates``.
    gauge: factors on the stage's pairs that move the earlier stages' states along the
      orbit, or None where no moment moves.
  """

  plan: Plan
  factors: Factors
  gauge: Factors | None = None


@dataclasses.dataclass(frozen=True)
class Stage:
  """What a symmetry stage does, for :func:`chain` to run: two hooks around the optimizers
  before it, the scaling, transport and landing being the chain's.

  Attributes:
    name: how the stage was built, for messages (``"saggs_jax.soft"``).
    pairs: its pair declarations.
    init: ``init(params)``, the stage's own state.
    before: ``before(state, params, plan, **extra_args) -> (factors, state)``: factors of the
      stage's pairs that move the parameters along the orbit before the optimizers step,
      their gradients and states with them (SAGGS); None for a stage that moves nothing
      there. ``plan`` is ``resolve(pairs, params)``, resolved once by the chain.
    after: ``after(state, params, updates, plan, **extra_args) -> (correction, state)``: a
      :class:`Correction` of ``params + updates`` once they have stepped (QK-clip reads
      ``max_logits`` in ``extra_args``); None for none.
    alone: whether the stage may run outside :func:`chain` (as in ``optax.chain``): only
      an ``after`` whose gauge moves no moment may; ``init`` refuses the others.
  """

  name: str
  pairs: tuple[Pair, ...]
  init: Callable[[Any], Any]
  before: Callable[..., tuple[Factors, Any]] | None = None
  after: Callable[..., tuple[Correction, Any]] | None = None
  alone: bool = False

  def resolve(self, params: Any) -> Plan:
    return resolve(self.pairs, params)

  def __call__(self, updates, state, params=None, **extra_args):
    if not self.alone or self.after is None:
      raise ValueError(_outside_chain(self.name))
    _check_params(params, self.name)
    correction, state = self.after(state, params, updates, self.resolve(params), **extra_args)
    return corrected(params, updates, correction), state


def corrected(params, updates, correction: Correction):
  """``updates`` landing on ``params + updates`` scaled by ``correction.factors``."""
  plan, factors = correction.plan, correction.factors
  target = scale_tree(plan, optax.apply_updates(params, updates), factors, 1.0)
  return land_on(params, updates, target, plan, factors)


def _outside_chain(name: str) -> str:
  return (
    f"{name}(pairs) outside saggs_jax.chain cannot transport the moments of the optimizer"
    " before it, so training would quietly leave the orbit. Write"
    f" saggs_jax.chain(optax.adamw(...), {name}(pairs)), or wrap the optimizer:"
    f" saggs_jax.wrap(optax.adamw(...), {name}(pairs))."
  )


def stage_pairs(pairs: Any, name: str) -> tuple[Pair, ...]:
  """``pairs`` as a tuple (:func:`~saggs_jax._src.pairs.as_pairs`); an optimizer in their place,
  the wrapper call of an earlier API, is a TypeError naming the form that wraps it."""
  if isinstance(pairs, optax.GradientTransformation):
    raise TypeError(
      f"{name} got an optimizer ({type(pairs).__name__}) where its pairs go. Wrap it with"
      f" saggs_jax.wrap(inner, {name}(pairs)), or chain saggs_jax.chain(inner, {name}(pairs))."
    )
  return as_pairs(pairs)


class SymmetryTransformation(optax.GradientTransformationExtraArgs):
  """A symmetry stage: an optax transformation that also acts on the stages before it.

  Its ``update`` is a :class:`Stage`, which :func:`chain` runs around the stages
  before it. On its own (in a plain ``optax.chain``) ``init`` refuses it where it
  could not transport the moments before it, and shows the one-line fix.

  Example:
    >>> import optax, saggs_jax as saggs
    >>> stage = saggs.saggs([saggs.Pair("up", "down", axes=(1, 0))])
    >>> isinstance(stage, saggs.SymmetryTransformation), stage.stage.name
    (True, 'saggs_jax.saggs')
  """

  @property
  def stage(self) -> Stage:
    """What :func:`chain` runs (the ``update``)."""
    return cast(Stage, self.update)


def _stage_of(tx) -> Stage | None:
  update = getattr(tx, "update", None)
  return update if isinstance(update, Stage) else None


def symmetry_stage(stage: Stage) -> SymmetryTransformation:
  """The transformation of ``stage``: its own ``init`` where it may stand alone, else one
  that refuses with the fix."""
  if stage.alone:
    return SymmetryTransformation(cast(optax.TransformInitFn, stage.init), stage)

  def init(params):
    raise ValueError(_outside_chain(stage.name))

  return SymmetryTransformation(init, stage)


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


def _check_axis_name(axis_name) -> None:
  if not (
    axis_name is None
    or isinstance(axis_name, str)
    or (isinstance(axis_name, (tuple, list)) and all(isinstance(a, str) for a in axis_name))
  ):
    raise ValueError(
      f"axis_name must be None, a mesh axis name or a tuple of them, got {axis_name!r}."
    )


# Inside shard_map a leaf is a shard, and a group may be split over devices: docs/multi_host.md
# says which axis_name sums its norms over them, and where the global shapes come from.
SHARD_MAP_AXIS_MSG = (
  "SAGGS is traced inside shard_map (manual axes {manual}) with axis_name=None: each device"
  " would balance its shard alone. Pass axis_name= the mesh axes that split the groups, or ()."
)
SHARD_MAP_SHAPES_MSG = (
  "{pair}: groups={groups} along axis {axis} of {path!r} inside shard_map, where"
  " axis_name={axis_name!r} sums its norms, need the global shapes. Call tx.init outside"
  " shard_map."
)
SHARD_MAP_SPLITS_MSG = (
  "{pair}: groups={groups} along axis {axis} of {path!r}, which shard_map splits ({size}"
  " entries, {local} per device). Keep that axis whole on each device, or balance outside"
  " shard_map."
)


def _check_global(axis_name) -> None:
  """Inside ``shard_map`` a leaf is a shard: its norms alone would balance per shard."""
  manual = jax.sharding.get_abstract_mesh().manual_axes
  if manual and axis_name is None:
    raise ValueError(SHARD_MAP_AXIS_MSG.format(manual=manual))


def _check_whole_groups(plan, global_shapes, axis_name) -> None:
  """Inside ``shard_map`` a pair is resolved on each device's shard. Declared ``groups``
  along an axis that the shards split would resolve there to smaller groups (and the
  psum over ``axis_name`` would add different groups together): refuse it. The global
  shapes are those ``init`` saw outside ``shard_map``, from the state; without them, a psum over
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
      groups = inst.pair.groups
      if whole is None and axis_name:
        raise ValueError(
          SHARD_MAP_SHAPES_MSG.format(
            pair=inst.pair.label, groups=groups, axis=axis, path=path, axis_name=axis_name
          )
        )
      if whole is not None and local[axis] != whole[axis]:
        raise ValueError(
          SHARD_MAP_SPLITS_MSG.format(
            pair=inst.pair.label,
            groups=groups,
            axis=axis,
            path=path,
            size=whole[axis],
            local=local[axis],
          )
        )


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
  :func:`~saggs_jax._src.numerics.ordered_control_flow`).

  Inside a plain ``optax.chain`` the stage could not reach the optimizer before
  it, whose moments would stay untransported: its ``init`` refuses it there and
  names the two exact forms, ``saggs_jax.chain(inner, stage)`` and the wrapper
  ``saggs_jax.wrap(inner, stage)``, whose state is ``SymmetryState(inner_state,
  stage_state)`` as optax's wrappers hold theirs.

  Norms are scale-safe and a factor never overflows a leaf's dtype (see
  :mod:`saggs_jax._src.balance`). One update rescales a weight by at most
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
    A :class:`SymmetryTransformation`: chain it last, after the inner optimizer,
    with :func:`saggs_jax.chain`, or wrap the optimizer with :func:`wrap`.

  References:
    Bum Jun Kim, `Same Function, Different Trajectory: No Standard Optimizer Is
    Equivariant to Transformer Reparameterization`, preprint, 2026 (SAGGS
    and its damped variant, Soft SAGGS).

  Example:
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
  pairs = stage_pairs(pairs, "saggs_jax.scale_by_saggs")
  _check_axis_name(axis_name)
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
    _check_global(axis_name)
    _check_whole_groups(plan, state.global_shapes, axis_name)
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


class SymmetryState(NamedTuple):
  """State of :func:`wrap`: the wrapped optimizer's and the symmetry stage's.

  Attributes:
    inner_state: the state of the wrapped optimizer, transported with the parameters.
    stage_state: the stage's own (a :class:`SaggsState`; ``EmptyState`` for qk_clip).
  """

  inner_state: Any
  stage_state: Any


register_transport(SymmetryState, {"inner_state": NESTED})


@dataclasses.dataclass(frozen=True)
class ChainUpdate:
  """The ``update`` of a :func:`chain` or a :func:`wrap`, which also names its optimizer.

  Attributes:
    optimizer: the stages before the first symmetry stage, as one transformation
      whose state is the tuple of their states (a wrapper's is ``(inner_state,)``).
    stages: the symmetry stages after it.
    run: ``run(updates, state, params, **extra_args)``, the update itself.
    wrapped: whether the state is a :class:`SymmetryState` (a :func:`wrap`), else the
      chain's tuple.
  """

  optimizer: optax.GradientTransformationExtraArgs
  stages: tuple[Stage, ...]
  run: Callable[..., tuple]
  wrapped: bool = False

  def __call__(self, updates, state, params=None, **extra_args):
    return self.run(updates, state, params, **extra_args)

  def degrees(self, params: Any, plan: Plan, state: Any = None) -> Any:
    """The transport degrees of the whole state on ``plan``, laid out like it (the
    stages' own states keep theirs); None when no parameter is declared. ``state``: the
    chain's state (or its abstract values) where the caller has it, whose optimizer entries
    are read for their shapes rather than made anew by a full-size ``init``."""
    if state is not None:  # its optimizer entries: the stages' own states come last
      state = tuple(state)
      state = state[: len(state) - len(self.stages)]
    found = measure(self.optimizer, params, plan, state)
    if found is None:
      return None
    if self.wrapped:
      return SymmetryState(found[0], None)
    return (*found, *(None,) * len(self.stages))


class Chain(optax.GradientTransformationExtraArgs):
  """What :func:`chain` and :func:`wrap` return: an optax transformation whose ``update``
  (a :class:`ChainUpdate`) also names its optimizer.

  Example:
    >>> import jax.numpy as jnp, optax, saggs_jax as saggs
    >>> tx = saggs.chain(optax.adamax(1e-3), saggs.saggs([saggs.Pair("q", "k")]))
    >>> params = {"q": jnp.ones((2, 2)), "k": jnp.ones((2, 2))}
    >>> len(tx.init(params)), len(tx.optimizer.init(params))
    (2, 1)
  """

  @property
  def optimizer(self) -> optax.GradientTransformationExtraArgs | None:
    """The stages before the first symmetry stage, as one transformation whose state is
    the chain state's first entries (``tx.init(params)[:n]``, one per such stage; a
    wrapper's ``inner_state``); None when no stage is a symmetry stage. The later entries
    are the symmetry stages' own states, which hold no moments.
    :func:`saggs_jax.checkpoint.restore` transports a saved chain state by the degrees
    measured on it."""
    update = self.update
    return update.optimizer if isinstance(update, ChainUpdate) and update.stages else None

  def init_from(self, params: Any, *optimizer_states: Any) -> Any:
    """The chain's state with the optimizer's state given rather than made anew.

    SAGGS joining a running optimizer: ``optimizer_states`` are the states of the
    transformations before the first symmetry stage, one each, as that optimizer
    alone made and updated them (an AdamW run's state at a restart). Their arrays
    are kept (in new nnx Variables, where they have them); the symmetry stages start
    afresh, so the next update balances and transports them with the parameters.

    Args:
      params: the current parameters.
      *optimizer_states: one state per transformation before the first symmetry stage.

    Returns:
      The state ``init(params)`` would make, with ``optimizer_states`` in place of
      the optimizer's fresh ones.

    Raises:
      ValueError: if the chain has no symmetry stage, or a state's structure, shapes
        or dtypes are not those the optimizer makes for ``params``.

    Example:
      >>> import jax.numpy as jnp, optax, saggs_jax as saggs
      >>> params = {"q": jnp.full((2, 2), 4.0), "k": jnp.ones((2, 2))}
      >>> adam = optax.adam(1e-2)
      >>> adam_state = adam.update(params, adam.init(params), params)[1]  # a running Adam
      >>> tx = saggs.chain(adam, saggs.saggs([saggs.Pair("q", "k")]))
      >>> state = tx.init_from(params, adam_state)
      >>> int(state[0][0].count), int(state[1].step)  # Adam's count kept, SAGGS's fresh
      (1, 0)
    """
    update = self.update
    if self.optimizer is None:
      raise ValueError("init_from: this chain has no symmetry stage; use its init.")
    update = cast(ChainUpdate, update)
    made = jax.eval_shape(update.optimizer.init, params)
    if len(optimizer_states) != len(made):
      raise ValueError(
        f"init_from takes one state per transformation before the symmetry stage: {len(made)}"
        f" here, got {len(optimizer_states)}."
      )
    for i, (given, want) in enumerate(zip(optimizer_states, made)):
      paths.check_made_by(
        given,
        want,
        f"init_from: optimizer_states[{i}]",
        "the optimizer",
        "Pass the state of the transformation before the symmetry stage.",
      )
    fresh = _placed_like(optimizer_states, tuple(s.init(params) for s in update.stages))
    kept = jax.tree.map(lambda x: x, optimizer_states)  # new nnx Variables, the same arrays
    states = (*kept, *fresh)
    return SymmetryState(*states) if update.wrapped else states


def _placed_like(placed: Any, fresh: Any) -> Any:
  """``fresh`` replicated on the devices of ``placed``'s first committed array (a restored
  state's), so that a train step sees one placement throughout: a mix of committed and
  uncommitted arguments compiles it again once its outputs come back committed."""
  committed = [x for x in jax.tree.leaves(placed) if isinstance(x, jax.Array) and x.committed]
  if not committed:
    return fresh
  sharding = committed[0].sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  elif len(sharding.device_set) != 1:
    return fresh
  return jax.device_put(fresh, sharding)


def _check_params(params, name: str) -> None:
  if params is None:
    raise ValueError(f"{name} needs the current parameters: call update(updates, state, params).")
  if isinstance(params, optax.LookaheadParams):
    raise ValueError(
      f"{name} cannot balance optax.lookahead's LookaheadParams, and balancing the fast"
      " weights alone is no way out (docs/moments.md). Train without lookahead."
    )


def chain(*transforms: optax.GradientTransformation) -> Chain:
  """``optax.chain`` whose symmetry stages also transport earlier stages' moments.

  The state is a tuple of stage states, as with ``optax.chain``. When a
  :class:`SymmetryTransformation` rescales the parameters by factors ``c``, the
  states of every stage before it are transported (``mu -> mu / c``,
  ``nu -> nu / c**2`` on the A side, the inverse on the B side; see
  :func:`saggs_jax.register_transport`), each leaf by the degree it has at its
  place in the chain: the first update traced on a parameter layout measures
  them on a probe history of a small proxy of the parameters, from their shapes
  alone and once per layout (:func:`saggs_jax._src.degrees.measure`; a restore or a
  ``canonicalize`` that needs them first measures them there), and raises a
  TypeError naming the state and the path of a leaf that no degree transports, as
  after a trust ratio over a leaf whose groups move apart. A leaf's degree is the one it
  has with every gate of the optimizer open (a clip that does not clip, an ``eps`` that is
  negligible), so a clip before the moments is exact under hard SAGGS with ``every=1``:
  ``chain(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(...)), saggs(pairs))``.
  ``init`` costs what the
  optimizer's own ``init`` costs. Each update resolves each symmetry stage's
  pairs once and passes the plan down.

  Example:
    >>> import optax, saggs_jax as saggs
    >>> pairs = [saggs.Pair("attn/v_proj/kernel", "attn/o_proj/kernel", axes=(1, 0), groups=4)]
    >>> tx = saggs.chain(optax.adamw(3e-4), saggs.soft(pairs, strength=0.5))
  """
  found = [_stage_of(t) for t in transforms]
  symmetric = [s is not None for s in found]
  first = symmetric.index(True) if any(symmetric) else len(transforms)
  if any(symmetric):
    if first == 0 or not all(symmetric[first:]):
      raise ValueError(
        f"saggs_jax.chain: the symmetry stage at position {first} must come after the optimizer"
        " it balances, and only symmetry stages may follow it. Write"
        " saggs_jax.chain(optax.adamw(...), saggs_jax.saggs(pairs))."
      )
  optimizers = tuple(optax.with_extra_args_support(t) for t in transforms[:first])
  stages = tuple(s for s in found if s is not None)
  inner = optax.chain(*optimizers)

  # The optimizer stages alone, built once: what a symmetry stage measures degrees on
  # (measure keeps them per layout), and what saggs_jax.checkpoint.restore transports a
  # saved chain state by. A symmetry stage between them and a later one holds no moments
  # (its state's rule keeps it) and only moves theirs along the orbit, which changes no
  # degree; probing it would need its extra arguments (a qk_clip's logits).
  optimizer = optax.GradientTransformationExtraArgs(
    lambda params: tuple(t.init(params) for t in optimizers),
    lambda updates, state, params=None, **extra: inner.update(updates, state, params, **extra),
  )

  def degrees(n, params, plan, state):  # those of the states before stage n (first + n)
    found = measure(optimizer, params, plan, state)  # kept per layout by measure, not here
    return None if found is None else (*found, *(None,) * n)

  def init(params):
    # The degrees are measured where they are used, at the first update's trace (or by
    # restore / canonicalize): init costs what the optimizer's own init costs.
    if jax.tree.leaves(params):  # not optax.tree.map_params' leafless placeholder
      for stage in stages:
        _check_params(params, stage.name)
    return (*cast(tuple, optimizer.init(params)), *(s.init(params) for s in stages))

  def run(n, grads, states, params, extra_args):  # the optimizer and the first n stages
    if n == 0:
      return inner.update(grads, states, params, **extra_args)
    stage, state, prior_states = stages[n - 1], states[-1], tuple(states[:-1])
    _check_params(params, stage.name)
    plan = stage.resolve(params)  # once per stage and trace
    moments = degrees(n - 1, params, plan, states[: len(optimizers)])  # their shapes, no init
    moved, shared = params, None
    if stage.before is not None:  # move along the orbit, then step from there
      factors, state = stage.before(state, params, plan, **extra_args)
      shared = Shared(factors)  # the same multipliers for parameters, gradients and moments
      moved = scale_tree(plan, params, shared, 1.0)
      grads = scale_tree(plan, grads, shared, -1.0)
      prior_states = transport(plan, prior_states, shared, degrees=moments)
    updates, prior_states = run(n - 1, grads, prior_states, moved, extra_args)
    if shared is not None:
      updates = land_on(params, updates, optax.apply_updates(moved, updates), plan, shared)
    if stage.after is not None:  # correct the stepped parameters, move the gauge's moments
      correction, state = stage.after(state, params, updates, plan, **extra_args)
      updates = corrected(params, updates, correction)
      if correction.gauge is not None:
        prior_states = transport(plan, prior_states, correction.gauge, degrees=moments)
    return updates, (*prior_states, state)

  def update(updates, state, params=None, **extra_args):
    if len(state) != len(transforms):
      raise ValueError(f"State has {len(state)} stages but the chain has {len(transforms)}.")
    if not stages:
      return inner.update(updates, state, params, **extra_args)
    return run(len(stages), updates, tuple(state), params, extra_args)

  return Chain(init, ChainUpdate(optimizer, stages, update))


def wrap(inner: optax.GradientTransformation, stage: SymmetryTransformation) -> Chain:
  """``inner`` wrapped by a symmetry stage, as optax's wrappers hold theirs.

  The same updates as ``chain(inner, stage)``; the state is a
  :class:`SymmetryState` ``(inner_state, stage_state)``, as ``optax.apply_if_finite(inner,
  ...)`` holds its inner state. ``stage`` is built on its own, as in a chain:
  ``wrap(optax.adamw(...), saggs(pairs))``. A wrapper is one transformation: it goes
  inside ``optax.chain``, ``optax.named_chain``, ``optax.MultiSteps``,
  ``optax.apply_if_finite`` and ``flax.nnx.Optimizer`` like any optimizer. To wrap
  several stages, chain them: ``chain(inner, stage_1, stage_2)``.

  Example:
    >>> import jax.numpy as jnp, optax, saggs_jax as saggs
    >>> params = {"q": jnp.full((2, 2), 4.0), "k": jnp.ones((2, 2))}
    >>> tx = saggs.wrap(optax.sgd(0.0), saggs.saggs([saggs.Pair("q", "k")]))
    >>> updates, state = tx.update(params, tx.init(params), params)
    >>> type(state).__name__, float(state.stage_state.factors["q|k"])  # c = sqrt(2 / 8)
    ('SymmetryState', 0.5)
  """
  if _stage_of(stage) is None:
    raise TypeError(f"saggs_jax.wrap takes a symmetry stage after the optimizer, got {stage!r}.")
  if _stage_of(inner) is not None or (
    isinstance(inner.update, ChainUpdate) and inner.update.stages
  ):
    raise ValueError(
      "saggs_jax.wrap: the optimizer wrapped already holds a symmetry stage; chain several"
      " stages instead: saggs_jax.chain(inner, stage_1, stage_2)."
    )
  chained = chain(inner, stage)

  def init(params):
    return SymmetryState(*cast(tuple, chained.init(params)))

  def update(updates, state, params=None, **extra_args):
    updates, states = chained.update(updates, tuple(cast(tuple, state)), params, **extra_args)
    inner_state, stage_state = cast(tuple, states)
    return updates, SymmetryState(inner_state, stage_state)

  made = cast(ChainUpdate, chained.update)
  return Chain(init, ChainUpdate(made.optimizer, made.stages, update, wrapped=True))
