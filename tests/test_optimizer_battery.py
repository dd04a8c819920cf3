"""The properties an optax optimizer is expected to have, on this library's.

Every equivariant rule, the stack and the SAGGS chains of :data:`OPTIMIZERS`:
convergence on the targets of :data:`TARGETS` (after a ``map_params`` pass),
extra update arguments ignored with no retracing, ``inject_hyperparams``, the
dtypes of updates and states (stable over steps, float16 to float64),
``optax.MultiSteps`` against one step on the mean of its micro-gradients, and
learning-rate schedules. Each check is written here against its own oracle
(the known minimiser, the plain optimizer, a NumPy mean); nothing is imported
from optax's test files. What cannot run, and why, is :data:`EXCLUDED`, whose
reasons :func:`test_exclusions_are_documented_limits` checks.
"""

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import saggs_jax as saggs
from saggs_jax import equivariant as eqv

# ------------------------------------------------------------------ targets
# Each returns (start, minimiser, loss); the minimiser is the convergence oracle.


def setup_parabola(dtype):
  """sum_i w_i (p_i - t_i)^2 on a vector, curvatures w unequal."""
  initial = jnp.array([0.5, -4.0, 2.0, 0.0], dtype)
  final = jnp.array([-1.5, 1.0, 2.0, 3.0], dtype)
  weights = jnp.array([1.0, 4.0, 0.5, 2.0], dtype)
  return initial, final, lambda p: jnp.sum(weights * (p - final) ** 2)


def setup_rosenbrock(dtype):
  """(a - x)^2 + b (y - x^2)^2: the minimiser (a, a^2) lies at the end of a
  narrow curved valley."""
  a, b = 1.5, 100.0
  initial = jnp.array([-1.0, 0.5], dtype)
  final = jnp.array([a, a * a], dtype)
  return initial, final, lambda p: (a - p[0]) ** 2 + b * (p[1] - p[0] ** 2) ** 2


def setup_matrix_parabola(dtype):
  """||P - T||_F^2 on a wide matrix (2 units of 3 features)."""
  initial = jnp.array([[0.5, 0.0, -0.5], [0.0, 1.0, 0.0]], dtype)
  final = jnp.array([[-2.0, 1.0, 3.0], [2.5, -1.0, 0.5]], dtype)
  return initial, final, lambda p: jnp.sum((p - final) ** 2)


def setup_mixed(dtype):
  """A vector and a square matrix, one sum of squares: leaf "1" is the matrix."""
  initial = (jnp.array([1.0, -1.0], dtype), 0.5 * jnp.eye(3, dtype=dtype))
  final = (
    jnp.array([-2.0, 0.5], dtype),
    jnp.array([[1.0, -2.0, 0.0], [0.0, 1.0, 1.0], [2.0, 0.0, -1.0]], dtype),
  )
  return initial, final, lambda p: sum(jnp.sum((x - t) ** 2) for x, t in zip(p, final))


def setup_centred_matrix_parabola(dtype):
  """A matrix parabola whose target's mean unit vector (row) is zero, as at the
  start: the only kind a centred rule can reach."""
  initial = jnp.zeros((3, 2), dtype)
  final = jnp.array([[3.0, -2.0], [1.0, 4.0], [-4.0, -2.0]], dtype)
  return initial, final, lambda p: jnp.sum((p - final) ** 2)


def setup_qk(dtype):
  """||q k^T - T||^2, invariant under q -> c q, k -> k / c. With T = 4 u v^T
  (unit u, v) its balanced minimiser on the start's side is q = 2u, k = 2v."""
  u, v = jnp.array([[0.6], [0.8]], dtype), jnp.array([[0.8], [0.0], [-0.6]], dtype)
  target = 4 * u @ v.T
  initial = {"q": jnp.array([[1.0], [0.5]], dtype), "k": jnp.array([[0.5], [0.5], [-0.5]], dtype)}
  final = {"q": 2 * u, "k": 2 * v}
  return initial, final, lambda p: jnp.sum((p["q"] @ p["k"].T - target) ** 2)


