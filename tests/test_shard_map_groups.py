"""GQA groups inside ``shard_map`` on 8 (virtual CPU) devices: balanced across shards
when every shard holds a slice of every group, refused when the shards split the groups.

``Pair("q", "k", axes=(1, 1), groups=2)`` on (8, 16) leaves: two groups of 8 columns.
Split by rows, each group's norm is the psum of its 8 shards' partial norms; split by
columns (``P(None, "m")``), each group spans 4 shards of 2 columns, which a device cannot
tell from its own (8, 2) shard: it would balance each column pair as 2 groups and the psum
would add columns of both groups. The global shapes travel in the state, so a state made by
another instance of the optimizer (a restored one) is checked alike. XLA fixes the device
count when JAX starts, so the checks run in a fresh interpreter.
"""

import subprocess
import sys
import textwrap

from xla_env import cpu_env

SCRIPT = textwrap.dedent(r"""
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import saggs_jax as saggs
    from saggs_jax._src.shard_map_groups import SHARD_MAP_SHAPES_MSG, SHARD_MAP_SPLITS_MSG

    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((8,), ("m",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    scale = np.repeat([4.0, 0.5], 8)  # group 0 of q far above k, group 1 below
    params = {"q": (rng.standard_normal((8, 16)) * scale).astype(np.float32),
              "k": rng.standard_normal((8, 16)).astype(np.float32)}
    pairs = [saggs.Pair("q", "k", axes=(1, 1), groups=2)]

    def make():
      return saggs.chain(optax.sgd(0.0), saggs.saggs(pairs, axis_name="m"))

    def balance(spec, init_outside, restored=False):  # a fresh optimizer for each run
      tx = make()
      specs = {"q": spec, "k": spec}
      put = {k: jax.device_put(v, NamedSharding(mesh, spec)) for k, v in params.items()}

      def step(p, state=None):
        state = tx.init(p) if state is None else state
        return optax.apply_updates(p, tx.update(p, state, p)[0])

      if init_outside:
        state = jax.jit((make() if restored else tx).init)(put)  # restored: another's state
        state_specs = jax.tree.map(lambda x: P(*[None] * x.ndim), state)
        fn = jax.shard_map(step, mesh=mesh, in_specs=(specs, state_specs), out_specs=specs)
        return jax.jit(fn)(put, state)
      return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs,), out_specs=specs))(put)

    # Oracle (NumPy, float64): c_g = sqrt(||k_g|| / ||q_g||), q_g * c_g, k_g / c_g.
    q, k = (params[n].astype(np.float64).reshape(8, 2, 8) for n in ("q", "k"))
    c = np.sqrt(np.linalg.norm(k, axis=(0, 2)) / np.linalg.norm(q, axis=(0, 2)))[None, :, None]
    want = {"q": (q * c).reshape(8, 16), "k": (k / c).reshape(8, 16)}
    got = balance(P("m", None), init_outside=True)
    for n in want:
      np.testing.assert_allclose(np.asarray(got[n]), want[n], rtol=1e-5, err_msg=n)
    print("ROWS OK")

    # The whole message, as the constants word it: 'q' is the first leaf the pair groups.
    named = dict(pair=pairs[0].label, groups=2, axis=1, path="q")
    splits = SHARD_MAP_SPLITS_MSG.format(**named, size=16, local=2)
    shapes = SHARD_MAP_SHAPES_MSG.format(**named, axis_name="m")
    for init_outside, restored, says in (
      (True, False, splits),
      (True, True, splits),
      (False, False, shapes),
    ):
      what = f"COLUMNS init_outside={init_outside} restored={restored}"
      try:
        balance(P(None, "m"), init_outside, restored)
        print(f"{what}: balanced silently")
      except ValueError as e:
        ok = str(e) == says
        print(f"{what}: {'refused' if ok else e}")
""")


def test_gqa_groups_inside_shard_map_balance_across_shards_or_are_refused():
  result = subprocess.run(
    [sys.executable, "-c", SCRIPT], env=cpu_env(8), capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0, result.stderr[-4000:]
  assert result.stdout.splitlines() == [
    "ROWS OK",
    "COLUMNS init_outside=True restored=False: refused",
    "COLUMNS init_outside=True restored=True: refused",
    "COLUMNS init_outside=False restored=False: refused",
  ], result.stdout
