"""The degree probe's program (:mod:`saggs_jax._src.degrees` reads the degrees off it): the
optimizer's ``init`` and ``update`` traced on the proxy (:mod:`saggs_jax._src.proxy`) and cut
down to one state leaf of each class (:func:`trace`), what the probe factors multiply each
leaf by (:func:`multipliers`), and the history and its equivalent run through them
(:func:`runner`), compiled on a thread of their own with XLA's cheapest code generation.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import types
from typing import Any, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from saggs_jax._src import gates, leaf_classes, paths
from saggs_jax._src.plan import Plan
from saggs_jax._src.proxy import probe_factors
from saggs_jax._src.scaling import scale_tree
from saggs_jax._src.transport import transport

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


def multipliers(plan: Plan, spec: Any, state: Any) -> tuple[list, list, list]:
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


class Cut(NamedTuple):
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


def traced(fn, *args):
  """``jax.jit(fn).trace(*args)`` on its own thread (:func:`_alone`): values the optimizer
  closes over from a trace outside become the leading inputs of its jaxpr."""
  return _alone(lambda: jax.jit(fn).trace(*args))


def trace(spec, state, small: Plan, init, update) -> Cut:
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
  layouts, places = leaf_places(small, spec, state)
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
  return Cut(
    init, init_inputs, update, update_inputs, outer, (n, m), sorted(used), kept, representative
  )


def leaf_places(plan: Plan, params: Any, state: Any) -> tuple[list, list]:
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


def runner(program: Cut, spec: list, param_mult: list, kept: list, outer_scale=GRADIENT_SCALE):
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
