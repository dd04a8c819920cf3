"""Explicit symmetry transforms of a whole training state, and its canonical form."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import core

from saggs_jax._src import paths
from saggs_jax._src.balance import TOLERANCE, compute_factors
from saggs_jax._src.chain import ChainUpdate
from saggs_jax._src.degrees import measure
from saggs_jax._src.numerics import Factors
from saggs_jax._src.pairs import Pair
from saggs_jax._src.plan import Plan, resolve
from saggs_jax._src.scaling import scale_tree
from saggs_jax._src.transport import transport

FactorSpec = float | Callable[[str, tuple[int, ...]], Any]
_TX_FIX = "Pass the transformation that made it: for a saggs_jax.chain's state, the chain itself."


def apply_transform(
  plan: Plan,
  params: Any,
  opt_state: Any,
  factors: Factors,
  tx: optax.GradientTransformation | None = None,
) -> tuple[Any, Any]:
  """Rescales ``params`` by ``factors`` and transports every moment in ``opt_state``,
  by the degrees measured on ``tx`` if given, else by the registered ones. Both come back
  as new trees: no nnx ``Variable`` of the result is one of the input's, so the two states
  can live in two ``nnx.Optimizer``s side by side. Concrete values are checked to stay within
  their dtypes (:func:`_check_range`)."""
  if tx is None or opt_state is None:
    moved = transport(plan, opt_state, factors)
  else:
    made = jax.eval_shape(tx.init, params)
    paths.check_made_by(opt_state, made, "opt_state", "tx", _TX_FIX)
    # Laid out as tx.init lays it out, whatever boxes hold the leaves (nnx.Optimizer's
    # OptVariable for its Param): the degrees are measured on that layout.
    as_made = jax.tree.structure(made).unflatten(jax.tree.leaves(opt_state))
    moved = transport(plan, as_made, factors, degrees=_degrees(tx, params, made, plan))
  moved = jax.tree.structure(opt_state).unflatten(jax.tree.leaves(moved))  # fresh boxes
  out = scale_tree(plan, params, factors, 1.0), moved
  _check_range((params, opt_state), out)
  return out


def _check_range(before: Any, after: Any) -> None:
  """Raises a ValueError naming the first leaf of ``after`` (``(params, opt_state)``) where a
  finite nonzero entry of ``before`` became infinite or zero: factors whose power (a moment's
  degree: ``nu`` moves by ``c**-2``) its dtype cannot hold. Traced leaves are not checked:
  that would wait on the device."""
  for (key_path, x), y in zip(
    jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(after)
  ):
    if not (paths.is_parameter(x) and _is_concrete(x) and _is_concrete(y)):
      continue
    x, y = np.asarray(x), np.asarray(y)
    lost = np.isfinite(x) & (x != 0) & ~(np.isfinite(y) & (y != 0))
    if lost.any():
      where = ("params", "opt_state")[key_path[0].idx] + jax.tree_util.keystr(key_path[1:])
      raise ValueError(
        f"The factors move {int(lost.sum())} finite nonzero entries of {where} ({x.dtype})"
        " to inf or 0, past what its dtype holds. Use factors closer to 1, or a wider dtype."
      )


def _degrees(tx: optax.GradientTransformation, params: Any, made: Any, plan: Plan) -> Any:
  """The degrees of ``tx``'s state ``made``: on a :func:`saggs_jax.chain` (or a wrapper)
  measured on the optimizer before its symmetry stages, whose own states keep theirs."""
  update = tx.update
  if isinstance(update, ChainUpdate) and update.stages:
    return update.degrees(params, plan, made)
  return measure(tx, params, plan, made)


def _is_concrete(x) -> bool:
  # Not np.asarray's TracerArrayConversionError: building its message walks the trace's
  # provenance, 3 ms a leaf (a sixth of tracing the restore's canonicalisation).
  return not isinstance(x, core.Tracer)


def _factors(plan: Plan, factor: FactorSpec) -> Factors:
  out = {}
  for inst in plan.instances:
    given = factor(inst.a, inst.factor_shape) if callable(factor) else factor
    where = f"The factors of {inst.pair.label} on {inst.key!r}"
    try:
      f = jnp.broadcast_to(jnp.asarray(given, jnp.float32), inst.factor_shape)
    except (TypeError, ValueError):
      f = None
    if f is None or isinstance(given, (str, bytes)):  # NumPy would parse "2"
      raise ValueError(
        f"{where} must be numbers broadcastable to shape {inst.factor_shape}"
        f" (stacked_shape + (groups,)), got {given!r}."
      )
    ok = jnp.isfinite(f) & (f > 0)
    if _is_concrete(ok):
      if not np.all(ok):
        bad = np.unique(np.asarray(f)[~np.asarray(ok)])
        raise ValueError(
          f"{where} must be positive and finite in float32, got {', '.join(map(str, bad[:4]))}."
        )
    else:  # traced: checking would sync with the host; a bad factor leaves its group alone
      f = jnp.where(ok, f, 1.0)
    out[inst.key] = f
  return out


def reparameterize(
  params: Any,
  opt_state: Any,
  pairs: Sequence[Pair],
  factor: FactorSpec,
  tx: optax.GradientTransformation | None = None,
) -> tuple[Any, Any]:
  """Applies an exact symmetry transform to the parameters and the optimizer state.

  Every A group is multiplied by ``c`` and its B group divided by ``c``;
  moments of gradient degree k are transported by ``c**-k`` (A) and ``c**k``
  (B). The model computes the same function afterwards.

  Args:
    params: the parameter tree.
    opt_state: any optax state built for ``params`` (chain, partition, masked,
      inject_hyperparams, MultiSteps, ``nnx.Optimizer``'s); ``None`` for params alone.
    pairs: the :class:`~saggs_jax.Pair` declarations.
    factor: a positive float for every group, or ``fn(path_a, shape) -> array``
      of one pair instance's factors (``shape`` is ``stacked_shape + (groups,)``).
    tx: the optimizer that made ``opt_state``, whose degrees are then measured
      at each leaf; default ``None``: the degrees registered for the state types.

  Returns:
    ``(params, opt_state)`` transformed.

  Raises:
    ValueError: a factor that is not positive and finite, or one that moves a
      finite nonzero value of the params or state to inf or 0 (where concrete).
    TypeError: given ``tx``, a leaf whose degree no transport moves.

  Example:
    >>> import jax.numpy as jnp, optax, saggs_jax as saggs
    >>> params = {"q": jnp.ones((4, 2)), "k": jnp.ones((4, 2))}
    >>> opt_state = optax.adam(1e-3).init(params)
    >>> params, opt_state = saggs.reparameterize(params, opt_state, [saggs.Pair("q", "k")], 2.0)
    >>> float(params["q"][0, 0]), float(params["k"][0, 0])
    (2.0, 0.5)
  """
  plan = resolve(pairs, params)
  return apply_transform(plan, params, opt_state, _factors(plan, factor), tx)


def canonicalize(
  params: Any, opt_state: Any, pairs: Sequence[Pair], tx: optax.GradientTransformation | None = None
) -> tuple[Any, Any]:
  """Maps a training state to the canonical (norm-balanced) member of its orbit.

  Each group gets ``c = sqrt(||B|| / ||A||)``, after which ``||A|| = ||B||``
  (norms over every tensor of a side); with overlapping pairs the factors
  jointly minimise the total squared norm, which balances every pair. The
  moments are transported alongside (by the degrees measured on ``tx``, if
  given: see :func:`reparameterize`). Should the joint solve stop at its iteration
  cap short of ``TOLERANCE`` (see :func:`saggs_jax._src.balance.solve`), it warns (from
  the host when traced, via ``jax.debug.callback``, which keeps the program out of JAX's
  persistent compilation cache; :func:`saggs_jax.checkpoint.restore` checks on the host
  instead). ``canonicalize`` is idempotent and
  ``canonicalize(reparameterize(s, f)) == canonicalize(s)`` for every f > 0
  up to floating point, so equivalent checkpoints become the same state.

  Example:
    >>> import jax.numpy as jnp, optax, saggs_jax as saggs
    >>> pairs = [saggs.Pair("q", "k")]
    >>> params = {"q": jnp.full((4, 2), 4.0), "k": jnp.ones((4, 2))}
    >>> params, _ = saggs.canonicalize(params, None, pairs)
    >>> float(params["q"][0, 0]), float(params["k"][0, 0])
    (2.0, 2.0)
  """
  params, opt_state, residual = canonical_form(params, opt_state, pairs, tx)
  if _is_concrete(residual):
    warn_unconverged(residual)
  else:
    jax.debug.callback(warn_unconverged, residual)
  return params, opt_state


def canonical_form(
  params: Any, opt_state: Any, pairs: Sequence[Pair], tx: optax.GradientTransformation | None
) -> tuple[Any, Any, jax.Array]:
  """:func:`canonicalize` without its warning: ``(params, opt_state, residual)``, the joint
  solve's residual for the caller to check (:func:`warn_unconverged`)."""
  plan = resolve(pairs, params)
  factors, residual = compute_factors(plan, params, 1.0)
  return *apply_transform(plan, params, opt_state, factors, tx), residual


def warn_unconverged(residual) -> None:
  if float(residual) > TOLERANCE:
    warnings.warn(
      f"canonicalize: the joint balancing of overlapping pairs stopped at its iteration cap,"
      f" a log-factor still moving by {float(residual):.3g} (tolerance {TOLERANCE:g}); the"
      " state is not exactly canonical.",
      RuntimeWarning,
      stacklevel=3,
    )
