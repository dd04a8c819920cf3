"""Where collectives inside control flow may be overtaken (XLA:CPU across processes, see
:func:`saggs_jax._src.numerics.ordered_control_flow`), SAGGS puts no collective inside a
``lax.cond`` or a loop: skipped updates select the ones, and the norms' scale-safe
fallback recomputes every piece. The results equal those of the ``lax.cond`` path.

The multi-process run itself is in ``tests/test_multiprocess.py`` (heavy); here the
switch is forced off in one process.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import saggs_jax as saggs
from saggs_jax._src import norms, transform

# A cycle of pairs (every leaf in two: two-pass statistics, the fallback a switch over its
# pieces), and c's tiny entries underflow float32's fast sum of squares: the scale-safe
# fallback recomputes its piece.
PAIRS = tuple(saggs.Pair(x, y, axes=(1, 0)) for x, y in ("ab", "bc", "ca"))
rng = np.random.default_rng(0)
PARAMS = {
  "a": jnp.asarray(rng.standard_normal((3, 4)) * 4, jnp.float32),
  "b": jnp.asarray(rng.standard_normal((4, 4)), jnp.float32),
  "c": jnp.asarray(rng.standard_normal((4, 3)) * 1e-22, jnp.float32),
}
GRADS = [
  jax.tree.map(lambda x, s=s: jnp.asarray(np.cos(s + np.asarray(x)), x.dtype), PARAMS)
  for s in range(3)
]


def run(every, mesh=True):
  """Three updates under jit; on a (one-device) mesh the overlapping pieces take a first
  pass and the recompute under control flow, as on a pod; off it, the safe passes alone."""
  tx = saggs.chain(optax.adam(1e-2), saggs.saggs(PAIRS, every=every))
  with jax.set_mesh(jax.make_mesh((1,), ("d",))) if mesh else contextlib.nullcontext():
    step = jax.jit(tx.update)
    params, state = PARAMS, tx.init(PARAMS)
    for g in GRADS:
      updates, state = step(g, state, params)
      params = optax.apply_updates(params, updates)
    return params, str(jax.make_jaxpr(tx.update)(GRADS[0], tx.init(PARAMS), PARAMS))


@pytest.mark.parametrize("every", [1, 2])
def test_no_collective_in_control_flow_gives_the_same_updates(monkeypatch, every):
  want, ordered = run(every)
  off_mesh, _ = run(every, mesh=False)
  monkeypatch.setattr(transform, "ordered_control_flow", lambda: False)
  monkeypatch.setattr(norms, "ordered_control_flow", lambda: False)
  got, unordered = run(every)
  # The lax.cond path has the skip's cond (every=2) and the recompute's loop over a switch
  # (a cond of several branches); the joint solve's loop, on reduced statistics, is in both.
  assert " cond[" in ordered
  assert " cond[" not in unordered
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=0, err_msg=k)
    # Off the mesh the sums are taken in another order (the scale-safe pass): a few ulp.
    np.testing.assert_allclose(off_mesh[k], want[k], rtol=1e-5, atol=0, err_msg=f"{k} off mesh")
  assert not np.allclose(want["c"], PARAMS["c"], rtol=1e-3)  # it balanced
