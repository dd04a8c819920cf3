"""Symmetry stages under optax's wrappers and utilities, against a hand-written oracle.

Every symmetry stage (``saggs.saggs``, ``saggs.soft``, ``saggs.qk_clip``) is spelled in each
form users write (``saggs.chain``, the wrapper ``saggs.wrap(inner, stage)``, a ``_replace``d or
copied stage) and put inside ``optax.named_chain``, ``optax.chain``, ``optax.MultiSteps``,
``optax.apply_if_finite``, ``optax.inject_hyperparams`` and ``flax.nnx.Optimizer``. The
oracle is the equivalent history, written here in NumPy: before each Adam step SAGGS moves
the parameters to ``T_c p`` (c from the group norms), the gradient to ``g / c`` (A) and
``g c`` (B) and Adam's moments by ``c**-k`` / ``c**k``; qk_clip (α = 1/2, which moves no
moment) scales each head with ``S_h > τ`` by ``(τ / S_h)**½`` on both sides after the step.
Each optimizer then goes through ``otu.tree_get(state, "count")`` as plain Adam in the
same wrapper does.
"""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.tree_utils as otu
import pytest
from flax import nnx

import saggs_jax as saggs

LR, TAU, HD = 0.1, 1.0, 2
PAIRS = [saggs.Pair("q", "k", axes=(1, 1), groups=2)]  # 2 heads of HD = 2 columns
S = {"q": np.array([4.0 * TAU, TAU / 2], np.float32)}  # head 0 over τ: γ = 1/4


def _tree(seed, scale_q=1.0, scale_k=1.0):
  rng = np.random.default_rng(seed)
  return {
    "q": jnp.asarray(rng.standard_normal((3, 4)) * scale_q, jnp.float32),
    "k": jnp.asarray(rng.standard_normal((3, 4)) * scale_k, jnp.float32),
  }


PARAMS = _tree(0, 3.0, 0.5)  # far from balanced
GRADS = [_tree(s) for s in range(1, 5)]
STAGES = {  # the stage, and the strength of its balancing (None: qk_clip's)
  "saggs": (lambda: saggs.saggs(PAIRS), 1.0),
  "soft": (lambda: saggs.soft(PAIRS, 0.5), 0.5),
  "qk_clip": (lambda: saggs.qk_clip(PAIRS, TAU), None),
}


def oracle(stage, grads):
  """``(params, adam_state)`` after ``grads``, in NumPy float64 with optax's Adam."""
  strength = STAGES[stage][1]
  adam = optax.adam(LR)
  p = {n: np.asarray(x, np.float64) for n, x in PARAMS.items()}
  state = adam.init(p)
  for g in grads:
    g = {n: np.asarray(x, np.float64) for n, x in g.items()}
    if strength is not None:
      group = lambda x: np.linalg.norm(x.reshape(3, 2, HD), axis=(0, 2))  # noqa: E731
      c = np.repeat((group(p["k"]) / group(p["q"])) ** (strength / 2), HD)
      m = {"q": c, "k": 1 / c}
      p = {n: p[n] * m[n] for n in p}
      g = {n: g[n] / m[n] for n in g}
      s = state[0]
      mu, nu = ({n: t[n] * m[n] ** -k for n in t} for t, k in ((s.mu, 1), (s.nu, 2)))
      state = (s._replace(mu=mu, nu=nu), *state[1:])
    u, state = adam.update(g, state, p)
    p = {n: p[n] + u[n] for n in p}
    if strength is None:
      gamma = np.where(S["q"] > TAU, TAU / S["q"], 1.0)
      half = np.repeat(np.sqrt(gamma), HD)
      p = {n: p[n] * half for n in p}
  return p, state[0]