TARGETS = {
  "parabola": setup_parabola,
  "rosenbrock": setup_rosenbrock,
  "matrix_parabola": setup_matrix_parabola,
  "mixed": setup_mixed,
  "centred_matrix_parabola": setup_centred_matrix_parabola,
  "qk": setup_qk,
}


def inject_layout():
  """Params and gradients of the inject cases: leaf "0" a (2, 3) matrix, leaf
  "1" a batch of two (5, 2) matrices (random, fixed seed)."""
  rng = np.random.default_rng(45)
  draw = lambda: [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((2, 3), (2, 5, 2))]
  return draw(), draw()


# --------------------------------------------------------------- optimizers


class Case(NamedTuple):
  """One optimizer under test.

  Attributes:
    factory: ``factory(learning_rate) -> GradientTransformation``.
    learning_rate: the rate the battery runs it at.
    targets: convergence targets (keys of :data:`TARGETS`).
    probe: the target (a key of :data:`TARGETS`) on which the step checks run
      (extra arguments, dtypes, MultiSteps, schedules); None: none (a layout
      checked by convergence or inject_hyperparams only).
  """

  factory: Callable[..., optax.GradientTransformation]
  learning_rate: float
  targets: tuple[str, ...]
  probe: str | None


def routed(make_rule, routes):
  """``make_rule(**kwargs)`` under :func:`eqv.optimizer` for each path pattern
  of ``routes`` (pattern -> kwargs), routed by :func:`eqv.layerwise`; Adam
  takes the leaves no pattern matches (the vectors)."""

  def factory(learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    rules = {
      pattern: eqv.optimizer(make_rule(**kwargs), learning_rate)
      for pattern, kwargs in routes.items()
    }
    return eqv.layerwise(rules, default=optax.adam(learning_rate))

  return factory


# The leaves: "**" is the bare matrix of the matrix targets; "1" the matrix of
# the mixed target; "0" (2, 3) and "1" (2, 5, 2) those of :func:`inject_layout`.
UNIT_ROUTES = {
  "bare": {"**": dict(unit_axis=0)},
  "mixed": {"1": dict(unit_axis=0)},
  "inject": {
    "0": dict(unit_axis=0),
    "1": dict(unit_axis=eqv.UnitDimensionNumbers(1, batch_axis=0)),
  },
}
POLAR_ROUTES = {
  "bare": {"**": {}},
  "mixed": {"1": {}},
  "inject": {"0": {}, "1": dict(batch_axes=0)},
}
RULES = {  # name -> (rule, routes, centred)
  "polar": (eqv.scale_by_polar, POLAR_ROUTES, False),
  "row_norm": (eqv.scale_by_row_norm, UNIT_ROUTES, False),
  "right_spectral": (eqv.scale_by_right_spectral, UNIT_ROUTES, False),
  "hybrid": (eqv.scale_by_hybrid, UNIT_ROUTES, False),
  "hybrid_polar_then_row": (
    functools.partial(eqv.scale_by_hybrid, order="polar_then_row"),
    UNIT_ROUTES,
    False,
  ),
  "row_norm_centered": (functools.partial(eqv.scale_by_row_norm, center=True), UNIT_ROUTES, True),
  "left_spectral": (eqv.scale_by_left_spectral, UNIT_ROUTES, True),
}
RULE_LR = 1e-3  # normalised updates: the iterate ends within about lr of the target


def rule_cases():
  cases = {}
  for name, (rule, routes, centred) in RULES.items():
    matrix = "centred_matrix_parabola" if centred else "matrix_parabola"
    cases[f"{name}@bare"] = Case(routed(rule, routes["bare"]), RULE_LR, (matrix,), matrix)
    cases[f"{name}@mixed"] = Case(
      routed(rule, routes["mixed"]), RULE_LR, () if centred else ("mixed",), None
    )
    cases[f"{name}@inject"] = Case(routed(rule, routes["inject"]), RULE_LR, (), None)
  return cases


def stack(**patterns):
  """:func:`eqv.symmetry_compatible` with roles routed to the targets' leaves."""

  def factory(learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    return eqv.symmetry_compatible(learning_rate, patterns=patterns)

  return factory


QK = [saggs.Pair("q", "k", axes=(1, 1))]
INJECT_PAIR = [saggs.Pair("0", "1", axes=(0, 0))]  # both inject leaves have 2 rows


def saggs_adam(pairs):
  def factory(learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    return saggs.chain(optax.adam(learning_rate), saggs.saggs(pairs))

  return factory


def soft_adamw(pairs):
  def factory(learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    return saggs.chain(optax.adamw(learning_rate), saggs.soft(pairs, strength=0.5))

  return factory


OPTIMIZERS: dict[str, Case] = {
  **rule_cases(),
  # Vectors only: the stack hands every non-matrix leaf to AdamW.
  "stack@vector": Case(stack(), 1e-2, ("parabola", "rosenbrock"), "parabola"),
  "stack@bare": Case(stack(query="**"), RULE_LR, ("matrix_parabola",), "matrix_parabola"),
  "stack@mixed": Case(stack(embedding="1"), RULE_LR, ("mixed",), None),
  "stack@inject": Case(stack(query="0", experts="1"), RULE_LR, (), None),
  "saggs_adam@qk": Case(saggs_adam(QK), 1e-3, ("qk",), "qk"),
  "soft_adamw@qk": Case(soft_adamw(QK), 1e-3, ("qk",), "qk"),
  "saggs_adam@inject": Case(saggs_adam(INJECT_PAIR), 1e-3, (), None),
}

# ---------------------------------------------------------------- exclusions

MATRIX_ONLY = (
  "The equivariant rules act on matrices: a rank-1 parameter is a ValueError naming"
  " its path; routed to the default it would test optax.adam, not the rule."
)
CENTRED = (
  "A centred update has zero mean over the units, so the mean unit vector never moves:"
  " a target whose mean differs from the start's is out of reach by design."
)
NO_PAIR = (
  "SAGGS balances declared pairs of leaves; a lone vector has none, so init raises"
  " 'matches no parameter path'."
)
VECTOR_TARGETS = ("parabola", "rosenbrock")

# (family, target) -> reason: the combinations that cannot run.
EXCLUDED = {
  **{(rule, target): MATRIX_ONLY for rule in RULES for target in VECTOR_TARGETS},
  **{
    (rule, target): CENTRED
    for rule, (*_, centred) in RULES.items()
    if centred
    for target in ("matrix_parabola", "mixed")
  },
  **{(fam, target): NO_PAIR for fam in ("saggs_adam", "soft_adamw") for target in VECTOR_TARGETS},
}


def family(name):
  return name.split("@")[0]


def test_exclusions_are_documented_limits():
  """Each exclusion fails the way its reason says; none hides a case that runs."""
  vector, matrix = jnp.zeros(3), jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 7.0]])
  for (fam, target), reason in EXCLUDED.items():
    assert target in TARGETS, target
    if reason is MATRIX_ONLY:
      rule = RULES[fam][0]
      with pytest.raises(ValueError, match="expected rank 2"):
        rule(**({} if rule is eqv.scale_by_polar else dict(unit_axis=0))).init(vector)
    elif reason is CENTRED:
      tx = RULES[fam][0](unit_axis=0, beta=0.0)
      np.testing.assert_allclose(tx.update(matrix, tx.init(matrix))[0].mean(axis=0), 0.0, atol=1e-6)
    else:
      assert reason is NO_PAIR, reason
      with pytest.raises(ValueError, match="pattern 'q' matches no parameter path"):
        OPTIMIZERS[f"{fam}@qk"].factory(1e-3).init(vector)
  for name, case in OPTIMIZERS.items():
    runs = case.targets + ((case.probe,) if case.probe else ())
    assert not [target for target in runs if (family(name), target) in EXCLUDED], name


# ------------------------------------------------------------------ helpers


def assert_trees_close(actual, expected, **tolerance):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64), **tolerance)


