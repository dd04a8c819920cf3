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
leaf per class of leaves the optimizer computes alike (:mod:`saggs_jax._src.leaf_classes`),
and its results are kept per optimizer and proxy layout. docs/moments.md gives the contract and how each
case is decided (zero leaves, schedules, hyperparameters injected as tracers, state layouts
that depend on the leaves' sizes).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import sys
import types
import warnings
import weakref
from typing import Any, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax

from saggs_jax._src import gates, leaf_classes, paths
from saggs_jax._src.pairs import Plan
from saggs_jax._src.proxy import PROXIES, probe_factors, proxy, proxy_params
from saggs_jax._src.scaling import scale_tree
from saggs_jax._src.transport import AS_REGISTERED, transport

CANDIDATES = (1, 2, 0, -1, -2, 3, 4)
"""Degrees tried, in order, for a leaf whose registered degree does not fit."""

STEPS = (3, 7, 31, 127)
"""Lengths of the probe history, tried in turn while some leaf stays zero. Pairwise coprime
(Mersenne primes): a ``MultiSteps(every_k_schedule=k)`` steps within the longest for every
``k <= 127``, and its accumulator, zero right after each step, is nonzero after one of any
two of them. Then the longest once more from :data:`LATE`."""

LATE = 2**20
"""Where the integer state (step counts) starts in the last probe history, for a leaf still
zero after the others: every schedule and ``MultiSteps`` past its horizon, as the contract
has them (a learning rate that is zero for the first 200 updates is not zero there; a
``MultiSteps`` of any ``every_k_schedule`` steps at once and accumulates again)."""

HYPERPARAMETER = 0.375
"""The stand-in for a float value the optimizer closes over from a trace outside the probe (a
rate, ``b1``, ``b2``, a decay, ``eps``, a weight decay that ``optax.inject_hyperparams`` around
a whole chain makes tracers): in (0, 1) and away from both, as a decay rate must be for the
moments it keeps to mix two steps; ints take 1. A degree is a property of the optimizer's
structure, so any generic value reads it."""

GRADIENT_SCALE = 2.0**16
"""The size of the probe's gradients next to its parameters (entries in [0.5, 1)): an
additive constant of the optimizer (an ``eps`` up to :data:`HYPERPARAMETER`, an initial
accumulator, a weight decay times the parameters added to the gradients) stays below the
probe's rounding next to them, as the contract's open gates want, while decay rates keep
their weight. Clips are opened by :func:`saggs_jax._src.gates.opened`, whatever this size."""

FAST_COMPILE = types.MappingProxyType(
  {
    "xla_backend_optimization_level": 0,
    "xla_cpu_parallel_codegen_split_count": 1,
  }
)
"""XLA options of the probe's compile on CPU: its cheapest code generation (options every
supported jaxlib knows: an unknown one is an error)."""

FAST_COMPILE_IF_KNOWN = types.MappingProxyType({"xla_cpu_use_fusion_emitters": False})
"""Options added to :data:`FAST_COMPILE` where the CPU compiler knows them: jaxlib 0.10's
legacy emitters compile the probe about 4x faster than its fusion emitters (0.1 s against
0.5 s of CPU for a LLaMA's); later jaxlibs have no such option."""

# The options the probe compiles with on CPU, found at its first compile.
_OPTIONS: dict = {}

# optimizer update function -> {proxy layout: degrees}; weak, so an optimizer's entry goes
# with it. A value depends only on its key: a hit skips work and changes no result.
_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _abstract(params: Any) -> Any:
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) if paths.is_array(x) else x,
    params,
  )


def _random(spec: Any, rng: np.random.Generator, *lead: int) -> Any:
  """Host arrays like ``spec`` (with leading axes ``lead``) of entries of magnitude in
  [0.5, 1) and either sign (zeros for a non-float leaf): away from zero, so that an epsilon
  added to a moment stays negligible. Proxy-sized, and made on the host: nothing to compile."""

  def leaf(x):
    if not isinstance(x, jax.ShapeDtypeStruct):
      return x
    shape = lead + x.shape
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      return np.zeros(shape, x.dtype)
    return (rng.choice([-1.0, 1.0], shape) * rng.uniform(0.5, 1.0, shape)).astype(x.dtype)

  return jax.tree.map(leaf, spec)


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


