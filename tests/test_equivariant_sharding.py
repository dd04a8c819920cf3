"""The symmetry-compatible stack gives the same update sharded over 8 devices.

XLA fixes the host device count when jax starts, so the check runs in a fresh
interpreter with ``--xla_force_host_platform_device_count=8``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from xla_env import cpu_env

CODE = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from saggs_jax import equivariant as eqv

    assert jax.device_count() == 8, jax.devices()
    rng = np.random.default_rng(0)
    specs = {  # path -> (shape, partition spec): units or heads split over devices
        ("embed", "embedding"): ((16, 8), P("x", None)),
        ("lm_head", "kernel"): ((8, 16), P(None, "x")),
        ("attn", "q_proj", "kernel"): ((8, 16), P(None, "x")),
        ("attn", "o_proj", "kernel"): ((16, 8), P("x", None)),
        ("mlp", "gate_proj", "kernel"): ((8, 16), P(None, "x")),
        ("mlp", "up_proj", "kernel"): ((8, 16), P(None, "x")),
        ("mlp", "down_proj", "kernel"): ((16, 8), P("x", None)),
        ("moe", "router", "kernel"): ((8, 8), P(None, "x")),
        ("moe", "experts", "w"): ((8, 8, 4), P("x", None, None)),
        ("norm", "scale"): ((8,), P("x")),
    }
    def tree(leaf):
        out = {}
        for path, spec in specs.items():
            node = out
            for k in path[:-1]:
                node = node.setdefault(k, {})
            node[path[-1]] = leaf(spec)
        return out
    grads = tree(lambda s: jnp.asarray(rng.normal(size=s[0]), jnp.float32))
    params = tree(lambda s: jnp.asarray(rng.normal(size=s[0]), jnp.float32))
    mesh = Mesh(np.array(jax.devices()), ("x",))
    shardings = tree(lambda s: NamedSharding(mesh, s[1]))

    tx = eqv.symmetry_compatible(0.1, decoder=eqv.Decoder(num_heads=4), weight_decay=0.1,
                                 rules=eqv.RoleRules(router="left_spectral"),
                                 newton_schulz=eqv.NewtonSchulz(dtype=jnp.float32))
    def two_steps(g, p):
        state = tx.init(p)
        u, state = tx.update(g, state, p)
        return tx.update(g, state, p)[0]
    expected = jax.jit(two_steps)(grads, params)
    put = lambda t: jax.tree.map(jax.device_put, t, shardings)
    actual = jax.jit(two_steps, out_shardings=shardings)(put(grads), put(params))
    assert actual["embed"]["embedding"].sharding.spec == P("x", None)
    # Sharded, XLA sums in another order; float32 Newton-Schulz iterations amplify that
    # rounding (to 2e-4 of a leaf's largest entry on jax 0.12 on an Intel Xeon), so the bound
    # is relative to each leaf's scale: a wrong grouping or gather moves entries by that scale.
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
        a, e = np.asarray(a), np.asarray(e)
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-3 * np.abs(e).max(),
                                   err_msg=jax.tree_util.keystr(path))
    print("SHARDED-OK")
""")


def test_sharded_equals_unsharded():
  env = cpu_env(8)
  result = subprocess.run(
    [sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0 and "SHARDED-OK" in result.stdout, result.stderr[-3000:]
