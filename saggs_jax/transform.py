"""SAGGS as optax transformations, and a chain that transports earlier moments.

A symmetry stage sits after the inner optimizer. It receives that optimizer's
updates ``u`` and the current parameters ``p``, balances the parameters the
step would produce, ``p' = p + u``, and returns the updates that land on the
balanced parameters: ``u' = T_c(p') - p``. :func:`chain` additionally rewrites
the moments held by the stages before it with the same factors, so the state
after the step is exactly the transported one.

With ``deferred=True`` the balancing due after update ``n`` is applied at the
start of update ``n + 1`` instead: to ``p``, to the gradient and to the inner
moments, before the inner optimizer runs, so it fuses into that optimizer's
own arithmetic.
"""

from __future__ import annotations

import warnings
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from saggs_jax import paths
from saggs_jax.balance import Factors, compute_dtype, compute_factors, leaf_multiplier, scale_tree
from saggs_jax.pairs import Pair, resolve
from saggs_jax.transport import transport


class SaggsState(NamedTuple):
  """State of a SAGGS stage.

  Attributes:
    count: number of updates seen so far.
    factors: the factors applied by the latest update, keyed by pair instance
      (``"a_path|b_path"``), each of shape ``stacked_shape + (groups,)``; all
      ones after an update that ``every`` skipped. Log them to watch SAGGS work.
  """

  count: jax.Array
  factors: Factors


class SymmetryTransformation(optax.GradientTransformationExtraArgs):
  """An optax transformation that also acts on the stages before it.

  ``around(prior, grads, state, prior_states, params)`` runs ``prior``, the
  stages before this one as ``prior(grads, prior_states, params) -> (updates,
  prior_states)``, itself (so it can transform their inputs, their outputs or
  both) and returns ``(updates, state, prior_states)``.
  :func:`chain` calls it; a plain ``optax.chain`` calls ``update``, which can
  balance the parameters only.
  """

  def __new__(cls, init, update, around: Callable[..., tuple]):
    self = super().__new__(cls, init, update)
    self.around = around
    return self


def _ones_like_output(fn, *args):
  """Ones of the type ``fn(*args)`` returns (shape, dtype and, under an Explicit mesh,
  sharding), found by tracing only: both branches of a ``lax.cond`` must agree."""
  return jax.tree.map(jnp.ones_like, jax.eval_shape(fn, *args))


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
    return jnp.where(leaf_multiplier(slots, p.shape, factors, 1.0, dtype) == 1, u, moved)

  return jax.tree_util.tree_map_with_path(visit, updates, params, target)


def scale_by_saggs(pairs: Sequence[Pair], strength: float = 1.0, every: int = 1,
                   deferred: bool = False) -> SymmetryTransformation:
  """Balances the Frobenius norms inside every declared symmetry pair.

  For each pair instance and group g, with ``A_g``, ``B_g`` the group slices
  of the parameters after the inner optimizer's step,

    c_g = (||B_g|| / ||A_g||) ** (strength / 2),   A_g <- c_g A_g,   B_g <- B_g / c_g.

  ``strength=1`` equalises the two norms (the canonical representative of the
  symmetry orbit); a smaller strength shrinks ``log(||A_g||/||B_g||)`` by the
  factor ``1 - strength``. The function computed by the model is unchanged.
  Applied on updates number ``every``, ``2 * every``, ...; on the others a
  ``lax.cond`` passes the inner updates and moments through untouched.

  ``deferred=True`` applies the balancing due after update ``n`` at the start
  of update ``n + 1`` (so on updates ``every + 1``, ``2 * every + 1``, ...):
  with ``B`` the balancing and ``A`` the inner step, it returns ``A(B(s))``
  where the default returns ``B(A(s))``. Each state it returns is therefore
  the default's state before its latest balancing: the same function, with
  consistently transported moments, and the very same state after updates
  that do not balance; the sequence of functions trained is the same. The
  factors come from the current parameters, and ``p``, the gradient
  (``g / c`` on the A side) and the inner moments are rescaled on the way into
  the inner optimizer, so on CPU the balancing costs about one extra read of
  the declared parameters instead of a second pass over the inner update.
  Needs :func:`saggs_jax.chain`.

  Args:
    pairs: the :class:`~saggs_jax.Pair` declarations.
    strength: in (0, 1]; 1 is hard SAGGS.
    every: balance every this many updates.
    deferred: balance at the start of the next update instead of the end of
      this one.

  Returns:
    A :class:`SymmetryTransformation`. Chain it after the inner optimizer with
    :func:`saggs_jax.chain` so that the inner moments are transported too.

  Example::

    >>> import jax.numpy as jnp, optax, saggs_jax as saggs
    >>> params = {"q": jnp.full((2, 2), 4.0), "k": jnp.ones((2, 2))}  # norms 8 and 2
    >>> tx = saggs.chain(optax.adam(0.0), saggs.scale_by_saggs([saggs.Pair("q", "k")]))
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state, params)
    >>> new = optax.apply_updates(params, updates)
    >>> float(jnp.linalg.norm(new["q"])), float(jnp.linalg.norm(new["k"]))
    (4.0, 4.0)
  """
  pairs = (pairs,) if isinstance(pairs, Pair) else tuple(pairs)
  if not 0 < strength <= 1:
    raise ValueError(f"strength must be in (0, 1], got {strength!r}.")
  if not isinstance(every, int) or every < 1:
    raise ValueError(f"every must be a positive int, got {every!r}.")
  warned = []

  def factors_of(params):
    return compute_factors(resolve(pairs, params), params, strength)

  def init(params):
    return SaggsState(jnp.zeros([], jnp.int32), _ones_like_output(factors_of, params))

  def around(prior, grads, state, prior_states, params):
    if params is None:
      raise ValueError("SAGGS needs the current parameters: call update(updates, state, params).")
    plan = resolve(pairs, params)
    count = optax.safe_increment(state.count)

    if deferred:
      # Only the small factors leave the cond: on updates that do not balance
      # the rescaling below multiplies by ones inside the inner optimizer's kernels.
      factors = jax.lax.cond((count > 1) & ((count - 1) % every == 0), factors_of,
                             lambda p: _ones_like_output(factors_of, p), params)
      balanced = scale_tree(plan, params, factors, 1.0)
      updates, prior_states = prior(scale_tree(plan, grads, factors, -1.0),
                                    transport(plan, prior_states, factors), balanced)
      updates = _land_on(params, updates, optax.apply_updates(balanced, updates), plan, factors)
      return updates, SaggsState(count, factors), prior_states

    def rebalance(operand):
      updates, prior_states = operand
      stepped = optax.apply_updates(params, updates)
      factors = factors_of(stepped)
      target = scale_tree(plan, stepped, factors, 1.0)
      return (_land_on(params, updates, target, plan, factors),
              transport(plan, prior_states, factors), factors)

    def skip(operand):  # no arithmetic at all: the inner updates pass through
      return (*operand, _ones_like_output(factors_of, params))

    operand = prior(grads, prior_states, params)
    if every == 1:
      updates, prior_states, factors = rebalance(operand)
    else:
      updates, prior_states, factors = jax.lax.cond(count % every == 0, rebalance, skip, operand)
    return updates, SaggsState(count, factors), prior_states

  def update(updates, state, params=None, **extra_args):
    del extra_args
    if deferred:
      raise ValueError("A deferred SAGGS stage rescales the inputs of the optimizer before it,"
                       " which only saggs_jax.chain(...) can do; use it instead of optax.chain.")
    if not warned:
      warned.append(True)
      warnings.warn(
          "A SAGGS stage outside saggs_jax.chain balances the parameters but cannot transport"
          " the moments of the optimizer before it; use saggs_jax.chain(...) instead of"
          " optax.chain(...).", stacklevel=2)
    updates, state, _ = around(lambda g, s, p: (g, s), updates, state, (), params)
    return updates, state

  return SymmetryTransformation(init, update, around)


