"""Moment transport: every registered state type against a hand-written transport.

The oracle multiplies, in NumPy, each moment of gradient degree k by
``c**-k`` per group on side A (``c**k`` on side B). Its degree table is checked
from first principles, not against the library: a state that depends only on
the gradient history must equal the state the same optimizer reaches from the
rescaled gradients ``g / c`` (A) and ``g c`` (B); AdaDelta's ``e_x`` depends on
its own updates, so its degrees are checked by its equivariance at eps=0
instead. Then the library's transport must equal the oracle.
"""

import functools
import re
import typing

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import models
import saggs_jax as saggs
from saggs_jax import equivariant
from saggs_jax._src.plan import resolve
from saggs_jax._src.transport import _LAYOUT_FIX, _RULES, UNREGISTERED_MSG, transport

rng = np.random.default_rng(0)
PARAMS = {
  n: jnp.asarray(rng.standard_normal(s), jnp.float32)
  for n, s in {"q": (3, 4), "k": (5, 4), "b": (4,), "w": (3,)}.items()
}
# q and k scale per block of two columns; b is q's bias; w belongs to no pair.
PAIRS = (saggs.Pair("q", "k", axes=(1, 1), groups=2, follow_a="b"),)
PLAN = resolve(PAIRS, PARAMS)
C = np.array([1.7, 0.6])
FACTORS = {"q|k": jnp.asarray(C, jnp.float32)}
# What each declared parameter is multiplied by; a degree-k moment by its power -k.
MULT = {"q": np.repeat(C, 2), "k": 1 / np.repeat(C, 2), "b": np.repeat(C, 2)}
GRADS = [models.random_like(PARAMS, seed) for seed in (1, 2, 3)]


def hand(x, path, k):
  return np.asarray(x, np.float64) * MULT[path] ** -k


def hand_grads(grads, k=1):
  return {p: jnp.asarray(hand(g, p, k), g.dtype) if p in MULT else g for p, g in grads.items()}


def hand_state(state, degrees, touched=None):
  """Every leaf ``<field>[path]`` with ``field`` in ``degrees`` and a declared path, rescaled."""

  def visit(key_path, x):
    fields = [i for i, e in enumerate(key_path) if isinstance(e, jax.tree_util.GetAttrKey)]
    rest = key_path[fields[-1] + 1 :] if fields else ()
    if len(rest) == 1 and isinstance(rest[0], jax.tree_util.DictKey) and rest[0].key in MULT:
      field = key_path[fields[-1]].name
      if field in degrees:
        if touched is not None:
          touched.add(field)
        return jnp.asarray(hand(x, rest[0].key, degrees[field]), x.dtype)
    return x

  return jax.tree_util.tree_map_with_path(visit, state)


@functools.cache
def _update(opt):  # one compile per optimizer is much cheaper than eager steps
  return jax.jit(opt.update)


def run(opt, grads, params=PARAMS, state=None):
  state = opt.init(params) if state is None else state
  for g in grads:
    updates, state = _update(opt)(g, state, params)
  return updates, state