def avals(tree):
  """Structure, shapes, dtypes and weak types: what a jit cache keys on."""
  return jax.tree.structure(tree), [jax.typeof(x) for x in jax.tree.leaves(tree)]


def make_step(tx, loss):
  """One jitted step on ``loss``: (params, state) -> (params, state, updates)."""

  @jax.jit
  def step(params, state):
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    return optax.apply_updates(params, updates), state, updates

  return step


@contextlib.contextmanager
def x64(enabled):
  """x64 on (or off) for the whole process while it lasts. Not ``jax.enable_x64``:
  that context is the calling thread's, and SAGGS measures transport degrees on a
  thread of its own (``degrees._alone``), which would then see float32 only."""
  before = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", enabled)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", before)


WITH_PROBE = [n for n, c in OPTIMIZERS.items() if c.probe is not None]


def probed(name, dtype=jnp.float32, learning_rate=None):
  """The case's optimizer (at its rate, or ``learning_rate``) and probe target."""
  case = OPTIMIZERS[name]
  rate = case.learning_rate if learning_rate is None else learning_rate
  return case.factory(rate), *TARGETS[case.probe](dtype)


# -------------------------------------------------------------- convergence

STEPS = 30_000
TOLERANCE = 1e-2  # absolute, each entry: 10 steps of a normalised rule at RULE_LR (worst: 3e-3)