def saggs(pairs: Sequence[Pair], every: int = 1, deferred: bool = False
          ) -> SymmetryTransformation:
  """Hard SAGGS: equalise the norms inside each pair every ``every`` updates.

  Alias of :func:`scale_by_saggs` with ``strength=1``.

  Example::

    >>> import optax, saggs_jax as saggs
    >>> pairs = [saggs.Pair("attn/q_proj/kernel", "attn/k_proj/kernel", axes=(1, 1), groups=4)]
    >>> tx = saggs.chain(optax.adamw(3e-4), saggs.saggs(pairs, every=100))
  """
  return scale_by_saggs(pairs, strength=1.0, every=every, deferred=deferred)


def soft(pairs: Sequence[Pair], strength: float = 0.5, every: int = 1, deferred: bool = False
         ) -> SymmetryTransformation:
  """Soft SAGGS: move ``strength`` of the way (in log-norm) towards balance.

  Alias of :func:`scale_by_saggs`. Each application multiplies the
  log-imbalance ``log(||A_g||/||B_g||)`` by ``1 - strength``.

  Example::

    >>> import optax, saggs_jax as saggs
    >>> pairs = [saggs.Pair("mlp/up_proj/kernel", "mlp/down_proj/kernel", axes=(1, 0))]
    >>> tx = saggs.chain(optax.adamw(3e-4, weight_decay=0.1), saggs.soft(pairs, strength=0.5))
  """
  return scale_by_saggs(pairs, strength=strength, every=every, deferred=deferred)


def chain(*transforms: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """``optax.chain`` whose symmetry stages also transport earlier stages' moments.

  The state is a tuple of stage states, as with ``optax.chain``. When a
  :class:`SymmetryTransformation` rescales the parameters by factors ``c``, the
  states of every stage before it are transported (``mu -> mu / c``,
  ``nu -> nu / c**2`` on the A side, the inverse on the B side; see
  :func:`saggs_jax.register_transport`).

  Example::

    >>> import optax, saggs_jax as saggs
    >>> pairs = [saggs.Pair("attn/v_proj/kernel", "attn/o_proj/kernel", axes=(1, 0), groups=4)]
    >>> tx = saggs.chain(optax.adamw(3e-4), saggs.soft(pairs, strength=0.5))
  """
  stages = [t if isinstance(t, SymmetryTransformation) else optax.with_extra_args_support(t)
            for t in transforms]

  def init(params):
    return tuple(t.init(params) for t in stages)

  def run(stages, grads, states, params, extra_args):
    symmetric = [i for i, t in enumerate(stages) if isinstance(t, SymmetryTransformation)]
    updates, new_states, first = grads, [], 0
    if symmetric:  # the last symmetry stage runs everything before it
      last = symmetric[-1]
      prior = lambda g, s, p: run(stages[:last], g, s, p, extra_args)  # noqa: E731
      updates, state, prior_states = stages[last].around(prior, grads, states[last],
                                                         tuple(states[:last]), params)
      new_states, first = [*prior_states, state], last + 1
    for t, s in zip(stages[first:], states[first:]):
      updates, s = t.update(updates, s, params, **extra_args)
      new_states.append(s)
    return updates, tuple(new_states)

  def update(updates, state, params=None, **extra_args):
    if len(state) != len(stages):
      raise ValueError(f"State has {len(state)} stages but the chain has {len(stages)}.")
    return run(stages, updates, state, params, extra_args)

  return optax.GradientTransformationExtraArgs(init, update)