def run(tx, grads, params=PARAMS):
  state = tx.init(params)
  step = jax.jit(lambda g, s, p: tx.update(g, s, p, max_logits=S))
  for g in grads:
    updates, state = step(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def adam_state(state):
  """The one ScaleByAdamState inside ``state``."""
  found = otu.tree_get(state, "ScaleByAdamState")
  assert found is not None, state
  return found


def assert_matches(params, state, want):
  p, s = want
  for n in p:
    np.testing.assert_allclose(params[n], p[n], rtol=2e-5, atol=1e-6, err_msg=n)
  got = adam_state(state)
  assert int(got.count) == int(s.count)
  for field in ("mu", "nu"):
    for n in p:
      w = getattr(s, field)[n]
      np.testing.assert_allclose(
        getattr(got, field)[n], w, rtol=2e-5, atol=1e-7 * np.abs(w).max(), err_msg=f"{field}.{n}"
      )


def count_of(state):
  try:
    return int(otu.tree_get(state, "count"))
  except KeyError as e:  # several counts: as for plain Adam in the same wrapper
    return type(e).__name__


def chained(stage):
  return saggs.chain(optax.adam(LR), STAGES[stage][0]())


FORMS = {
  "chain": chained,
  "wrapper": lambda stage: saggs.wrap(optax.adam(LR), STAGES[stage][0]()),
  "replaced": lambda stage: saggs.chain(
    optax.adam(LR), (s := STAGES[stage][0]())._replace(init=s.init)
  ),
  "copied": lambda stage: saggs.chain(optax.adam(LR), copy.copy(STAGES[stage][0]())),
  "deepcopied": lambda stage: saggs.chain(optax.adam(LR), copy.deepcopy(STAGES[stage][0]())),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("stage", STAGES)
def test_every_form_follows_the_equivalent_history(stage, form):
  params, state = run(FORMS[form](stage), GRADS)
  assert_matches(params, state, oracle(stage, GRADS))
  assert count_of(state) == len(GRADS)  # the stage's own counter is SaggsState.step


# Each wraps an optimizer ``opt`` (symmetric or plain Adam); ``grads`` is what the optimizer
# inside receives (MultiSteps: means of pairs; apply_if_finite: the finite ones).
NAN = {n: jnp.full_like(x, jnp.nan) for n, x in GRADS[0].items()}
WRAPPERS = {
  "named_chain": (lambda opt: optax.named_chain(("opt", opt), ("id", optax.identity())), GRADS),
  "optax_chain": (lambda opt: optax.chain(opt, optax.identity()), GRADS),
  "multisteps": (
    lambda opt: optax.MultiSteps(opt, every_k_schedule=2),
    [jax.tree.map(lambda a, b: (a + b) / 2, *GRADS[i : i + 2]) for i in (0, 2)],
  ),
  "apply_if_finite": (lambda opt: optax.apply_if_finite(opt, 3), GRADS[:1] + GRADS[2:]),
}


@pytest.mark.parametrize("form", ["chain", "wrapper"])
@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("stage", STAGES)
def test_optax_wrappers_around_the_whole_optimizer(stage, wrapper, form):
  wrap, inner_grads = WRAPPERS[wrapper]
  grads = GRADS[:1] + [NAN] + GRADS[2:] if wrapper == "apply_if_finite" else GRADS
  params, state = run(wrap(FORMS[form](stage)), grads)
  assert_matches(params, state, oracle(stage, inner_grads))
  assert count_of(state) == count_of(run(wrap(optax.adam(LR)), grads)[1])


@pytest.mark.parametrize("stage", STAGES)
def test_inject_hyperparams_around_the_whole_chain(stage):
  """Under jit its rate is a tracer of init's and update's traces: the degree probe binds it
  to a stand-in, and measures without a warning."""
  tx = optax.inject_hyperparams(
    lambda learning_rate: saggs.chain(optax.adam(learning_rate), STAGES[stage][0]())
  )(learning_rate=LR)
  params, state = run(tx, GRADS)
  assert_matches(params, state, oracle(stage, GRADS))
  assert float(state.hyperparams["learning_rate"]) == pytest.approx(LR)


class QK(nnx.Module):
  def __init__(self):
    self.q = nnx.Param(PARAMS["q"])
    self.k = nnx.Param(PARAMS["k"])


@pytest.mark.parametrize("form", ["chain", "wrapper"])
@pytest.mark.parametrize("stage", ["saggs", "qk_clip"])
def test_flax_nnx_optimizer(stage, form):
  model = QK()
  optimizer = nnx.Optimizer(model, FORMS[form](stage), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, g):
    optimizer.update(
      model, nnx.State({"q": nnx.Param(g["q"]), "k": nnx.Param(g["k"])}), max_logits=S
    )

  for g in GRADS:
    step(model, optimizer, g)
  params = {"q": model.q[...], "k": model.k[...]}
  assert_matches(params, nnx.as_pure(optimizer.opt_state), oracle(stage, GRADS))


def test_the_stage_itself_is_an_ordinary_optax_transformation():
  """No attributes set on a NamedTuple: _replace, copy and optax's isinstance checks keep it."""
  stage = saggs.saggs(PAIRS)
  assert isinstance(stage, optax.GradientTransformationExtraArgs)
  assert copy.copy(stage) == stage and stage._replace(init=stage.init).stage is stage.stage
  assert chained("saggs").optimizer is not None
  assert FORMS["wrapper"]("saggs")._replace().optimizer is not None


@pytest.mark.parametrize("form", ["chain", "wrapper"])
def test_canonicalize_takes_the_chain_with_its_own_state(form):
  """tx= the chain (or wrapper) that made the state: its optimizer's moments move by their
  measured degrees (adamax's nu: 1, as mu), the stage's state stays; tx= the inner optimizer
  with the chain's state is a clear error."""
  tx = (
    saggs.chain(optax.adamax(LR), saggs.saggs(PAIRS))
    if form == "chain"
    else saggs.wrap(optax.adamax(LR), saggs.saggs(PAIRS))
  )
  state = tx.init(PARAMS)
  for g in GRADS[:2]:
    _, state = tx.update(g, state, PARAMS)  # PARAMS stay imbalanced: there is work left
  new_params, new_state = saggs.canonicalize(PARAMS, state, PAIRS, tx=tx)
  inner, stage_state = state
  group = lambda x: np.linalg.norm(np.asarray(x, np.float64).reshape(3, 2, HD), axis=(0, 2))  # noqa: E731
  c = np.repeat(np.sqrt(group(PARAMS["k"]) / group(PARAMS["q"])), HD)
  m = {"q": c, "k": 1 / c}
  for n in m:
    np.testing.assert_allclose(new_params[n], PARAMS[n] * m[n], rtol=1e-5)
    for field in ("mu", "nu"):
      np.testing.assert_allclose(
        getattr(new_state[0][0], field)[n], getattr(inner[0], field)[n] / m[n], rtol=1e-5
      )
  assert type(new_state) is type(state)
  assert jax.tree.all(jax.tree.map(np.array_equal, new_state[1], stage_state))
  with pytest.raises(ValueError, match="for a saggs_jax.chain's state, the chain itself"):
    saggs.canonicalize(PARAMS, state, PAIRS, tx=optax.adamax(LR))


def test_lookahead_inside_the_chain_is_refused_recommending_no_inexact_form():
  """The refusal used to recommend optax.lookahead(saggs_jax.chain(...)), which balances the
  fast weights alone and leaves equivalent states apart (issue 43, finding 6)."""
  tx = saggs.chain(optax.lookahead(optax.adam(LR), 2, 0.5), saggs.saggs(PAIRS))
  params = optax.LookaheadParams.init_synced(PARAMS)
  with pytest.raises(ValueError, match=r"LookaheadParams.*is no way out") as e:
    tx.init(params)
  assert "optax.lookahead(saggs_jax.chain" not in str(e.value)


LOOKAHEAD_FORMS = {
  "chain": lambda: optax.lookahead(saggs.chain(optax.adam(LR), saggs.saggs(PAIRS)), 3, 0.5),
  "wrapper": lambda: optax.lookahead(saggs.wrap(optax.adam(LR), saggs.saggs(PAIRS)), 3, 0.5),
  "nested": lambda: optax.lookahead(
    optax.chain(optax.scale(1.0), saggs.chain(optax.adam(LR), saggs.soft(PAIRS, 0.5))), 3, 0.5
  ),
}


@pytest.mark.parametrize("form", LOOKAHEAD_FORMS)
def test_a_symmetry_stage_inside_lookahead_is_refused_at_its_first_update(form):
  """optax.lookahead(saggs.chain(...)) balanced the fast weights alone (issue 43, finding 6):
  refused at the update's trace, jitted or not, with the reason and no inexact way out."""
  tx = LOOKAHEAD_FORMS[form]()
  params = optax.LookaheadParams.init_synced(PARAMS)
  state = tx.init(params)  # lookahead's init hands the chain plain fast weights
  for update in (tx.update, jax.jit(tx.update)):
    with pytest.raises(ValueError, match=r"inside optax.lookahead's fast optimizer") as e:
      update(GRADS[0], state, params)
    assert "slow weights" in str(e.value) and "Train without lookahead" in str(e.value)
  # The same chain outside lookahead is not refused: the check reads the call, not the chain.
  inner = saggs.chain(optax.adam(LR), saggs.saggs(PAIRS))
  inner.update(GRADS[0], inner.init(PARAMS), PARAMS)


def test_the_lookahead_refusal_is_true_equivalent_states_part(monkeypatch):
  """Why it is refused: with the check off, two equivalent lookahead states (fast and slow
  weights moved by the same factors, Adam's moments by c**-1 and c**-2, built here in NumPy)
  end with slow weights computing other functions (q kᵀ per head), and stay apart."""
  monkeypatch.setattr(saggs._src.degrees, "_refuse_inside_lookahead", lambda: None)
  tx = LOOKAHEAD_FORMS["chain"]()
  slow = _tree(7, 1.0, 2.0)
  params = optax.LookaheadParams(fast=PARAMS, slow=slow)
  c = np.repeat(np.array([3.0, 0.25]), HD)  # per head, columns of q (k by 1 / c)
  m = {"q": c, "k": 1 / c}
  moved = optax.LookaheadParams(
    fast={n: PARAMS[n] * m[n] for n in m}, slow={n: slow[n] * m[n] for n in m}
  )
  state = tx.init(params)  # fresh: zero moments, equal counts (moved by any degree)
  target = np.random.default_rng(3).standard_normal((2, 3, 3))

  def heads(p):  # q kᵀ of each head: what the function reads of the pair
    q, k = (jnp.asarray(p[n]).reshape(3, 2, HD) for n in ("q", "k"))
    return jnp.einsum("ihd,jhd->hij", q, k)

  grad = jax.jit(jax.grad(lambda p: jnp.sum((heads(p) - target) ** 2)))
  step = jax.jit(tx.update)
  np.testing.assert_allclose(heads(moved.slow), heads(slow), rtol=1e-5)  # equivalent
  states = [(params, state), (moved, state)]
  for _ in range(9):  # three synchronisations; each state's gradient at its own fast weights
    states = [
      (optax.apply_updates(p, u), s)
      for p, (u, s) in ((p, step(grad(p.fast), s, p)) for p, s in states)
    ]
  a, b = (np.asarray(heads(p.slow)) for p, _ in states)
  assert np.max(np.abs(a - b)) > 1e-2 * np.max(np.abs(a))  # apart, not rounding


def test_checkpoint_restore_canonicalizes_a_wrapper_state(tmp_path):
  """saggs.checkpoint.restore with tx= a wrapper gives back a SymmetryState, its moments moved
  as canonicalize moves them."""
  import orbax.checkpoint as ocp

  tx = saggs.wrap(optax.adamax(LR), saggs.saggs(PAIRS))
  state = tx.init(PARAMS)
  _, state = tx.update(GRADS[0], state, PARAMS)
  manager = ocp.CheckpointManager(tmp_path)
  saggs.checkpoint.save(manager, 1, PARAMS, state)
  manager.wait_until_finished()
  params, restored = saggs.checkpoint.restore(manager, PARAMS, tx.init(PARAMS), PAIRS, tx=tx)[:2]
  manager.close()
  assert isinstance(restored, saggs.SymmetryState)
  want = saggs.canonicalize(PARAMS, state, PAIRS, tx=tx)
  for got, w in zip(jax.tree.leaves((params, restored)), jax.tree.leaves(want)):
    np.testing.assert_allclose(got, w, rtol=1e-6)


# --- pure transformations: no state outside the optimizer state, one plan per trace -----


@pytest.mark.parametrize("every", [1, 2])
def test_update_needs_no_init_of_its_own_and_traces_do_not_depend_on_each_other(every):
  """An update of a transformation that never ran init (the state made by another instance
  of the same optimizer), and a second trace of it, give the first's updates bit for bit."""
  make = lambda: saggs.chain(optax.adam(LR), saggs.saggs(PAIRS, every=every))  # noqa: E731
  first, fresh = make(), make()
  state = first.init(PARAMS)
  want = []
  for g in GRADS[:3]:
    u, state = jax.jit(first.update)(g, state, PARAMS)
    want.append(u)
  state = first.init(PARAMS)
  for g, w in zip(GRADS[:3], want):
    u, state = jax.jit(fresh.update)(g, state, PARAMS)  # a new trace each step
    for n in w:
      np.testing.assert_array_equal(u[n], w[n], err_msg=n)


def test_each_stage_resolves_its_pairs_once_per_trace(monkeypatch):
  import saggs_jax._src.stage as transform

  calls = []
  resolve = transform.resolve
  monkeypatch.setattr(transform, "resolve", lambda *a: calls.append(1) or resolve(*a))
  tx = saggs.chain(optax.adam(LR), saggs.saggs(PAIRS, every=2), saggs.qk_clip(PAIRS, TAU))
  state = tx.init(PARAMS)
  calls.clear()
  jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p, max_logits=S))(GRADS[0], state, PARAMS)
  assert len(calls) == 2  # one per symmetry stage