def convergence_cases():
  for name, case in OPTIMIZERS.items():
    for target in case.targets:
      yield pytest.param(name, target, id=f"{name}-{target}")


@pytest.mark.parametrize("name, target", list(convergence_cases()))
def test_converges_to_the_minimiser(name, target):
  """STEPS steps from the start end within TOLERANCE of the known minimiser; the
  state first goes through ``optax.tree.map_params`` (identity), as a sharding
  pass would, and comes back unchanged."""
  case = OPTIMIZERS[name]
  initial, final, loss = TARGETS[target](jnp.float32)
  tx = case.factory(case.learning_rate)
  state = tx.init(initial)
  mapped = optax.tree.map_params(tx, lambda v: v, state)
  assert_trees_close(mapped, state, rtol=0, atol=0)

  def step(carry, _):
    params, state = carry
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    return (optax.apply_updates(params, updates), state), None

  run = jax.jit(lambda carry: jax.lax.scan(step, carry, length=STEPS)[0])
  params, _ = run((initial, mapped))
  assert_trees_close(params, final, rtol=0, atol=TOLERANCE)


# --------------------------------------------------------------- step checks


@pytest.mark.parametrize("name", WITH_PROBE)
def test_extra_update_args_are_ignored_without_retracing(name):
  """``update`` takes keyword arguments it does not use (as optax's
  GradientTransformationExtraArgs chains pass them on) and returns what it
  returns without them; a jitted step that passes them traces once over three
  steps, from the fresh state and from updated ones (no dtype, weak type or
  structure of the state changes under it)."""
  tx, params, _, loss = probed(name)
  traces = []

  @jax.jit
  def step(params, state):
    traces.append(None)
    value, grads = jax.value_and_grad(loss)(params)
    plain = tx.update(grads, state, params)
    updates, state = tx.update(grads, state, params, value=value, an_argument_nobody_reads=1)
    return optax.apply_updates(params, updates), state, (updates, state), plain

  state = tx.init(params)
  for _ in range(3):
    params, state, extra, plain = step(params, state)
    assert_trees_close(extra, plain, rtol=0, atol=0)
  assert len(traces) == 1, f"{name}: the step traced {len(traces)} times in 3 calls"


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n.endswith("@inject")])
def test_inject_hyperparams_makes_the_rate_live_state(name):
  """``inject_hyperparams(factory)(lr)`` updates and moves its inner state as
  ``factory(lr)`` does; its learning rate, set in the state to another value,
  gives ``factory(other)``'s update (so it is used, not frozen at build time).
  A SAGGS chain inside: its degrees measured, with no warning."""
  factory, lr = OPTIMIZERS[name].factory, OPTIMIZERS[name].learning_rate
  params, grads = inject_layout()
  injected = optax.inject_hyperparams(factory)(learning_rate=lr)
  update = jax.jit(injected.update)
  state = jax.jit(injected.init)(params)
  seen = []
  for rate in (lr, 3 * lr):
    state = state._replace(hyperparams={**state.hyperparams, "learning_rate": jnp.asarray(rate)})
    updates, new_state = update(grads, state, params)
    plain = factory(rate)
    plain_updates, plain_state = jax.jit(plain.update)(grads, plain.init(params), params)
    assert_trees_close(updates, plain_updates, rtol=1e-5, atol=1e-9)
    assert_trees_close(new_state.inner_state, plain_state, rtol=1e-5, atol=1e-7)
    seen.append(np.concatenate([np.ravel(u) for u in jax.tree.leaves(updates)]))
  assert np.min(np.abs(seen[1] - seen[0])) > 0, "the injected rate changes no update"


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64])
@pytest.mark.parametrize("name", WITH_PROBE)
def test_updates_and_states_keep_their_dtypes(name, dtype):
  """In each float dtype (float64 with x64 on), over three jitted steps: the
  updates have the params' shapes and dtypes, leaf by leaf, and the state keeps
  its init's structure, shapes, dtypes and weak types, as a ``lax.cond`` or
  ``scan`` around the update requires."""
  with x64(dtype == jnp.float64):
    tx, params, _, loss = probed(name, dtype)
    state = jax.jit(tx.init)(params)
    expected_params, expected_state = avals(params), avals(state)
    assert all(x.dtype == dtype for x in jax.tree.leaves(params))
    step = make_step(tx, loss)
    for i in range(3):
      params, state, updates = step(params, state)
      assert avals(updates) == expected_params, f"step {i}: updates {avals(updates)}"
      assert avals(params) == expected_params, f"step {i}: params {avals(params)}"
      assert avals(state) == expected_state, f"step {i}: state {avals(state)} != {expected_state}"