def _multipliers(plan: Plan, spec: Any, state: Any) -> tuple[list, list, list]:
  """Per array leaf of ``spec`` (the parameters) what the probe factors multiply it by (None
  for a leaf that is no parameter); per float leaf of ``state`` what they multiply it by as a
  moment of degree 1 and of its registered degree. Transport multiplies entry by entry, so
  these say all it does to a state. One small program, compiled on its own (see
  :func:`_alone`): nothing of the model's size. Leaves set to None are skipped."""

  def evaluate():
    factors = probe_factors(plan)

    def ones(tree):
      return jax.tree.map(
        lambda x: jnp.ones(x.shape, x.dtype) if paths.is_parameter(x) else x, tree
      )

    floats = lambda t: [x for x in jax.tree.leaves(t) if paths.is_parameter(x)]  # noqa: E731
    params = scale_tree(plan, ones(spec), factors, 1.0)
    degree_1 = transport(plan, ones(state), factors, degrees=jax.tree.map(lambda _: 1, state))
    registered = transport(plan, ones(state), factors)
    params = [x if paths.is_parameter(x) else None for x in jax.tree.leaves(params)]
    return params, floats(degree_1), floats(registered)

  out = _alone(lambda: _compiled(jax.jit(evaluate).lower())())
  return jax.tree.map(np.asarray, out)


