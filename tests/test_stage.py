"""The stage protocol: toy stages with a before or an after hook against Adam written in
NumPy, a stage outside saggs_jax.chain refused with the fix, the former wrapper call."""

import chex
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import models
import saggs_jax as saggs
from models import random_like
from test_transform import (  # the small two-layer model and its pairs
  SMALL_PAIRS,
  small_imbalanced,
)


def test_plain_optax_chain_refuses_at_init_with_the_fix():
  """A SAGGS stage in optax.chain could not transport the moments before it: init refuses it
  and names both exact forms; the wrapper form it names is exact (the chain's updates)."""
  params = small_imbalanced(13)
  grads = random_like(params, 14)
  for build in (saggs.saggs, saggs.soft, saggs.scale_by_saggs):
    with pytest.raises(ValueError, match=r"saggs_jax.chain\(optax.adamw\(...\), saggs_jax."):
      optax.chain(optax.adam(1e-2), build(SMALL_PAIRS)).init(params)
    with pytest.raises(ValueError, match="outside saggs_jax.chain"):
      build(SMALL_PAIRS).update(grads, None, params)  # no init is needed to refuse
  wrapped = saggs.wrap(optax.adam(1e-2), saggs.saggs(SMALL_PAIRS))
  chained = saggs.chain(optax.adam(1e-2), saggs.saggs(SMALL_PAIRS))
  new_w, _, state_w = models.step(wrapped, params, wrapped.init(params), grads)
  new_c, _, state_c = models.step(chained, params, chained.init(params), grads)
  chex.assert_trees_all_equal(new_w, new_c)
  chex.assert_trees_all_equal(tuple(state_w), state_c)


def _adam(g, mu, nu, t, lr=0.1, b1=0.9, b2=0.999, eps=1e-8):
  mu, nu = b1 * mu + (1 - b1) * g, b2 * nu + (1 - b2) * g**2
  step = -lr * (mu / (1 - b1**t)) / (np.sqrt(nu / (1 - b2**t)) + eps)
  return step, mu, nu


def _toy(before=None, after=None):
  """Adam chained with a toy stage on Pair("q", "k") whose state counts its updates."""
  from saggs_jax._src import stage as protocol

  init = lambda params: jnp.zeros([], jnp.int32)  # noqa: E731
  stage = protocol.Stage("toy", (saggs.Pair("q", "k"),), init, before, after)
  return saggs.chain(optax.adam(0.1), protocol.symmetry_stage(stage))


def _two_steps(tx, params, grads):
  state = tx.init(params)
  for g in grads:
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _toy_problem():
  rng = np.random.default_rng(0)
  params = {n: rng.normal(size=(2, 3)).astype(np.float32) for n in ("q", "k")}
  grads = [{n: rng.normal(size=(2, 3)).astype(np.float32) for n in ("q", "k")} for _ in range(2)]
  return params, grads


def _check_adam(got, state, p, mu, nu):
  adam = state[0][0]
  for n in p:
    np.testing.assert_allclose(np.asarray(got[n]), p[n], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(adam.mu[n]), mu[n], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(adam.nu[n]), nu[n], rtol=1e-5, atol=1e-9)


def test_a_stage_before_the_step_gets_its_factors_applied_by_the_chain():
  """Factors 2, then 3, on the pair before each step: the parameters move (q*c, k/c), the
  gradients inversely, Adam's moments by their degrees (mu/c, nu/c**2 on q; the inverse on
  k), and the step lands on the moved parameters. (A constant factor would hide unscaled
  gradients: Adam's step does not see a gradient scale its moments share.)"""

  def before(state, params, plan, **extra):
    return {i.key: jnp.full(i.factor_shape, 2.0 + state) for i in plan.instances}, state + 1

  params, grads = _toy_problem()
  got, state = _two_steps(_toy(before=before), params, grads)
  p = {n: params[n].astype(np.float64) for n in params}
  mu = {n: np.zeros((2, 3)) for n in p}
  nu = {n: np.zeros((2, 3)) for n in p}
  for t, (g, c_q) in enumerate(zip(grads, (2.0, 3.0)), 1):
    for n, c in (("q", c_q), ("k", 1 / c_q)):
      p[n], mu[n], nu[n] = p[n] * c, mu[n] / c, nu[n] / c**2
      step, mu[n], nu[n] = _adam(g[n] / c, mu[n], nu[n], t)
      p[n] = p[n] + step
  _check_adam(got, state, p, mu, nu)
  assert int(state[1]) == 2  # the stage's own state is the hook's


def test_a_stage_after_the_step_corrects_it_and_moves_the_gauge():
  """A correction of 3 on the stepped pair (q*3, k/3) with gauge 2: the parameters land
  on the corrected step, and Adam's moments move by the gauge's degrees after the step."""
  from saggs_jax._src import stage as protocol

  def after(state, params, updates, plan, **extra):
    threes = {i.key: jnp.full(i.factor_shape, 3.0) for i in plan.instances}
    gauge = {i.key: jnp.full(i.factor_shape, 2.0) for i in plan.instances}
    return protocol.Correction(plan, threes, gauge), state

  params, grads = _toy_problem()
  got, state = _two_steps(_toy(after=after), params, grads)
  d, gauge = {"q": 3.0, "k": 1 / 3}, {"q": 2.0, "k": 0.5}
  p = {n: params[n].astype(np.float64) for n in params}
  mu = {n: np.zeros((2, 3)) for n in p}
  nu = {n: np.zeros((2, 3)) for n in p}
  for t, g in enumerate(grads, 1):
    for n in p:
      step, mu[n], nu[n] = _adam(g[n], mu[n], nu[n], t)
      p[n] = (p[n] + step) * d[n]
      mu[n], nu[n] = mu[n] / gauge[n], nu[n] / gauge[n] ** 2
  _check_adam(got, state, p, mu, nu)


@pytest.mark.parametrize(
  "build, name",
  [
    (saggs.saggs, "saggs"),
    (saggs.soft, "soft"),
    (saggs.scale_by_saggs, "scale_by_saggs"),
    (saggs.qk_clip, "qk_clip"),
  ],
)
def test_the_former_wrapper_call_is_a_type_error_naming_wrap(build, name):
  """A stage builder takes its pairs first: the former overload ``saggs(inner, pairs)``, an
  optimizer where the pairs go, is a TypeError whose message is the call that wraps it."""
  with pytest.raises(TypeError) as e:
    build(optax.adam(1e-3), SMALL_PAIRS)
  assert f"saggs_jax.wrap(inner, saggs_jax.{name}(pairs))" in str(e.value)
  tx = saggs.wrap(optax.sgd(0.0), build(SMALL_PAIRS))  # the form it names
  assert isinstance(tx.init(small_imbalanced(13)), saggs.SymmetryState)
