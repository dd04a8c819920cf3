"""SAGGS under jit with parameters sharded over 8 (virtual CPU) devices.

XLA_FLAGS must be set before JAX starts, and the rest of the suite runs in
this process with one device, so the check runs in a subprocess that asserts
and exits non-zero on any mismatch.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

TESTS = pathlib.Path(__file__).resolve().parent

SCRIPT = textwrap.dedent(r"""
    import sys
    sys.path[:0] = [TESTS, ROOT]
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import models
    import saggs_jax as saggs

    C = models.CONFIG
    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.AXIS_TYPE,))

    # Column-parallel q/k/v/gate/up (heads and hidden channels split over
    # devices), row-parallel o/down, everything else replicated. The tree holds
    # one per-layer block ("layers/0/...") and a scanned stack ("scanned/...",
    # a leading layer axis), so one compiled step covers both layouts.
    COL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    ROW = ("o_proj", "down_proj")

    def spec(path):
      lead = (None,) if path.startswith("scanned/") else ()
      if any(f"/{m}/" in path for m in COL):
        return P(*lead, None, "model")
      if any(f"/{m}/" in path for m in ROW):
        return P(*lead, "model", None)
      return P()

    def shardings(tree):
      return jax.tree_util.tree_map_with_path(
          lambda kp, x: NamedSharding(mesh, spec(jax.tree_util.keystr(kp, simple=True, separator="/"))),
          tree)

    def imbalance_by_hand(layer, lead, rng):
      # An exact reparameterisation done in NumPy: Q*c/K/c per KV head, V*c/O/c, up*c/down/c.
      a, m = layer["attn"], layer["mlp"]
      rep = lambda c, n: np.repeat(c, n, axis=-1)[..., None, :]
      per_kv = C.num_heads * C.head_dim // C.num_kv_heads
      c = np.exp(rng.uniform(-2, 2, lead + (C.num_kv_heads,)))
      a["q_proj"]["kernel"] = a["q_proj"]["kernel"] * rep(c, per_kv)
      a["k_proj"]["kernel"] = a["k_proj"]["kernel"] / rep(c, C.head_dim)
      c = np.exp(rng.uniform(-2, 2, lead + (C.num_kv_heads,)))
      a["v_proj"]["kernel"] = a["v_proj"]["kernel"] * rep(c, C.head_dim)
      a["o_proj"]["kernel"] = a["o_proj"]["kernel"] / np.swapaxes(rep(c, per_kv), -1, -2)
      c = np.exp(rng.uniform(-2, 2, lead + (C.mlp_hidden,)))
      m["up_proj"]["kernel"] = m["up_proj"]["kernel"] * c[..., None, :]
      m["down_proj"]["kernel"] = m["down_proj"]["kernel"] / c[..., :, None]
      return layer

    failures = []

    def check(cond, msg):
      if not cond:
        failures.append(msg)
        print("FAIL:", msg, file=sys.stderr)

    rng = np.random.default_rng(1)
    flat = jax.tree.map(np.asarray, models.llama_init(0))
    stack = jax.tree.map(np.asarray, models.llama_init(1, models.STACKED))
    params = {
        "layers": {"0": imbalance_by_hand(flat["layers"]["0"], (), rng)},
        "scanned": imbalance_by_hand(stack["layers"], (C.num_layers,), rng),
        "final_norm": flat["final_norm"],
    }
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    pairs = (saggs.presets.llama(num_kv_heads=C.num_kv_heads, prefix="layers/**")
             + saggs.presets.llama(num_kv_heads=C.num_kv_heads, stacked=1, prefix="scanned/**"))
    grads = [models.random_like(params, seed) for seed in (2, 3)]
    p_sh = shardings(params)
    sharded = jax.device_put(params, p_sh)
    n_split = sum(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
                  for x in jax.tree.leaves(sharded))
    check(n_split == 14, f"{n_split} leaves split over devices")

    # Eager SAGGS balances after updates 1 and 2 (every=1) or 2 only (every=2, through the
    # lax.cond); deferred balances at the start of update 2.
    for every, deferred in ((1, False), (2, False), (1, True)):
      tx = saggs.chain(optax.adam(1e-2), saggs.saggs(pairs, every=every, deferred=deferred))

      @jax.jit
      def train_step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

      def run(params, grads):
        state = tx.init(params)
        for g in grads:
          params, state = train_step(params, state, g)
        return params, state

      ref_params, ref_state = run(params, grads)
      with jax.set_mesh(mesh):
        new_params, new_state = run(sharded, [jax.device_put(g, p_sh) for g in grads])

      # Same numbers as unsharded.
      for (kp, a), b in zip(jax.tree_util.tree_leaves_with_path(new_params),
                             jax.tree.leaves(ref_params)):
        check(np.allclose(a, b, rtol=2e-5, atol=2e-6),
              f"every={every} deferred={deferred} params{jax.tree_util.keystr(kp)}: max diff"
              f" {np.max(np.abs(np.asarray(a) - np.asarray(b)))}")
      for (kp, a), b in zip(jax.tree_util.tree_leaves_with_path(new_state),
                             jax.tree.leaves(ref_state)):
        check(np.allclose(a, b, rtol=2e-5, atol=1e-7 * np.max(np.abs(b))),
              f"every={every} deferred={deferred} state{jax.tree_util.keystr(kp)}: max diff"
              f" {np.max(np.abs(np.asarray(a) - np.asarray(b)))} of {np.max(np.abs(b))}")
      # Output shardings are the input shardings: params, and Adam's moments of each param.
      adam = new_state[0][0]
      for name, tree in (("params", new_params), ("mu", adam.mu), ("nu", adam.nu)):
        for (kp, x), want in zip(jax.tree_util.tree_leaves_with_path(tree),
                                 jax.tree.leaves(p_sh)):
          check(x.sharding.is_equivalent_to(want, x.ndim),
                f"every={every} deferred={deferred} {name}{jax.tree_util.keystr(kp)}: sharding"
                f" {x.sharding.spec} != {want.spec}")
      # Balanced after the step (eager); factors per group, (layers, groups) for the stack.
      imb = saggs.imbalance(ref_params, pairs)
      check(deferred or all(float(np.max(np.abs(v))) < 1e-4 for v in imb.values()),
            f"imbalance {imb}")
      check(not deferred or any(float(np.max(np.abs(np.log(f)))) > 0.1
                                for f in new_state[1].factors.values()),
            "deferred: the second update did not balance")
      shapes = {k: v.shape for k, v in new_state[1].factors.items()}
      L, G, F = C.num_layers, C.num_kv_heads, C.mlp_hidden
      want = {"layers/0/attn/q_proj/kernel|layers/0/attn/k_proj/kernel": (G,),
              "layers/0/attn/v_proj/kernel|layers/0/attn/o_proj/kernel": (G,),
              "layers/0/mlp/up_proj/kernel|layers/0/mlp/down_proj/kernel": (F,),
              "scanned/attn/q_proj/kernel|scanned/attn/k_proj/kernel": (L, G),
              "scanned/attn/v_proj/kernel|scanned/attn/o_proj/kernel": (L, G),
              "scanned/mlp/up_proj/kernel|scanned/mlp/down_proj/kernel": (L, F)}
      check(shapes == want, f"factor shapes {shapes}")

    if failures:
      sys.exit(f"{len(failures)} sharding check(s) failed")
    print("sharding OK")
""")


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_sharded_equals_unsharded_and_keeps_shardings(axis_type):
  script = (SCRIPT.replace("TESTS", repr(str(TESTS))).replace("ROOT", repr(str(TESTS.parent)))
            .replace("AXIS_TYPE", axis_type))
  # The optimisation level only changes how hard LLVM works on the CPU code
  # (compile time), not what is computed or how it is partitioned.
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"}
  proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode == 0, f"sharded check failed:\n{proc.stderr[-6000:]}\n{proc.stdout[-2000:]}"
  assert "sharding OK" in proc.stdout