def _compiled(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
  """``lowered`` compiled, on CPU with XLA's cheapest code generation (see FAST_COMPILE)."""
  if jax.default_backend() != "cpu":
    return lowered.compile()
  if not _OPTIONS:
    try:
      compiled = lowered.compile({**FAST_COMPILE, **FAST_COMPILE_IF_KNOWN})
    except jax.errors.JaxRuntimeError as e:
      if "No such compile option" not in str(e):
        raise
      _OPTIONS.update(FAST_COMPILE)
    else:
      _OPTIONS.update({**FAST_COMPILE, **FAST_COMPILE_IF_KNOWN})
      return compiled
  return lowered.compile(dict(_OPTIONS))


def _alone(fn: Any) -> Any:
  """``fn()`` on a thread of its own, where no context of the caller's reaches it: not its
  trace (so that it runs now, even while an init or an update is traced: a value it closes
  over from that trace would become one more input), nor its ``jax.set_mesh`` (which would
  run each small op, and compile the probe, for every device of the mesh). The caller's
  ``jax.enable_x64`` does reach it: it is thread-local too, and the probe must see the
  dtypes the caller's arrays have."""
  x64 = bool(jax.config.jax_enable_x64)

  def run():
    with jax.enable_x64(x64):
      return fn()

  with concurrent.futures.ThreadPoolExecutor(1) as thread:
    return thread.submit(run).result()


class _Cut(NamedTuple):
  """The optimizer's ``init`` and ``update`` on the proxy as jaxprs cut down to the state
  leaves the probe runs (``kept``: one of each class of :mod:`saggs_jax._src.leaf_classes`, and
  what their updates read), with the parameter leaves they read (``params``)."""

  init: Any  # ClosedJaxpr: the used inputs of [outer values..., params...] -> kept leaves
  init_inputs: list[int]
  update: Any  # ClosedJaxpr: the used inputs of [outer..., grads..., state..., params...]
  update_inputs: list[int]
  outer: tuple[int, int]  # the values each closes over from a trace outside (leading inputs)
  sizes: tuple[int, int]  # parameter leaves, state leaves
  params: list[int]
  kept: list[int]
  representative: list[int]  # of every state leaf, a kept one


def _traced(fn, *args):
  """``jax.jit(fn).trace(*args)`` on its own thread (:func:`_alone`): values the optimizer
  closes over from a trace outside become the leading inputs of its jaxpr."""
  return _alone(lambda: jax.jit(fn).trace(*args))


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
      init = _traced(tx.init, spec)
      layout = (
        jax.tree.structure(spec),
        tuple((jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(spec)),
        tuple(small.slots.items()),
        tuple((i.key, i.factor_shape) for i in small.instances),
      )
      update = None
      if layout not in known:
        run = functools.partial(_state_of_update, tx)
        update = _traced(run, spec, init.out_info, spec).jaxpr
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


def _trace(spec, state, small: Plan, init, update) -> _Cut:
  """Reads the classes of the state leaves from ``init`` (the traced ``tx.init(spec)``,
  ``state`` its abstract output) and ``update`` (the jaxpr of ``tx.update``) on the proxy
  ``small``, and cuts both down."""
  n, m = len(jax.tree.leaves(spec)), len(jax.tree.leaves(state))
  if len(update.jaxpr.outvars) != m:
    raise TypeError(
      f"Cannot transport {type(state).__name__} at opt_state: its update returns a state of"
      f" {len(update.jaxpr.outvars)} leaves where init makes {m}."
    )
  outer = (len(init.jaxpr.invars) - n, len(update.jaxpr.invars) - 2 * n - m)
  layouts, places = _places(small, spec, state)
  start, step = leaf_classes.Program(init), leaf_classes.Program(update)
  representative = leaf_classes.classes(start, step, outer, layouts, places)
  floats = [j for j, x in enumerate(jax.tree.leaves(state)) if paths.is_parameter(x)]
  kept = leaf_classes.closure(step, outer[1], n, sorted({representative[j] for j in floats}))
  init, init_inputs = leaf_classes.reduced(init, kept)
  update, update_inputs = leaf_classes.reduced(update, kept)
  used = {k - outer[0] for k in init_inputs if k >= outer[0]}
  for k in (k - outer[1] for k in update_inputs):
    if 0 <= k < n or k >= n + m:  # a gradient or a parameter leaf
      used.add(k if k < n else k - n - m)
  return _Cut(
    init, init_inputs, update, update_inputs, outer, (n, m), sorted(used), kept, representative
  )


def _places(plan: Plan, params: Any, state: Any) -> tuple[list, list]:
  """The layout of each parameter leaf (shape, dtype and slots, each slot's pair instance by
  its factors' shape, which is all the probe factors depend on, and by which of the leaf's
  slots share it); and for each state leaf ``(where, i)``: the path of parameter leaf ``i``
  is the longest tail of its path that is a parameter's (where its moments sit), ``where``
  the rest; None for a leaf at no parameter's path."""
  shapes = {i.key: i.factor_shape for i in plan.instances}

  def layout(path, x):
    if not paths.is_array(x):
      return ("static", repr(x))
    slots = plan.slots.get(path, ())
    keys = list(dict.fromkeys(s.key for s in slots))
    cut = tuple(dataclasses.replace(s, key=f"{keys.index(s.key)}:{shapes[s.key]}") for s in slots)
    return tuple(jnp.shape(x)), str(jnp.result_type(x)), cut

  leaves = [(paths.path_str(k), x) for k, x in jax.tree_util.tree_flatten_with_path(params)[0]]
  where = {path: i for i, (path, _) in enumerate(leaves)}
  places = []
  for key_path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
    names = paths.path_str(key_path).split("/")
    tail = next((t for t in range(len(names)) if "/".join(names[t:]) in where), None)
    places.append(None if tail is None else (tuple(names[:tail]), where["/".join(names[tail:])]))
  return [layout(path, x) for path, x in leaves], places


def _one_of_each_kind(plan: Plan, params: Any, state: Any) -> Any:
  """``state`` with None for every leaf whose place, shape and dtype and whose parameter's
  layout (see :func:`_places`) an earlier leaf shares: the registered rules treat such
  leaves alike, so they refuse the first of them or none."""
  layouts, places = _places(plan, params, state)
  leaves, treedef = jax.tree.flatten(state)
  seen, kept = set(), []
  for j, (x, place) in enumerate(zip(leaves, places)):
    key = j if place is None else (place[0], layouts[place[1]], jnp.shape(x), jnp.result_type(x))
    kept.append(None if key in seen else x)
    seen.add(key)
  return treedef.unflatten(kept)


def _probe(program: _Cut, spec: list, param_mult: list, kept: list, outer_scale=GRADIENT_SCALE):
  """``probe(steps, seeds={})``: runs the history of ``steps`` updates from probe parameters
  with probe gradients (``outer_scale`` times the parameters' size) and every gate of the
  update open (:func:`saggs_jax._src.gates.opened`), and the equivalent history (parameters times
  ``param_mult``, gradients divided by it), and gives each float state leaf of ``kept`` (the abstract leaves
  ``program.kept``) after both; values the optimizer closes over from a trace outside take
  stand-ins. ``spec`` and ``param_mult`` are the parameter leaves ``program.params``.
  ``seeds`` maps float leaves (by their index among them) to the values they start from on
  either side, in place of ``init``'s. Compiled once per set of seeded leaves."""
  (o_init, o_update), (n, m) = program.outer, program.sizes
  leaf = {i: a for a, i in enumerate(program.params)}
  state = {j: a for a, j in enumerate(program.kept)}
  floats = [a for a, x in enumerate(kept) if paths.is_parameter(x)]

  def inputs(closed, used, outer, pick):  # each input of a cut jaxpr: a stand-in or a leaf
    return [
      ("value", _stand_in(v.aval)) if k < outer else pick(k - outer)
      for v, k in zip(closed.jaxpr.invars, used)
    ]

  init_in = inputs(program.init, program.init_inputs, o_init, lambda k: ("p", leaf[k]))
  update_in = inputs(
    program.update,
    program.update_inputs,
    o_update,
    lambda k: (
      ("g", leaf[k]) if k < n else ("s", state[k - n]) if k < n + m else ("p", leaf[k - n - m])
    ),
  )
  run_init = jax.extend.core.jaxpr_as_fun(program.init)
  run_update = gates.opened(program.update, [kind in ("g", "s") for kind, _ in update_in])

  def call(run, wanted, **trees):
    return run(*(x if kind == "value" else trees[kind][x] for kind, x in wanted))

  def update(s, p, g):
    return call(run_update, update_in, s=s, p=p, g=g)

  def probe(steps, late, sides, grads, seeds):  # every array is made in here: none outside
    def step(t, states):
      g = [jax.lax.dynamic_index_in_dim(x, t, keepdims=False) for x in grads]
      new = jax.vmap(update, axis_size=2)(states, sides, g)
      # The loop's carry keeps its dtypes: jax 0.12's adam turns the moments of an int or
      # bool parameter float (no degree is read off those).
      return [x if paths.is_parameter(k) else x.astype(k.dtype) for x, k in zip(new, kept)]

    start = list(jax.vmap(lambda p: call(run_init, init_in, p=p), axis_size=2)(sides))
    start = [  # counters moved on by `late`: every schedule and MultiSteps past its horizon
      x + late.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.integer) else x for x in start
    ]
    for a, seed in seeds.items():
      start[floats[a]] = seed
    states = jax.lax.fori_loop(0, steps, step, start)
    return [[states[a][i] for a in floats] for i in (0, 1)]

  rng = np.random.default_rng(0)
  p, history = _random(spec, rng), _random(spec, rng, STEPS[-1])

  def both(x, spec, m, power):  # side A, side B: the new axis just before the parameter's axes
    if not isinstance(x, np.ndarray):
      return x
    b = (x * m**power).astype(x.dtype) if paths.is_parameter(x) else x
    return np.stack([x, b], axis=x.ndim - len(spec.shape))

  sides = [both(x, a, mult, 1) for x, a, mult in zip(p, spec, param_mult)]
  grads = [both(x, a, mult, -1) for x, a, mult in zip(history, spec, param_mult)]
  grads = [(g * outer_scale).astype(g.dtype) if paths.is_parameter(g) else g for g in grads]
  compiled = {}

  def compile(seeds):
    """Traced and compiled on its own (:func:`_alone`), for one device, with XLA's cheapest
    code generation: the program is tiny and runs a few times."""
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    args = scalar, scalar, sides, grads, seeds
    return _alone(lambda: _compiled(jax.jit(probe).trace(*args).lower()))

  def run(steps, seeds=None, late=False):
    seeds = seeds or {}
    key = tuple(sorted(seeds))
    if key not in compiled:
      compiled[key] = compile(seeds)
    return compiled[key](np.int32(steps), np.int32(LATE if late else 0), sides, grads, seeds)

  return run


def _stand_in(aval) -> np.ndarray:
  """The value a hyperparameter traced outside the probe takes in it (see HYPERPARAMETER)."""
  dtype = np.dtype(aval.dtype)
  if not (jnp.issubdtype(dtype, jnp.number) or dtype == np.bool_):
    raise TypeError(
      f"Cannot measure transport degrees: the optimizer closes over a {aval} traced outside"
      " it, which the probe has no stand-in for. Build the chain outside the trace, or pass"
      " that value as a number."
    )
  value = HYPERPARAMETER if jnp.issubdtype(dtype, jnp.inexact) else 1
  return np.full(aval.shape, value, dtype)


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
    >>> from saggs_jax._src.pairs import resolve
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
    program = _trace(spec, small_state, small, traced_init.jaxpr, update)
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


def _decide(program: _Cut, spec, state, small, outer_scale=GRADIENT_SCALE) -> list:
  """The degree of each leaf of the proxy's state ``state`` (abstract), in flatten order (see
  :func:`measure`); values the optimizer closes over from a trace outside take stand-ins,
  the gradients scaled by ``outer_scale``."""
  spec_leaves, spec_def = jax.tree.flatten(spec)
  leaves, state_def = jax.tree_util.tree_flatten_with_path(state)
  # Only the leaves the probe runs: one of each class, and what their updates read.
  only = lambda tree, keep, xs: tree.unflatten([x if i in keep else None for i, x in enumerate(xs)])  # noqa: E731
  param_mult, mults, registered = _multipliers(
    small,
    only(spec_def, set(program.params), spec_leaves),
    only(state_def, set(program.kept), [x for _, x in leaves]),
  )
  probe = _probe(
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
