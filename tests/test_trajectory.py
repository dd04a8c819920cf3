"""Same function, different trajectory (Kim, 2026), and how canonicalization restores one.

Two equivalent checkpoints of a tiny attention + SwiGLU model are saved and
restored with Orbax: the state as trained, and the same state with Q*2 / K/2
(and random per-group factors on V/O and up/down), moments transported.
Trajectories are compared after mapping both runs to a common frame (the
canonical form, or the inverse transform).

"Equal" in float32: two runs from one canonical state agree to ~1e-6 relative
after 60 steps here (rounding differences do not blow up), so TOL = 1e-5; the
divergence of a non-equivariant optimizer must exceed 100 * TOL.
"""

import functools

import chex
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import models
import saggs_jax as saggs

PAIRS = models.llama_pairs()
TOL = 1e-5
WARMUP, DIVERGE, FOLLOW = 20, 20, 60
BATCHES = models.batches(1, WARMUP + FOLLOW)

grad_fn = jax.jit(jax.value_and_grad(models.llama_loss))

OPTIMIZERS = {
  "sgd": lambda: optax.sgd(0.1),
  "momentum": lambda: optax.sgd(0.05, momentum=0.9),
  "adam": lambda: optax.adam(1e-2),
  "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
  "lion": lambda: optax.lion(1e-3, weight_decay=0.1),
  "adamw+saggs": lambda: saggs.chain(optax.adamw(1e-2, weight_decay=0.1), saggs.saggs(PAIRS)),
}


@functools.cache
def optimizer(name):
  """One instance per name, so that ``models.jit_step`` compiles once per optimizer."""
  return OPTIMIZERS[name]()


def train(name, params, state, batches):
  """Runs one update per batch; returns params, state and the losses before each update."""
  tx, losses = optimizer(name), []
  # Restored arrays are committed to a device, fresh ones are not; a mix would
  # make the second step compile again.
  params, state = jax.device_put((params, state), jax.devices()[0])
  for batch in batches:
    loss, grads = grad_fn(params, batch)
    params, _, state = models.jit_step(tx, params, state, grads)
    losses.append(loss)
  return params, state, np.asarray(losses)


QUARTER_TO_FOUR = models.random_factors(0, 1 / 4, 4.0)


def factor_fn(path, shape):
  """Q*2 / K/2, and log-uniform factors in [1/4, 4] per group on V/O and up/down."""
  return np.full(shape, 2.0, np.float32) if "q_proj" in path else QUARTER_TO_FOUR(path, shape)


def inverse(params, state):
  return saggs.reparameterize(params, state, PAIRS, models.inverse(factor_fn))


def canonical(params):
  return saggs.canonicalize(params, None, PAIRS)[0]


def distance(a, b):
  """Largest relative Frobenius distance over the leaves of two trees (in NumPy float64);
  absolute for a leaf that is zero in ``b`` (a 0/0 NaN would drop out of ``max``)."""
  leaves = zip(*(map(lambda x: np.asarray(x, np.float64), jax.tree.leaves(t)) for t in (a, b)))
  return max(np.linalg.norm(x - y) / (np.linalg.norm(y) or 1.0) for x, y in leaves)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """Equivalent states written with Orbax and restored into a fresh target.

  Returns ``{"as_is"|"moved": {"raw"|"canonical": (params, opt_state)}}``.
  """
  tx = optimizer("adamw")
  params = models.llama_init(0)
  trained = train("adamw", params, tx.init(params), BATCHES[:WARMUP])[:2]
  saved = {"as_is": trained, "moved": saggs.reparameterize(*trained, PAIRS, factor_fn)}
  target = (params, tx.init(params))
  out = {}
  for name, state in saved.items():
    manager = ocp.CheckpointManager(tmp_path_factory.mktemp(name))
    saggs.checkpoint.save(manager, WARMUP, *state)
    out[name] = {
      "raw": saggs.checkpoint.restore(manager, *target, canonicalize=False)[:2],
      "canonical": saggs.checkpoint.restore(manager, *target, PAIRS, tx=tx)[:2],
    }
    manager.close()
    chex.assert_trees_all_equal(out[name]["raw"], state)
  return out


