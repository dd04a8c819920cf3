"""optax's own test battery for its optimizers, run on this library's.

The bodies of ``optax/contrib/_common_test.py`` (shipped in optax's wheel) are
imported and called unchanged: convergence on its targets, ``map_params``,
extra update arguments and no recompilation, ``inject_hyperparams``, dtype
preservation, ``MultiSteps`` accumulation, state dtype/shape stability and
learning-rate schedules. They find optimizers by name through the module's
``_get_opt_factory``, which the tests point at :data:`OPTIMIZERS`; the bodies
that build their own vector target (``_setup_parabola``, ``_setup_rosenbrock``)
get, for optimizers that need a matrix or a pair, the target named by
:data:`OPTIMIZERS` instead. What cannot run, and why, is :data:`EXCLUDED`,
whose reasons :func:`test_exclusions_are_documented_limits` checks.
"""

import functools
import inspect
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import _common_test as battery

import saggs_jax as saggs
from saggs_jax import equivariant as eqv

# ------------------------------------------------------------------ targets


def setup_centred_matrix_parabola(dtype):
  """The battery's matrix parabola with a target whose mean unit vector (row)
  is zero, as at the start: the only kind a centred rule can reach."""
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
  "parabola": battery._setup_parabola,
  "rosenbrock": battery._setup_rosenbrock,
  "matrix_parabola": battery._setup_matrix_parabola,
  "mixed": battery._setup_mixed_tensor_target,
  "centred_matrix_parabola": setup_centred_matrix_parabola,
  "qk": setup_qk,
}

# --------------------------------------------------------------- optimizers


class Case(NamedTuple):
  """One optimizer under test.

  Attributes:
    factory: ``factory(learning_rate) -> GradientTransformation``.
    learning_rate: the rate the battery runs it at.
    targets: convergence targets (keys of :data:`TARGETS`).
    stand_in: the target of the bodies that build the battery's vector
      parabola or Rosenbrock function: "parabola" keeps them (and runs the
      bodies with inline vector params too), another key of :data:`TARGETS`
      replaces them, None skips those bodies (a layout for one target only).
  """

  factory: Callable[..., optax.GradientTransformation]
  learning_rate: float
  targets: tuple[str, ...]
  stand_in: str | None


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


# The battery's leaves: "**" is the bare matrix of the matrix targets; "1" the
# matrix of the mixed target; "0" (2, 3) and "1" (2, 5, 2) the inject params.
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
  """:func:`eqv.symmetry_compatible` with roles routed to the battery's leaves."""

  def factory(learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    return eqv.symmetry_compatible(learning_rate, patterns=patterns)

  return factory


QK = [saggs.Pair("q", "k", axes=(1, 1))]
INJECT_PAIR = [saggs.Pair("0", "1", axes=(0, 0))]  # both inject params have 2 rows


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
VECTOR_ONLY = ("parabola", "rosenbrock", "test_preserve_dtype", "test_gradient_accumulation")

# (family, battery target or body) -> reason: the combinations that cannot run.
EXCLUDED = {
  **{(rule, what): MATRIX_ONLY for rule in RULES for what in VECTOR_ONLY},
  **{
    (rule, target): CENTRED
    for rule, (*_, centred) in RULES.items()
    if centred
    for target in ("matrix_parabola", "mixed")
  },
  **{(fam, what): NO_PAIR for fam in ("saggs_adam", "soft_adamw") for what in VECTOR_ONLY},
}


def family(name):
  return name.split("@")[0]


def test_exclusions_are_documented_limits():
  """Each exclusion fails the way its reason says; none hides a case that runs."""
  vector, matrix = jnp.zeros(3), jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 7.0]])
  for (fam, _), reason in EXCLUDED.items():
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
    runs = case.targets + (("parabola", *VECTOR_ONLY) if case.stand_in == "parabola" else ())
    assert not [what for what in runs if (family(name), what) in EXCLUDED], name


# ------------------------------------------------------------------- bodies


def body(name):
  """The function behind optax's parametrized test ``name``, and a ContribTest to call it on."""
  generated = [
    n
    for n, m in vars(battery.ContribTest).items()
    if getattr(getattr(m, "__wrapped__", None), "__name__", None) == name
  ]
  return getattr(battery.ContribTest, generated[0]).__wrapped__, battery.ContribTest(generated[0])


@pytest.fixture
def lookup(monkeypatch):
  """Points the battery at OPTIMIZERS; returns a function that also swaps in
  the stand-in target for the bodies that build the vector targets."""
  monkeypatch.setattr(battery, "_get_opt_factory", lambda name: OPTIMIZERS[name].factory)

  def use(name):
    stand_in = OPTIMIZERS[name].stand_in
    if stand_in not in (None, "parabola"):
      monkeypatch.setattr(battery, "_setup_parabola", TARGETS[stand_in])
      monkeypatch.setattr(battery, "_setup_rosenbrock", TARGETS[stand_in])
    return dict(opt_name=name, opt_kwargs={"learning_rate": OPTIMIZERS[name].learning_rate})

  return use


def convergence_cases():
  for name, case in OPTIMIZERS.items():
    for target in case.targets:
      yield pytest.param(name, target, id=f"{name}-{target}")


@pytest.mark.parametrize("name, target", list(convergence_cases()))
def test_optimizers(lookup, name, target):
  """map_params, 30000 steps, then within 3e-2 of the target."""
  fn, case = body("test_optimizers")
  fn(
    case,
    **lookup(name),
    wrapper_name=None,
    wrapper_kwargs=None,
    target=TARGETS[target],
    dtype="float32",
  )


WITH_STAND_IN = [n for n, c in OPTIMIZERS.items() if c.stand_in is not None]
ON_VECTORS = [n for n, c in OPTIMIZERS.items() if c.stand_in == "parabola"]


@pytest.mark.parametrize("name", WITH_STAND_IN)
def test_optimizers_accept_extra_args(lookup, name):
  fn, case = body("test_optimizers_accept_extra_args")
  fn(case, **lookup(name), wrapper_name=None, wrapper_kwargs=None, wrap=False)


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n.endswith("@inject")])
def test_optimizers_can_be_wrapped_in_inject_hyperparams(lookup, name):
  fn, case = body("test_optimizers_can_be_wrapped_in_inject_hyperparams")
  fn(case, **lookup(name))  # a SAGGS chain inside: its degrees measured, with no warning


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", ON_VECTORS)
def test_preserve_dtype(lookup, name, dtype):
  fn, case = body("test_preserve_dtype")
  fn(case, **lookup(name), dtype=dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", ON_VECTORS)
def test_gradient_accumulation(lookup, name, dtype):
  fn, case = body("test_gradient_accumulation")
  fn(case, **lookup(name), dtype=dtype)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64])
@pytest.mark.parametrize("name", WITH_STAND_IN)
def test_state_shape_dtype_shard_stability(lookup, name, dtype):
  fn, case = body("test_state_shape_dtype_shard_stability")
  fn(case, **lookup(name), wrapper_name=None, wrapper_kwargs=None, dtype=dtype)


@pytest.mark.parametrize("name", WITH_STAND_IN)
def test_optimizers_accept_learning_rate_schedule(lookup, name):
  # The body skips optimizers whose learning_rate is not annotated as a schedule.
  factory = OPTIMIZERS[name].factory
  assert inspect.signature(factory).parameters["learning_rate"].annotation is optax.ScalarOrSchedule
  fn, case = body("test_optimizers_accept_learning_rate_schedule_if_type_annotated_as_such")
  fn(case, **lookup(name), wrapper_name=None, wrapper_kwargs=None)


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
