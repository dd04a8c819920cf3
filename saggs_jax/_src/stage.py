"""The symmetry stage protocol: two hooks that :func:`saggs_jax.chain` runs around the
optimizers before a stage (docs/architecture.md).

A stage's ``update`` is a :class:`Stage`, an ordinary frozen dataclass, so ``_replace``, ``copy``
and optax's wrappers keep it. ``before`` gives factors that move the parameters, gradients
and earlier moments along the orbit before the step (SAGGS); ``after`` gives a
:class:`Correction` of the stepped parameters and a gauge whose moments move (QK-clip).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import optax

from saggs_jax._src.numerics import Factors
from saggs_jax._src.pairs import Pair, as_pairs
from saggs_jax._src.plan import Plan, resolve
from saggs_jax._src.scaling import land_on, scale_tree


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
    check_params(params, self.name)
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


def stage_of(tx) -> Stage | None:
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


def check_params(params, name: str) -> None:
  if params is None:
    raise ValueError(f"{name} needs the current parameters: call update(updates, state, params).")
  if isinstance(params, optax.LookaheadParams):
    raise ValueError(
      f"{name} cannot balance optax.lookahead's LookaheadParams, and balancing the fast"
      " weights alone is no way out (docs/moments.md). Train without lookahead."
    )