def assert_close(got, want, what):
  chex.assert_trees_all_equal_structs(got, want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    np.testing.assert_allclose(
      g, w, rtol=1e-5, atol=1e-6 * np.max(np.abs(w), initial=1), err_msg=what
    )


ADAM = {"mu": 1, "nu": 2}


def _legacy_inject(inner):
  """Adam in optax's deprecated InjectHyperparamsState, which older checkpoints still hold."""

  def init(params):
    return optax.InjectHyperparamsState(jnp.zeros([], jnp.int32), {}, inner.init(params))

  def update(updates, state, params=None):
    updates, inner_state = inner.update(updates, state.inner_state, params)
    return updates, state._replace(count=state.count + 1, inner_state=inner_state)

  return optax.GradientTransformation(init, update)


# name: (optimizer, degree of each moment field). Derivations: mu, m, m1, m2, trace,
# acc_grads average gradients (1); nu, n, sum_of_squares, v (Adafactor), e_g average
# squared gradients (2); Adan's v averages gradient differences and g is the last
# gradient (1); AdaDelta's e_x averages squared *updates*, and an update moves like the
# parameter (degree -1), so e_x has degree -2.
CASES = {
  "adam": (optax.adam(1e-2), ADAM),
  "amsgrad": (optax.amsgrad(1e-2), {"mu": 1, "nu": 2, "nu_max": 2}),
  "adabelief": (optax.adabelief(1e-2, eps_root=0.0), ADAM),  # nu: EMA of (g - mu)**2
  "rmsprop_centered": (optax.rmsprop(1e-2, centered=True), ADAM),  # ScaleByRStdDevState
  "rmsprop": (optax.rmsprop(1e-2), {"nu": 2}),
  "adagrad": (optax.adagrad(1e-2, initial_accumulator_value=0.0), {"sum_of_squares": 2}),
  "lion": (optax.lion(1e-3), {"mu": 1}),
  "sgd_momentum": (optax.sgd(1e-2, momentum=0.9), {"trace": 1}),
  "adan": (optax.adan(1e-2), {"m": 1, "v": 1, "n": 2, "g": 1}),
  "adadelta": (optax.adadelta(1e-2, eps=0.0), {"e_g": 2, "e_x": -2}),
  "muon": (optax.contrib.muon(1e-2), ADAM),  # Muon's mu on matrices, Adam on vectors
  "ademamix": (optax.contrib.ademamix(1e-2), {"m1": 1, "m2": 1, "nu": 2}),
  "simplified_ademamix": (optax.contrib.simplified_ademamix(1e-2), {"m": 1, "n": 2}),
  "adafactor_unfactored": (optax.adafactor(1e-2), {"v": 2}),
  "multisteps": (
    optax.MultiSteps(optax.adam(1e-2), 2).gradient_transformation(),
    {**ADAM, "acc_grads": 1},
  ),
  "masked": (optax.masked(optax.adam(1e-2), {"q": True, "k": True, "b": False, "w": True}), ADAM),
  "partition": (
    optax.partition(
      {"a": optax.adam(1e-2), "l": optax.lion(1e-3)}, {"q": "a", "k": "l", "b": "a", "w": "l"}
    ),
    ADAM,
  ),
  "inject_hyperparams": (optax.inject_hyperparams(optax.adam)(learning_rate=1e-2), ADAM),
  "inject_legacy": (_legacy_inject(optax.adam(1e-2)), ADAM),
  "apply_if_finite": (optax.apply_if_finite(optax.adam(1e-2), 3), ADAM),
  "conditionally_mask": (optax.conditionally_mask(optax.adam(1e-2), lambda n: n >= 0), ADAM),
  "conditionally_transform": (
    optax.conditionally_transform(optax.adam(1e-2), lambda n: n >= 0),
    ADAM,
  ),
  "equivariant_momentum": (
    equivariant.layerwise(
      {("q", "k"): equivariant.optimizer(equivariant.scale_by_row_norm(1), 1e-2)},
      default=optax.adam(1e-2),
    ),
    ADAM,
  ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_transport_matches_hand_written(case):
  opt, degrees = CASES[case]
  if case == "adadelta":
    # At eps=0 AdaDelta is equivariant: from the hand-transported state and
    # gradients it makes the hand-transported update (degree -1) and state.
    s0 = models.random_like(opt.init(PARAMS), 4, positive=True)
    u, state = run(opt, GRADS[:1], state=s0)
    u_moved, s_moved = run(opt, [hand_grads(GRADS[0])], state=hand_state(s0, degrees))
    assert_close(u_moved, hand_grads(u, -1), f"{case} updates")
  else:
    _, state = run(opt, GRADS)
    _, s_moved = run(opt, [hand_grads(g) for g in GRADS])
  touched = set()
  want = hand_state(state, degrees, touched)
  assert touched == set(degrees), f"{case}: the oracle found no {set(degrees) - touched}"
  assert_close(s_moved, want, f"{case}: degrees from first principles")
  assert_close(transport(PLAN, state, FACTORS), want, f"{case}: library transport")


def _state_types(state):
  found = set()
  jax.tree.map(lambda x: x, state, is_leaf=lambda x: found.add(type(x)))  # visits every node
  return found


def test_every_registered_state_type_has_a_case():
  covered = set().union(*(_state_types(opt.init(PARAMS)) for opt, _ in CASES.values()))
  covered |= {optax.FactoredState, optax.LookaheadState}  # the tests below
  covered |= {saggs.SaggsState}  # test_transform: two symmetry stages in one chain
  covered |= {saggs.SymmetryState}  # test_optax_wrappers: the wrapper form
  library = {
    t for t in _RULES if t.__module__.split(".")[0] in ("optax", "saggs_jax")
  }  # not tests'
  missing = {t.__name__ for t in library} - {t.__name__ for t in covered}
  assert not missing, f"registered transports without a test: {sorted(missing)}"


# --- optax.flatten: one raveled vector of every parameter -----------------------


def test_flatten_state_is_unraveled_scaled_and_raveled():
  opt = optax.flatten(optax.adam(1e-2))
  _, (state, _) = run(opt, GRADS)
  _, (s_moved, _) = run(opt, [hand_grads(g) for g in GRADS])
  # optax.flatten concatenates the raveled leaves in tree order: b, k, q, w.
  names = sorted(PARAMS)
  ends = np.cumsum([PARAMS[n].size for n in names])[:-1]

  def hand_flat(x, k):
    pieces = np.split(np.asarray(x, np.float64), ends)
    return np.concatenate(
      [
        hand(v.reshape(PARAMS[n].shape), n, k).ravel() if n in MULT else v
        for n, v in zip(names, pieces)
      ]
    )

  got = transport(PLAN, state, FACTORS)
  for field, k in ADAM.items():
    want = hand_flat(getattr(state, field), k)
    assert not np.allclose(want, getattr(state, field), rtol=1e-3), field
    assert_close(getattr(s_moved, field), want, f"{field}: degree from first principles")
    assert_close(getattr(got, field), want, f"{field}: library transport")


_TARGET = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)


def _loss(p, target=_TARGET):
  """Invariant under q, b -> q c, b c and k -> k / c per column group."""
  return (
    jnp.sum((p["q"] @ p["k"].T - target) ** 2)
    + jnp.sum((p["k"] @ p["b"] - 1) ** 2)
    + jnp.sum((p["w"] - 1) ** 2)
  )


def _function(p):
  return {"qk": p["q"] @ p["k"].T, "kb": p["k"] @ p["b"], "w": p["w"]}


def trajectory(opt, steps, state=None, params=PARAMS):
  state = opt.init(params) if state is None else state
  for _ in range(steps):
    updates, state = _update(opt)(jax.grad(_loss)(params), state, params)
    params = optax.apply_updates(params, updates)
  return params


def test_chain_of_flatten_adam_follows_chain_of_adam():
  """Flattening does not change Adam's arithmetic, so with a SAGGS stage both move alike,
  from the same warm moments (raveled in tree order for optax.flatten)."""
  warm = models.random_like(optax.adam(3e-2).init(PARAMS), 9, positive=True)
  ravel = lambda tree: jnp.concatenate([x.ravel() for x in jax.tree.leaves(tree)])  # noqa: E731
  warm_flat = (warm[0]._replace(mu=ravel(warm[0].mu), nu=ravel(warm[0].nu)), warm[1])
  saggs_state = saggs.saggs(PAIRS).stage.init(PARAMS)
  flat = trajectory(
    saggs.chain(optax.flatten(optax.adam(3e-2)), saggs.saggs(PAIRS)), 3, (warm_flat, saggs_state)
  )
  plain = trajectory(saggs.chain(optax.adam(3e-2), saggs.saggs(PAIRS)), 3, (warm, saggs_state))
  chex.assert_trees_all_close(flat, plain, rtol=1e-5, atol=1e-6)


def test_equivariant_adadelta_trajectory_is_unchanged_by_balancing():
  """AdaDelta at eps=0 is equivariant: with transported moments, balancing never changes
  the function the parameters compute. A wrong e_x degree changes the step sizes. From init
  e_x stays 0 at eps=0, and its updates are homogeneous in it: the probe cannot measure its
  degree, so it keeps the registered one (-2) and says so."""
  opt = optax.adadelta(0.1, eps=0.0)
  s0 = models.random_like(opt.init(PARAMS), 5, positive=True)
  tx = saggs.chain(opt, saggs.saggs(PAIRS))
  with pytest.warns(UserWarning, match=r"e_x\['q'\].* stay zero .* register"):
    balanced = trajectory(tx, 4, (s0, tx.init(PARAMS)[1]))  # its first update measures
  alone = trajectory(opt, 4, s0)
  assert not np.allclose(balanced["q"], alone["q"], rtol=1e-2)  # balancing moved the weights
  chex.assert_trees_all_close(_function(balanced), _function(alone), rtol=2e-5, atol=1e-5)


# --- Adafactor's factored second moment -------------------------------------------

BIG = {
  n: jnp.asarray(rng.standard_normal(s), jnp.float32)
  for n, s in {"q": (128, 130), "k": (129, 130), "qh": (128, 2, 130), "kh": (129, 2, 130)}.items()
}
# One factor per tensor for q/k; one per head (axis 1, not among the two largest) for qh/kh.
BIG_PLAN = resolve((saggs.Pair("q", "k"), saggs.Pair("qh", "kh", axes=(1, 1))), BIG)
CB, CH = 1.9, np.array([0.7, 1.6])
BIG_FACTORS = {"q|k": jnp.float32(CB), "qh|kh": jnp.asarray(CH, jnp.float32)}
# Gradients are multiplied by these; the factored means of g**2 by their squares,
# reduced over the axis each mean has dropped: v_row drops the largest axis, v_col the next.
BIG_GRAD_MULT = {"q": 1 / CB, "k": CB, "qh": 1 / CH[:, None], "kh": CH[:, None]}
BIG_STATS = {  # (v_row shape, v_row multiplier, v_col shape, v_col multiplier)
  "q": ((128,), CB**-2, (130,), CB**-2),
  "k": ((129,), CB**2, (130,), CB**2),
  "qh": ((128, 2), CH**-2, (2, 130), CH[:, None] ** -2),
  "kh": ((129, 2), CH**2, (2, 130), CH[:, None] ** 2),
}


def test_adafactor_factored_moments_transported_exactly():
  opt = optax.adafactor(1e-2)  # factors dims >= 128
  grads = [models.random_like(BIG, seed) for seed in (6, 7)]
  moved = [{n: g[n] * BIG_GRAD_MULT[n] for n in g} for g in grads]
  _, (state, *_) = run(opt, grads, BIG)
  _, (s_moved, *_) = run(opt, moved, BIG)
  got = transport(BIG_PLAN, state, BIG_FACTORS)
  for n, (row_shape, row_mult, col_shape, col_mult) in BIG_STATS.items():
    assert state.v[n].shape == (1,), n  # factored: v is a stand-in, left alone
    np.testing.assert_array_equal(got.v[n], state.v[n])
    for field, shape, mult in (("v_row", row_shape, row_mult), ("v_col", col_shape, col_mult)):
      x = getattr(state, field)[n]
      assert x.shape == shape, (n, field)
      want = np.asarray(x, np.float64) * mult
      np.testing.assert_allclose(getattr(s_moved, field)[n], want, rtol=1e-5, err_msg=(n, field))
      np.testing.assert_allclose(getattr(got, field)[n], want, rtol=1e-6, err_msg=(n, field))


@pytest.mark.parametrize(
  "pair, shapes, why",
  [
    (
      saggs.Pair("q", "k", axes=(1, 1), groups=2),
      ((128, 130), (129, 130)),
      r"axis 1 \(groups\), which Adafactor averages\. Declare axes=None or factored=False",
    ),
    (
      saggs.Pair("q", "k", stacked=1),
      ((130, 128, 3), (130, 129, 3)),
      r"axis 0 \(stacked copies\), which Adafactor averages\. Pass adafactor\(\.\.\., factored=False",
    ),
  ],
  ids=["groups", "stacked"],
)
def test_adafactor_refuses_factors_that_change_along_a_factored_axis(pair, shapes, why):
  params = {"q": jnp.ones(shapes[0]), "k": jnp.ones(shapes[1])}
  plan = resolve(pair, params)
  factors = {inst.key: jnp.full(inst.factor_shape, 2.0) for inst in plan.instances}
  state = optax.adafactor(1e-2).init(params)
  with pytest.raises(
    TypeError,
    match=r"FactoredState at opt_state\[0\]\.v_row\['k'\]: the factors"
    rf" change along {why}",
  ):
    transport(plan, state, factors)
  # Unfactored, the same pair transports like Adam's nu.
  state = jax.tree.map(jnp.ones_like, optax.adafactor(1e-2, factored=False).init(params))
  np.testing.assert_allclose(transport(plan, state, factors)[0].v["q"], 0.25, rtol=1e-6)


# --- Lookahead: the slow weights are parameters ------------------------------------

LA_PARAMS = optax.LookaheadParams(fast=PARAMS, slow=models.random_like(PARAMS, 8))
LA_PAIRS = (
  saggs.Pair(
    "fast/q",
    "fast/k",
    axes=(1, 1),
    groups=2,
    follow_a=("fast/b", "slow/q", "slow/b"),
    follow_b="slow/k",
  ),
)
LOOKAHEAD = optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)


def test_lookahead_fast_state_transported_with_slow_weights_following():
  _, state = run(LOOKAHEAD, GRADS, LA_PARAMS)
  _, s_moved = run(LOOKAHEAD, [hand_grads(g) for g in GRADS], LA_PARAMS)
  touched = set()
  want = hand_state(state, ADAM, touched)
  assert touched == set(ADAM)
  assert_close(s_moved, want, "degrees from first principles")
  got = transport(resolve(LA_PAIRS, LA_PARAMS), state, {"fast/q|fast/k": FACTORS["q|k"]})
  assert_close(got, want, "library transport")


@pytest.mark.parametrize("pairs", [PAIRS, (saggs.Pair("fast/q", "fast/k"),)], ids=["apart", "fast"])
def test_lookahead_refuses_slow_weights_that_do_not_follow(pairs):
  """Each synchronisation mixes slow and fast weights: they must move by the same factors."""
  plan = resolve(pairs, LA_PARAMS)
  factors = {inst.key: jnp.full(inst.factor_shape, 2.0) for inst in plan.instances}
  with pytest.raises(
    TypeError,
    match=r"LookaheadState at opt_state: the slow weight 'slow/\w+'"
    r" moves apart from its fast weight\. .* follow_a='slow/q'",
  ):
    transport(plan, LOOKAHEAD.init(LA_PARAMS), factors)


# --- refusals: images the rules cannot transport -----------------------------------


class ListState(typing.NamedTuple):
  """Keeps parameter-shaped moments in a list: indices, not parameter paths."""

  moments: list


def _unregistered(name, where, hit):
  """:data:`UNREGISTERED_MSG` up to its fix."""
  return UNREGISTERED_MSG.split("{fix}")[0].format(name=name, where=where, hit=hit)


def test_unregistered_list_of_parameter_shaped_arrays_refused():
  state = ListState([jnp.ones((3, 4)), jnp.ones((5, 4))])
  with pytest.raises(
    TypeError,
    match=re.escape(_unregistered("ListState", "opt_state", "moments/0"))
    + r"Register its degrees: saggs_jax\.register_transport\(ListState, ",
  ):
    transport(PLAN, state, FACTORS)
  with pytest.raises(
    TypeError,
    match=re.escape(_unregistered("the plain container", "opt_state", "1/0")) + "Wrap such arrays",
  ):
    transport(PLAN, (optax.EmptyState(), [jnp.ones((5, 4))]), FACTORS)


def test_registered_field_not_laid_out_like_the_parameters_refused():
  saggs.register_transport(ListState, {"moments": 1})
  try:
    with pytest.raises(
      TypeError,
      match=r"ListState at opt_state\.moments\['0'\]: no parameter"
      r" has this path, and it is not all of them raveled\. " + re.escape(_LAYOUT_FIX),
    ):
      transport(PLAN, ListState([jnp.ones((3, 4))]), FACTORS)
  finally:
    del _RULES[ListState]
  bad = optax.ScaleByRmsState(nu={**PARAMS, "q": jnp.ones(4)})
  with pytest.raises(
    TypeError,
    match=r"ScaleByRmsState at opt_state\.nu\['q'\]: its parameter"
    r" has shape \(3, 4\), this leaf \(4,\)\. " + re.escape(_LAYOUT_FIX),
  ):
    transport(PLAN, bad, FACTORS)


def test_unregistered_raveled_state_refused():
  ema = optax.ema(0.9)  # its EmaState has no rule
  state = optax.flatten(ema).init(PARAMS)
  with pytest.raises(
    TypeError,
    match=re.escape(_unregistered("EmaState", "opt_state", "ema"))
    + r"Register its degrees: saggs_jax\.register_transport\(EmaState, ",
  ):
    transport(PLAN, state, FACTORS)
