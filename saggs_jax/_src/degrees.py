"""The transport degree of every optimizer state leaf, measured at its place in the chain.

A state type registers the degrees its fields usually have, but optax reuses types
(``optax.adamax`` keeps an infinity norm, degree 1, in Adam's ``nu``, registered 2), so
:func:`measure` reads each leaf's degree off the optimizer itself. The oracle is the
equivalent history: fed the parameters ``T_c p`` and the gradients ``g / c`` on side A,
``g c`` on side B, the optimizer must hold the transported state ``s * m**-k``. A leaf's
degree is the one it has with every gate open (clips that do not clip, negligible ``eps``;
:func:`saggs_jax._src.gates.opened`); a leaf that no degree fits is refused, naming its
state type and path.

The probe runs on a :func:`~saggs_jax._src.proxy.proxy` of the parameters (the same tree,
dtypes and pairs, every axis cut to a few entries per run of constant multiplier), one state
leaf per class of leaves the optimizer computes alike (:mod:`saggs_jax._src.leaf_classes`);
its program is :mod:`saggs_jax._src.probe`'s, and this module decides each degree from its
results and keeps them per optimizer and proxy layout. docs/moments.md gives the contract and how each
case is decided (zero leaves, schedules, hyperparameters injected as tracers, state layouts
that depend on the leaves' sizes).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from saggs_jax._src import paths
from saggs_jax._src.plan import Plan
from saggs_jax._src.probe import (
  GRADIENT_SCALE,
  STEPS,
  Cut,
  leaf_places,
  multipliers,
  runner,
  trace,
  traced,
)
from saggs_jax._src.proxy import PROXIES, proxy, proxy_params
from saggs_jax._src.transport import AS_REGISTERED, transport

CANDIDATES = (1, 2, 0, -1, -2, 3, 4)
"""Degrees tried, in order, for a leaf whose registered degree does not fit."""

# optimizer update function -> {proxy layout: degrees}; weak, so an optimizer's entry goes
# with it. A value depends only on its key: a hit skips work and changes no result.
_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _abstract(params: Any) -> Any:
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) if paths.is_array(x) else x,
    params,
  )


def _owner(state, key_path):
  """The innermost NamedTuple or dataclass state on the way to a leaf."""
  node = owner = state
  for key in key_path:
    if hasattr(node, "_fields") or dataclasses.is_dataclass(type(node)):
      owner = node
    if isinstance(key, jax.tree_util.GetAttrKey):
      node = getattr(node, key.name)
    elif isinstance(key, jax.tree_util.SequenceKey):
      node = node[key.idx]
    elif isinstance(key, jax.tree_util.DictKey):
      node = node[key.key]
    else:
      break
  return owner


def _where(state, key_path) -> str:
  return f"{type(_owner(state, key_path)).__name__} at opt_state{jax.tree_util.keystr(key_path)}"


def _state_of_update(tx, grads, state, params):
  """The state leaves ``tx.update`` returns on the probe's inputs: gradients laid out like the
  parameters and the extra argument ``value=1`` (the loss polyak_sgd reads: invariant)."""
  return jax.tree.leaves(tx.update(grads, state, params, value=jnp.ones([], jnp.float32))[1])


def _fitting_proxy(tx, params, plan: Plan, state, known: dict) -> tuple:
  """``(small, spec, init, layout, update)``: the proxy the degrees are measured on (the
  smallest of :func:`~saggs_jax._src.proxy.proxy`'s on which the optimizer runs), its parameters, ``tx.init`` traced
  on them, the layout the results are kept by, and ``tx.update``'s jaxpr there (None where
  ``known`` has that layout). An optimizer that fails on every proxy is refused naming the
  parameters' own shapes (:func:`_fails`), never a proxy's."""
  failure = None
  for whole, most in PROXIES:
    small = proxy(plan, whole, most)
    spec = proxy_params(params, small)
    try:
      init = traced(tx.init, spec)
      layout = (
        jax.tree.structure(spec),
        tuple((jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(spec)),
        tuple(small.slots.items()),
        tuple((i.key, i.factor_shape) for i in small.instances),
      )
      update = None
      if layout not in known:
        run = functools.partial(_state_of_update, tx)
        update = traced(run, spec, init.out_info, spec).jaxpr
    except Exception as e:  # a rule that splits an axis into pieces of a fixed size, say
      failure = e
      continue
    return small, spec, init, layout, update
  raise _fails(tx, params, state) from failure


def _fails(tx, params, state) -> TypeError:
  """The refusal of an optimizer that fails on every proxy: its own error on the full-size
  parameters (abstractly), or where it runs there, that it needs sizes no proxy has."""
  full = _abstract(params)
  try:
    jax.eval_shape(functools.partial(_state_of_update, tx), full, state, full)
  except Exception as e:  # e.g. an update that needs more than the gradients and a value
    return TypeError(
      f"Cannot transport {type(state).__name__} at opt_state: its degrees are measured on a"
      " probe history (gradients like the parameters, value=1), on which the optimizer"
      f" fails: {type(e).__name__}: {e}"
    )
  return TypeError(
    f"Cannot measure the transport degrees of {type(state).__name__}: the optimizer runs on"
    " the parameters' shapes but not on a small proxy of them (docs/moments.md). Declare the"
    " pairs of every leaf it splits, or leave that rule out."
  )


def _one_of_each_kind(plan: Plan, params: Any, state: Any) -> Any:
  """``state`` with None for every leaf whose place, shape and dtype and whose parameter's
  layout (see :func:`leaf_places`) an earlier leaf shares: the registered rules treat such
  leaves alike, so they refuse the first of them or none."""
  layouts, places = leaf_places(plan, params, state)
  leaves, treedef = jax.tree.flatten(state)
  seen, kept = set(), []
  for j, (x, place) in enumerate(zip(leaves, places)):
    key = j if place is None else (place[0], layouts[place[1]], jnp.shape(x), jnp.result_type(x))
    kept.append(None if key in seen else x)
    seen.add(key)
  return treedef.unflatten(kept)


def _fits(state, moved, mult, registered) -> tuple[np.ndarray, bool]:
  """Whether ``moved`` (a leaf after the equivalent history) is ``state`` transported by
  its registered degree (times ``registered``) and by each of :data:`CANDIDATES` (times the
  multiplier ``mult`` of degree 1 to that power), up to the leaf's rounding; and whether it
  fits them all though the multiplier is not 1 (zero where its parameter moves: no
  evidence)."""
  rtol = max(1e-4, 8 * float(np.finfo(state.dtype).eps))
  s, t, m, r = (np.asarray(x, np.float64) for x in (state, moved, mult, registered))
  k = np.asarray(CANDIDATES, np.float64).reshape((-1,) + (1,) * s.ndim)
  wanted = np.concatenate([(s * r)[None], s * m**k])
  ok = np.abs(wanted - t) <= rtol * (np.abs(t) + 1e-2 * np.max(np.abs(t), initial=0))
  fits = ok.reshape(len(wanted), -1).all(axis=1)
  return fits, bool(fits.all() and np.any(np.abs(m - 1) > 1e-3))


def _same_layout(small_state, state) -> tuple | None:
  """The key path of a leaf of ``small_state`` (the proxy's) laid out otherwise than its leaf
  in ``state`` (full size): another rank, or size 1 along an axis the other does not have
  size 1; ``()`` if the trees differ. None if every leaf corresponds."""
  if jax.tree.structure(small_state) != jax.tree.structure(state):
    return ()
  for (key_path, small), full in zip(
    jax.tree_util.tree_flatten_with_path(small_state)[0], jax.tree.leaves(state)
  ):
    if [n == 1 for n in np.shape(small)] != [n == 1 for n in np.shape(full)]:
      return key_path
  return None


# The code of optax.lookahead's init and update: a frame running one of them on the stack of
# a symmetry stage's update means the stage is (part of) lookahead's fast optimizer.
_LOOKAHEAD_CODE = frozenset(
  c for c in optax.lookahead.__code__.co_consts if isinstance(c, types.CodeType)
)


def _refuse_inside_lookahead() -> None:
  """Raises a ValueError if called, at any depth, from ``optax.lookahead``'s update or init.

  A symmetry stage inside lookahead (``optax.lookahead(saggs.chain(adam, saggs(pairs)),
  ...)``) balances the fast weights alone: the slow weights, which each synchronisation mixes
  with the fast ones (``slow + α (fast - slow)``), are outside its reach and stay where they
  were on the orbit, so two equivalent states sync onto two functions that are not
  equivalent, and never meet again. Keeping them equivalent would need the slow weights moved
  by the fast weights' factors, which only a rule outside lookahead could do. Called by
  :func:`measure`, which every symmetry stage's update calls for the states it transports.
  Runs at trace time only (a walk up the Python stack)."""
  frame = sys._getframe(1)
  while frame is not None:
    if frame.f_code in _LOOKAHEAD_CODE:
      raise ValueError(
        "A saggs_jax symmetry stage runs inside optax.lookahead's fast optimizer, out of reach"
        " of the slow weights each synchronisation mixes in (docs/moments.md). Train without"
        " lookahead."
      )
    frame = frame.f_back


def measure(tx: optax.GradientTransformation, params: Any, plan: Plan, state: Any = None) -> Any:
  """The degree of every leaf of ``tx.init(params)``, as :func:`transport` takes them.

  Measured on the :func:`~saggs_jax._src.proxy.proxy` of ``plan`` (see the module doc), once per optimizer and
  proxy layout; the full-size parameters are only read for their shapes and dtypes.

  Args:
    tx: the optimizer whose state is transported (the stages before a symmetry
      stage).
    params: the parameters, or anything with their shapes and dtypes (abstract
      ``jax.ShapeDtypeStruct`` leaves, tracers).
    plan: the resolved pairs.
    state: ``tx.init(params)`` where the caller has made it (its shapes and dtypes are read),
      else None: it is traced abstractly.

  Returns:
    A tree laid out like the state whose leaves are :data:`AS_REGISTERED` or
    a measured degree; None when no parameter is declared.

  Raises:
    TypeError: a leaf that no degree fits, one the probe never moves, a state
      the registered rules refuse, or one whose layout depends on the leaves'
      sizes so that the proxy's differs; the message names the state type and the path.

  Example:
    >>> import jax, jax.numpy as jnp, optax, saggs_jax as saggs
    >>> from saggs_jax._src.degrees import measure
    >>> from saggs_jax._src.plan import resolve
    >>> params = {"q": jax.ShapeDtypeStruct((4096, 512), jnp.float32),
    ...           "k": jax.ShapeDtypeStruct((1024, 512), jnp.float32)}
    >>> state_degrees = measure(optax.adamax(1e-3), params, resolve(saggs.Pair("q", "k"), params))
    >>> state_degrees[0].nu["q"], state_degrees[0].mu["q"]  # nu: an infinity norm
    (1, 'as registered')
  """
  if not plan.slots:
    return None
  _refuse_inside_lookahead()  # before the cache: the same chain may also run outside it
  cache_key, tx = tx.update, optax.with_extra_args_support(tx)
  try:
    known = _MEASURED.setdefault(cache_key, {})
  except TypeError:  # not weakly referable (a bound method, a callable object): no cache
    known = {}
  # Each update of a chain asks again: the full-size checks below trace every leaf.
  full = (
    jax.tree.structure(params),
    tuple((jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(params)),
    plan.instances,
    tuple(plan.slots.items()),
  )
  if full in known:
    return known[full]
  state = jax.eval_shape(tx.init, _abstract(params)) if state is None else _abstract(state)
  # The registered rules first, at full size and abstractly: an unregistered image refuses.
  factors = {i.key: jax.ShapeDtypeStruct(i.factor_shape, jnp.float32) for i in plan.instances}
  jax.eval_shape(
    lambda s, f: transport(plan, s, f), _one_of_each_kind(plan, params, state), factors
  )
  small, spec, traced_init, layout, update = _fitting_proxy(tx, params, plan, state, known)
  small_state = traced_init.out_info
  mismatch = _same_layout(small_state, state)
  if mismatch is not None:
    raise TypeError(
      f"Cannot measure the transport degrees of {_where(state, mismatch)}: its layout"
      " depends on the parameters' sizes, so the small proxy has another. Keep it"
      " size-independent: optax.adafactor(..., factored=False)."
    )
  if layout not in known:
    program = trace(spec, small_state, small, traced_init.jaxpr, update)
    found = _decide(program, spec, small_state, small)
    if any(program.outer):
      # Stand-ins small next to the gradients (an eps) read the degrees; whether a value
      # added to a moment or to the gradients is negligible depends on its real size, which
      # a tracer does not tell: the same degrees must hold next to gradients of its size.
      try:
        plain = _decide(program, spec, small_state, small, outer_scale=1.0)
      except TypeError:
        plain = None
      if plain != found:
        raise TypeError(
          f"{type(state).__name__} closes over values traced outside it, and whether it"
          " transports depends on their size. Pass them as numbers"
          " (inject_hyperparams(..., static_args=...)), or inject them inside the chain."
        )
    known[layout] = found
  known[full] = jax.tree.structure(state).unflatten(known[layout])
  return known[full]


def _decide(program: Cut, spec, state, small, outer_scale=GRADIENT_SCALE) -> list:
  """The degree of each leaf of the proxy's state ``state`` (abstract), in flatten order (see
  :func:`measure`); values the optimizer closes over from a trace outside take stand-ins,
  the gradients scaled by ``outer_scale``."""
  spec_leaves, spec_def = jax.tree.flatten(spec)
  leaves, state_def = jax.tree_util.tree_flatten_with_path(state)
  # Only the leaves the probe runs: one of each class, and what their updates read.
  only = lambda tree, keep, xs: tree.unflatten([x if i in keep else None for i, x in enumerate(xs)])  # noqa: E731
  param_mult, mults, registered = multipliers(
    small,
    only(spec_def, set(program.params), spec_leaves),
    only(state_def, set(program.kept), [x for _, x in leaves]),
  )
  probe = runner(
    program,
    [spec_leaves[i] for i in program.params],
    param_mult,
    [leaves[j][1] for j in program.kept],
    outer_scale,
  )
  floats = [n for n in program.kept if paths.is_parameter(leaves[n][1])]
  decided: dict[int, Any] = {}
  for steps, late in [*((steps, False) for steps in STEPS), (STEPS[-1], True)]:
    values = list(zip(*probe(steps, late=late), mults, registered))
    for i, n in enumerate(floats):
      fits, undecided = _fits(*values[i])
      if n in decided or undecided:
        continue
      if fits[0]:
        decided[n] = AS_REGISTERED
      elif fits[1:].any():
        decided[n] = CANDIDATES[int(np.argmax(fits[1:]))]
      else:
        raise TypeError(
          f"Cannot transport {_where(state, leaves[n][0])}: after an equivalent history this"
          " leaf is not the transported one for any degree (docs/moments.md). Drop that stage,"
          " or declare the pairs with axes=None."
        )
    if len(decided) == len(floats):
      break
  else:
    _decide_seeded(probe, state, leaves, floats, mults, registered, decided)
  return [
    decided[program.representative[n]] if paths.is_parameter(x) else AS_REGISTERED
    for n, (_, x) in enumerate(leaves)
  ]


def _decide_seeded(probe, state, leaves, floats, mults, registered, decided) -> None:
  """Decides the leaves of ``floats`` still zero after the longest history (see
  :func:`_seeded`), into ``decided``."""
  pending = [i for i, n in enumerate(floats) if n not in decided]
  unchecked = []
  seeded = _seeded(probe, pending, [mults[i] for i in pending], [registered[i] for i in pending])
  for i, (agree, keeps_registered) in seeded.items():
    where = _where(state, leaves[floats[i]][0])
    if len(agree) == 1:
      decided[floats[i]] = agree[0]
    elif agree is CANDIDATES or keeps_registered:
      # Back at zero (nothing to transport), or its updates are homogeneous in it whatever its
      # degree: the probe cannot tell, the state type's meaning does. Said, not silent.
      decided[floats[i]] = AS_REGISTERED
      unchecked += [] if agree is CANDIDATES else [where]
    else:
      raise TypeError(
        f"Cannot transport {where}: this leaf stays zero through the probe's updates where"
        " its parameter moves, and started elsewhere no one degree fits. Leave its parameter"
        " out of the pairs."
      )
  if unchecked:
    warnings.warn(
      f"saggs_jax: {', '.join(unchecked)} stay zero through {STEPS[-1]} probe updates from"
      " init and as many past every schedule's horizon, and started elsewhere their updates"
      " keep them homogeneous in any degree (as AdaDelta's e_x at eps=0), so they move by"
      " the degrees their state types register, which the probe cannot check.",
      UserWarning,
      stacklevel=5,
    )


def _seeded(probe, pending: list[int], mults: list, registered: list) -> dict[int, tuple]:
  """For each float leaf in ``pending`` (multipliers ``mults``) that stays zero from ``init``,
  started at positive values on side A and at those transported by each candidate on side B:
  the candidates after which the two histories still agree (:data:`CANDIDATES` itself for a
  leaf back at zero: it holds nothing to transport), and whether its registered degree is
  among them."""
  rng = np.random.default_rng(1)
  start = [rng.uniform(0.5, 1.0, m.shape).astype(m.dtype) for m in mults]
  agree = {i: [] for i in pending}
  keeps, zero = set(), set(pending)
  for k in CANDIDATES:
    seeds = {
      i: np.stack([x, x * np.asarray(m, np.float64) ** k]).astype(x.dtype)
      for i, x, m in zip(pending, start, mults)
    }
    state, moved = probe(STEPS[0], seeds)
    for i, m, r in zip(pending, mults, registered):
      fits, undecided = _fits(state[i], moved[i], m, r)
      if not undecided:
        zero.discard(i)
        if fits[1 + CANDIDATES.index(k)]:
          agree[i].append(k)
          if fits[0]:
            keeps.add(i)
  return {i: (CANDIDATES if i in zero else ks, i in keeps) for i, ks in agree.items()}