@pytest.mark.parametrize("stacked", [False, True], ids=["layers", "stacked"])
def test_equivalent_states_give_equal_outputs(stacked):
  config = models.STACKED if stacked else models.CONFIG
  pairs = models.llama_pairs(config)
  params = models.llama_init(2, config)
  tokens = BATCHES[0, :, :-1]
  reference = models.llama_apply(params, tokens, config)
  for equivalent in (
    saggs.reparameterize(params, None, pairs, factor_fn)[0],
    saggs.canonicalize(params, None, pairs)[0],
  ):
    assert distance(equivalent, params) > 0.05  # a genuinely different point...
    chex.assert_trees_all_close(
      models.llama_apply(equivalent, tokens, config), reference, rtol=TOL, atol=TOL
    )  # ...computing the same function


def test_gradients_transform_contravariantly(checkpoints):
  # dL/d(cA) = (dL/dA) / c: why momentum transports with c**-1 and Adam's nu with c**-2.
  (p, _), (q, _) = checkpoints["as_is"]["raw"], checkpoints["moved"]["raw"]
  loss_p, grads_p = grad_fn(p, BATCHES[WARMUP])
  loss_q, grads_q = grad_fn(q, BATCHES[WARMUP])
  np.testing.assert_allclose(loss_q, loss_p, rtol=TOL)
  moved_grads_p = saggs.reparameterize(grads_p, None, PAIRS, models.inverse(factor_fn))[0]
  chex.assert_trees_all_close(grads_q, moved_grads_p, rtol=1e-4, atol=1e-7)


def test_adamw_diverges_from_equivalent_checkpoints(checkpoints):
  runs = [
    train("adamw", *checkpoints[k]["raw"], BATCHES[WARMUP : WARMUP + DIVERGE])
    for k in ("as_is", "moved")
  ]
  np.testing.assert_allclose(runs[1][2][0], runs[0][2][0], rtol=TOL)  # same loss at restart
  assert abs(runs[1][2][-1] / runs[0][2][-1] - 1) > 100 * TOL
  assert distance(canonical(runs[1][0]), canonical(runs[0][0])) > 100 * TOL


@pytest.mark.parametrize(
  "name,restored", [("adamw+saggs", "canonical"), ("adamw", "canonical"), ("adamw+saggs", "raw")]
)
def test_canonicalized_checkpoints_follow_one_trajectory(checkpoints, name, restored):
  """Restored onto the canonical representative, or, with hard SAGGS (which balances
  before its first step), restored as saved: both equivalent checkpoints train alike."""
  tx = optimizer(name)

  def start(key):
    params, adam_state = checkpoints[key][restored]
    if name == "adamw":
      return params, adam_state
    return params, (adam_state, tx.init(params)[1])  # SAGGS added at the restart

  runs = [train(name, *start(k), BATCHES[WARMUP:]) for k in ("as_is", "moved")]
  assert runs[0][2][-1] < 0.8 * runs[0][2][0]  # it trained
  np.testing.assert_allclose(runs[1][2], runs[0][2], rtol=TOL)
  # Elementwise, entries that pass near zero need an absolute floor.
  chex.assert_trees_all_close(runs[1][0], runs[0][0], rtol=TOL, atol=TOL / 10)
  assert distance(runs[1][0], runs[0][0]) < TOL
  # Momentum averages gradients that cancel near convergence: ~3e-6 here.
  assert distance(runs[1][1], runs[0][1]) < 10 * TOL


def test_transported_moments_alone_do_not_make_adamw_equivariant(checkpoints):
  # One step from each checkpoint, the second mapped back by the inverse transform.
  batch = BATCHES[WARMUP : WARMUP + 1]
  p, s, _ = train("adamw", *checkpoints["as_is"]["raw"], batch)
  q, r = inverse(*train("adamw", *checkpoints["moved"]["raw"], batch)[:2])
  chex.assert_trees_all_close(r, s, rtol=1e-4, atol=1e-8)  # the moments still agree...
  assert distance(q, p) > 100 * TOL  # ...the step does not


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw", "lion"])
def test_standard_optimizers_are_not_equivariant(name):
  tx = optimizer(name)
  params = models.llama_init(3)
  warm = train(name, params, tx.init(params), BATCHES[:10])[:2]
  moved = saggs.reparameterize(*warm, PAIRS, factor_fn)
  chex.assert_trees_all_close(inverse(*moved), warm, rtol=TOL, atol=1e-8)  # same state
  p = train(name, *warm, BATCHES[10:20])[0]
  q = inverse(*train(name, *moved, BATCHES[10:20])[:2])[0]
  assert distance(q, p) > 100 * TOL
