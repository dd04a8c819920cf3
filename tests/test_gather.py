"""saggs_jax._src.equivariant.gather: which mesh axes carry the batch of matrices, the mesh read
off the arrays' types when the context has none, and whole matrices per device by one
all-to-all (a stack) or one all-gather (a single matrix) with the local result unchanged. The
stack's update sharded against unsharded: tests/test_equivariant_sharding.py.

XLA fixes the host device count when jax starts, so the checks run in a fresh interpreter
with 4 CPU devices.
"""

import subprocess
import sys
import textwrap

from xla_env import cpu_env

CODE = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from saggs_jax._src.equivariant import gather

    def axes_in(mesh, spec, contextual=True):
        x = jnp.ones((4, 4))
        def probe(x):
            with gather.on_mesh([x]):
                return gather.spread_axes([x])
        found = []
        def f(x):
            found.append(probe(x))
            return x
        placed = jax.device_put(x, NamedSharding(mesh, spec))
        if contextual:
            with jax.set_mesh(mesh):
                jax.jit(f)(placed)
        else:
            jax.jit(f)(placed)
        return found[0]

    auto = jax.make_mesh((4, 1), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    explicit = jax.make_mesh((2, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    assert gather.spread_axes([jnp.ones(3)]) == ()  # no mesh: nothing moves
    assert axes_in(auto, P()) == ("x",)  # Auto: every axis of size > 1
    assert axes_in(explicit, P("y", None)) == ("y",)  # Explicit: those that shard a leaf
    assert axes_in(auto, P("x", None), contextual=False) == ("x",)  # the mesh of the type

    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
    direction = lambda m: m @ jnp.swapaxes(m, -1, -2) @ m  # needs whole matrices
    rng = np.random.default_rng(0)
    for count, collective in ((8, "all-to-all"), (1, "all-gather"), (6, "all-to-all")):
        x = jnp.asarray(rng.standard_normal((count, 8, 3)), jnp.float32)
        rows = jax.device_put(x, NamedSharding(mesh, P(None, "x", None)))
        f = jax.jit(lambda x: gather.locally(direction, x, ("x",)))
        with jax.set_mesh(mesh):
            got = f(rows)
            hlo = f.lower(rows).compile().as_text()
        np.testing.assert_allclose(np.asarray(got), np.asarray(direction(x)), rtol=1e-5, atol=1e-6)
        assert collective in hlo, (count, collective)
        assert count > 1 or "all-to-all" not in hlo  # one matrix: gathered, not moved twice
    np.testing.assert_array_equal(gather.locally(direction, x, ()), direction(x))  # no axes
    print("GATHER-OK")
""")


def test_whole_matrices_per_device_and_the_axes_that_carry_them():
  result = subprocess.run(
    [sys.executable, "-c", CODE], env=cpu_env(4), capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0 and "GATHER-OK" in result.stdout, result.stderr[-3000:]
