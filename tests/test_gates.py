"""saggs_jax._src.gates.opened: each gate of an update on its open side, everything else as written.

The expected values are computed in NumPy from the definitions: a clip that does not clip
passes its input, an eps next to a norm is dropped, and a test against zero (a sign) is kept.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from saggs_jax._src.gates import opened

G = np.array([3.0, -4.0, 0.5], np.float32)  # norm 5.02: past every threshold below


def run(fn, *args, hot=None):
  """``fn(*args)`` with its gates open, its arguments hot unless ``hot`` says otherwise."""
  closed = jax.make_jaxpr(fn)(*args)
  hot = [True] * len(closed.jaxpr.invars) if hot is None else hot
  return [np.asarray(x) for x in jax.jit(opened(closed, hot))(*args)]


def stateless(tx):
  """``tx``'s updates of hot gradients at cold parameters (entries of size 1)."""
  return lambda g, p: tx.update(g, tx.init(g), p)[0]


@pytest.mark.parametrize(
  "tx",
  [optax.clip_by_global_norm(1.0), optax.clip(0.1), optax.adaptive_grad_clip(0.01)],
  ids=["global_norm", "elementwise", "adaptive"],
)
def test_a_clip_does_not_clip(tx):
  p = np.ones_like(G)
  (got,) = run(stateless(tx), G, p, hot=[True, False])
  np.testing.assert_array_equal(got, G)
  assert not np.allclose(np.asarray(stateless(tx)(G, p)), G)  # as written it clips


def test_an_eps_next_to_a_norm_is_dropped_and_a_test_against_zero_kept():
  def fn(g):
    norm = jnp.maximum(jnp.linalg.norm(g), 1e3)  # a floor far above the norm
    relu = jnp.maximum(g, 0.0)
    positive = jnp.where(g > 0, 1.0, -1.0)
    return g / norm, relu, positive

  got = run(fn, G)
  np.testing.assert_allclose(got[0], G / np.linalg.norm(G), rtol=1e-6)
  np.testing.assert_array_equal(got[1], np.maximum(G, 0))
  np.testing.assert_array_equal(got[2], np.sign(G))


def test_cold_values_compare_as_written():
  """A gate between values that do not depend on the hot inputs runs as written: here the
  parameter is cold, the gradient hot."""

  def fn(g, p):
    return jnp.where(p > 0.5, g, 0.0), jnp.minimum(g, p)

  p = np.array([1.0, 0.0, 1.0], np.float32)
  got = run(fn, G, p, hot=[True, False])
  np.testing.assert_array_equal(got[0], np.where(p > 0.5, G, 0))
  np.testing.assert_array_equal(got[1], G)  # min(hot, cold) passes the hot value


def test_gates_inside_a_cond_branch_are_opened():
  def fn(g, i):
    return jax.lax.cond(i > 0, lambda g: jnp.clip(g, -0.1, 0.1), lambda g: -g, g)

  np.testing.assert_array_equal(run(fn, G, np.int32(1), hot=[True, False])[0], G)
  np.testing.assert_array_equal(run(fn, G, np.int32(0), hot=[True, False])[0], -G)