EVERY = 3  # micro-steps per MultiSteps update


def micro_gradients(params, rng):
  """EVERY gradients shaped like ``params`` whose running means m_1..m_EVERY are
  random nonzero multiples of 1/8 in [-2, 2] (g_n = n m_n - (n - 1) m_(n-1)):
  every sum and quotient of the accumulation is then exact in bfloat16 as in
  float32, so that MultiSteps and the oracle hand the rule the same mean, and a
  difference in the updates is the accumulation's, not a rounding the rule
  amplifies (a bfloat16 polar factor moves by ~20% within its Newton-Schulz band
  for an ulp of input; Adam turns a mean of 0 off by 1e-8 into half a step)."""

  def draw(p):
    return rng.choice([-1, 1], p.shape) * rng.integers(1, 17, p.shape) / 8

  means = [jax.tree.map(draw, params) for _ in range(EVERY)]
  previous = jax.tree.map(np.zeros_like, means[0])
  grads = []
  for n, mean in enumerate(means, 1):
    grads.append(jax.tree.map(lambda m, q, n=n: n * m - (n - 1) * q, mean, previous))
    previous = mean
  return grads


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("name", WITH_PROBE)
def test_multisteps_is_one_step_on_the_mean_gradient(name, dtype):
  """``optax.MultiSteps(tx, EVERY)`` given EVERY micro-gradients returns exact
  zeros (in the params' dtype) EVERY - 1 times, then what ``tx`` alone returns
  for their mean (taken here with NumPy), from the state the previous such step
  left: two cycles, the params moved between them."""
  tx, params, _, _ = probed(name, dtype)
  multi = optax.MultiSteps(tx, every_k_schedule=EVERY)
  multi_update, single_update = jax.jit(multi.update), jax.jit(tx.update)
  multi_state, single_state = multi.init(params), tx.init(params)
  rng = np.random.default_rng(7)
  for _ in range(2):
    micro = micro_gradients(params, rng)
    for i, grads in enumerate(micro):
      cast = jax.tree.map(lambda g: jnp.asarray(g, dtype), grads)
      updates, multi_state = multi_update(cast, multi_state, params)
      assert avals(updates) == avals(params), f"micro-step {i}: updates {avals(updates)}"
      if i < EVERY - 1:
        assert not any(np.any(np.asarray(u, np.float32)) for u in jax.tree.leaves(updates))
    mean = jax.tree.map(lambda *gs: jnp.asarray(np.mean(gs, axis=0), dtype), *micro)
    expected, single_state = single_update(mean, single_state, params)
    assert_trees_close(updates, expected, rtol=1e-5, atol=1e-5 * OPTIMIZERS[name].learning_rate)
    assert_trees_close(multi_state.inner_opt_state, single_state, rtol=1e-5, atol=1e-8)
    params = optax.apply_updates(params, updates)


