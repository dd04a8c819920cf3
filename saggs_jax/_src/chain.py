"""The chain that runs symmetry stages around the optimizers before them.

:func:`chain` is ``optax.chain`` whose symmetry stages also transport the earlier stages'
moments: it resolves each stage's pairs once per update, runs the stage's hooks, scales the
parameters and gradients, transports the moments by their measured degrees and lands the
step. :func:`wrap` is the same chain with a wrapper's state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import optax

from saggs_jax._src import paths
from saggs_jax._src.degrees import measure
from saggs_jax._src.plan import Plan
from saggs_jax._src.scaling import Shared, land_on, scale_tree
from saggs_jax._src.stage import (
  Stage,
  SymmetryTransformation,
  check_params,
  corrected,
  stage_of,
)
from saggs_jax._src.transport import NESTED, register_transport, transport


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
  found = [stage_of(t) for t in transforms]
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
        check_params(params, stage.name)
    return (*cast(tuple, optimizer.init(params)), *(s.init(params) for s in stages))

  def run(n, grads, states, params, extra_args):  # the optimizer and the first n stages
    if n == 0:
      return inner.update(grads, states, params, **extra_args)
    stage, state, prior_states = stages[n - 1], states[-1], tuple(states[:-1])
    check_params(params, stage.name)
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
  if stage_of(stage) is None:
    raise TypeError(f"saggs_jax.wrap takes a symmetry stage after the optimizer, got {stage!r}.")
  if stage_of(inner) is not None or (isinstance(inner.update, ChainUpdate) and inner.update.stages):
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