SAGGS_FAMILIES = ("saggs_adam", "soft_adamw")


@pytest.mark.parametrize("name", WITH_PROBE)
def test_learning_rate_schedules_are_followed(name):
  """The factory takes a schedule (annotated ScalarOrSchedule): a constant one
  gives the fixed rate's trajectory; one that drops to 0 after 5 steps gives its
  first 5 steps and then holds the params (SAGGS still balances its pair along
  the symmetry orbit, so there the function they compute, the loss, is held)."""
  case = OPTIMIZERS[name]
  annotation = inspect.signature(case.factory).parameters["learning_rate"].annotation
  assert annotation is optax.ScalarOrSchedule, annotation
  lr = case.learning_rate

  def trajectory(learning_rate, steps=10):
    tx, params, _, loss = probed(name, learning_rate=learning_rate)
    step, state, visited = make_step(tx, loss), tx.init(params), []
    for _ in range(steps):
      params, state, _ = step(params, state)
      visited.append(params)
    return visited, loss

  fixed, loss = trajectory(lr)
  assert_trees_close(trajectory(optax.constant_schedule(lr))[0], fixed, rtol=1e-6, atol=1e-9)
  held, _ = trajectory(optax.piecewise_constant_schedule(lr, {5: 0.0}))
  assert_trees_close(held[:5], fixed[:5], rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose([loss(p) for p in held[5:]], loss(fixed[4]), rtol=1e-6)
  if family(name) not in SAGGS_FAMILIES:
    assert_trees_close(held[5:], 5 * fixed[4:5], rtol=0, atol=0)


@pytest.mark.parametrize(
  "name, target",
  [
    ("polar@mixed", "mixed"),
    ("stack@mixed", "mixed"),
    ("saggs_adam@qk", "qk"),
  ],
)
def test_map_params_maps_the_moments_only(name, target):
  """What map_params is for (sharding specs of the state): f reaches every
  moment (the mu / nu fields, copies of the params) and nothing else."""
  params, *_ = TARGETS[target](jnp.float32)
  tx = OPTIMIZERS[name].factory(1e-3)
  _, state = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
  mapped = optax.tree.map_params(tx, lambda v: v + 1, state)
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  assert any(getattr(k, "name", None) == "mu" for path, _ in flat for k in path)
  for (path, old), new in zip(flat, jax.tree.leaves(mapped), strict=True):
    moment = any(getattr(k, "name", None) in ("mu", "nu") for k in path)
    np.testing.assert_array_equal(new, old + 1 if moment else old)
