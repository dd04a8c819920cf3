"""One process of the multi-process training test (``tests/test_multiprocess.py``).

Run as ``python multiprocess_worker.py ROLE PROCESS_ID NUM_PROCESSES PORT DIR``
with ``JAX_PLATFORMS=cpu`` and ``--xla_force_host_platform_device_count`` in
``XLA_FLAGS``, so that the job has 8 devices in all. Every process shards the
tiny LLaMA of ``models.py`` FSDP-style (first axis) over all devices of all
processes and trains it with ``saggs.chain(optax.adamw(...), saggs.saggs(pairs))``:

* ``train``: trains ``BEFORE`` steps, then saves the state with
  ``saggs.checkpoint`` to ``DIR/plain`` and a reciprocally rescaled equivalent
  of it to ``DIR/rescaled``;
* ``resume``: restores each checkpoint (canonicalized) into a fresh, different
  state, trains ``AFTER`` more steps and writes the final params to
  ``DIR/<variant>.npz``;
* ``reference``: the same trajectory in one process, canonicalizing in memory
  instead of checkpointing: ``DIR/reference.npz``;
* ``every``: ``saggs.saggs(pairs, every=2)`` in a jitted full step (``jax.grad``
  of the loss, ``tx.update``, ``optax.apply_updates``) under ``jax.set_mesh``,
  on an Auto and an Explicit mesh, from an eager ``tx.init``: the skipped
  updates run the gradient's collectives next to a ``lax.cond`` branch that
  communicates nothing. Writes the final params and which updates balanced to
  ``DIR/every-<Auto|Explicit>.npz``; process 0 then writes those of the same
  run on one of its devices, without a mesh, to ``DIR/every-oracle.npz``;
* ``order``: the 2-process setup that once aborted in gloo: ``head_axis_llama.py``,
  FSDP on each leaf's first axis that divides over the devices, an eager ``tx.init``,
  each process making its batch with eager JAX ops, a jitted full step under
  ``jax.set_mesh`` on an Auto mesh, for each optimizer of ``_order_variants``: writes
  ``DIR/order-<name>.npz``, and process 0 the same run on one device to
  ``DIR/order-<name>-oracle.npz``.

With NUM_PROCESSES > 1 the process first joins a ``jax.distributed`` job on
``localhost:PORT`` with gloo CPU collectives. It exits with a traceback of
every thread after ``WORKER_TIMEOUT`` seconds (JAX catches SIGTERM). Importing
this module does nothing: pytest imports it to look for doctests.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import pathlib
import sys
import time

BEFORE, AFTER = 5, 4
LEARNING_RATE, WEIGHT_DECAY, EVERY = 3e-2, 0.1, 3
SKIPPING_STEPS, SKIPPING_EVERY = 4, 2  # role "every": updates 1 and 3 balance, 2 and 4 skip
ORDER_STEPS = 4  # role "order"


def _order_variants():
  """Role ``order``'s optimizers by name: skipped updates (hard, soft) and every update."""
  import optax

  import head_axis_llama as m
  import saggs_jax as saggs

  pairs = [saggs.Pair(a, b, axes=axes, groups=g) for a, b, axes, g in m.PAIRS]
  adamw = functools.partial(optax.adamw, 1e-2, weight_decay=0.1)
  return {
    "every2": lambda: saggs.chain(adamw(), saggs.saggs(pairs, every=2)),
    "soft2": lambda: saggs.chain(adamw(), saggs.soft(pairs, every=2)),
    "every1": lambda: saggs.chain(adamw(), saggs.saggs(pairs)),
  }


def order_start():
  """Role ``order``'s initial parameters (NumPy), Q and K reciprocally scaled by 4."""
  import jax
  import numpy as np

  import head_axis_llama as m

  params = jax.tree.map(np.asarray, m.init(jax.random.PRNGKey(0)))
  for layer in params["layers"].values():
    layer["attn"]["wq"], layer["attn"]["wk"] = layer["attn"]["wq"] * 4, layer["attn"]["wk"] / 4
  return params


_START = time.monotonic()


def log(message: str):
  print(f"[{time.monotonic() - _START:6.1f}s] {message}", flush=True)


def main(role: str, process_id: int, num_processes: int, port: int, directory: str):
  import jax

  if num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      coordinator_address=f"localhost:{port}",
      num_processes=num_processes,
      process_id=process_id,
      initialization_timeout=60,
      heartbeat_timeout_seconds=30,
    )
  jax.config.update("jax_default_matmul_precision", "highest")
  assert jax.device_count() == 8, jax.devices()
  log(
    f"{role}: process {jax.process_index()} of {jax.process_count()}, "
    f"{jax.local_device_count()} local devices"
  )

  import numpy as np
  import optax
  import orbax.checkpoint as ocp
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import models
  import saggs_jax as saggs

  directory = pathlib.Path(directory)
  pairs = models.llama_pairs()
  tx = saggs.chain(
    optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY), saggs.saggs(pairs, every=EVERY)
  )
  batches = np.asarray(models.batches(0, BEFORE + AFTER))
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))

  def sharding(shape, mesh=mesh):
    """FSDP: the first axis split over all devices where it divides evenly, else replicated."""
    return NamedSharding(mesh, P("fsdp") if shape and shape[0] % mesh.size == 0 else P())

  def global_array(x, mesh=mesh):
    """A global array of the host value ``x``, which every process holds in full."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding(x.shape, mesh), lambda index: x[index])

  def host(tree):
    """The full values of a tree of arrays, as NumPy, on every process (local arrays are)."""
    if all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
      return jax.tree.map(np.asarray, tree)
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))

  def step(params, state, batch):
    grads = jax.grad(models.llama_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  # Output shardings are explicit: tx.init's outputs do not depend on its
  # inputs and would otherwise land on one device of one process.
  params_shardings = jax.tree.map(lambda x: sharding(x.shape), models.llama_init(0))
  state_shardings = jax.tree.map(
    lambda x: sharding(x.shape), jax.eval_shape(tx.init, models.llama_init(0))
  )
  init = jax.jit(tx.init, out_shardings=state_shardings)
  train_step = jax.jit(step, out_shardings=(params_shardings, state_shardings))

  def train(params, state, first, count):
    for i in range(first, first + count):
      params, state = train_step(params, state, global_array(batches[i]))
    log(f"trained steps {first + 1}..{first + count}")
    return params, state

  def save_npz(name, params, **extra):
    flat = {p: np.asarray(x) for p, x in saggs._src.paths.leaves_with_paths(host(params))}
    if jax.process_index() == 0:
      np.savez(directory / f"{name}.npz", **flat, **extra)

  def skipping_run(loss, params, batch_of):
    """SKIPPING_STEPS jitted full steps of ``every=SKIPPING_EVERY`` SAGGS from an eager
    init: the final params and, per update, whether it balanced (some factor is not 1)."""
    tx = saggs.chain(
      optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY),
      saggs.saggs(pairs, every=SKIPPING_EVERY),
    )

    traces = []

    @jax.jit
    def full_step(params, state, batch):
      traces.append(None)
      updates, state = tx.update(jax.grad(loss)(params, batch), state, params)
      return optax.apply_updates(params, updates), state

    state, balanced = tx.init(params), []
    for i in range(SKIPPING_STEPS):
      params, state = full_step(params, state, batch_of(batches[i]))
      factors = jax.tree.leaves(state[-1].factors)  # replicated: each device holds them whole
      balanced.append(any(np.any(np.asarray(f.addressable_data(0)) != 1) for f in factors))
    assert len(traces) == 1, f"the step was traced {len(traces)} times"
    return params, balanced

  def rescale(path_a, shape):  # log-uniform factors in [1/8, 8], a pure function of the path
    rng = np.random.default_rng([len(path_a), sum(map(ord, path_a))])
    return np.exp(rng.uniform(-np.log(8), np.log(8), shape)).astype(np.float32)

  if role == "train":
    params = jax.tree.map(global_array, models.llama_init(0))
    params, state = train(params, init(params), 0, BEFORE)
    # The checksums of sharded arrays are those of their gathered values.
    assert saggs._src.checkpoint.checksums((params, state)) == saggs._src.checkpoint.checksums(
      host((params, state))
    )
    moved = jax.jit(lambda p, s: saggs.reparameterize(p, s, pairs, rescale))(params, state)
    assert not np.allclose(
      *host(
        (
          moved[0]["layers"]["0"]["mlp"]["up_proj"]["kernel"],
          params["layers"]["0"]["mlp"]["up_proj"]["kernel"],
        )
      )
    )
    for variant, state_to_save in (("plain", (params, state)), ("rescaled", moved)):
      manager = ocp.CheckpointManager(directory / variant)
      assert saggs.checkpoint.save(manager, BEFORE, *state_to_save)
      manager.wait_until_finished()
      manager.close()
      log(f"saved {variant}")
  elif role == "resume":
    fresh = jax.tree.map(global_array, models.llama_init(1))  # another state, same layout
    for variant in ("plain", "rescaled"):
      manager = ocp.CheckpointManager(directory / variant)
      params, state, step_number = saggs.checkpoint.restore(
        manager, fresh, init(fresh), pairs, tx=tx
      )
      manager.close()
      log(f"restored {variant}")
      assert step_number == BEFORE, step_number
      assert jax.tree.map(lambda x: x.sharding, params) == params_shardings
      save_npz(variant, train(params, state, BEFORE, AFTER)[0])
  elif role == "reference":
    params = jax.tree.map(global_array, models.llama_init(0))
    params, state = train(params, init(params), 0, BEFORE)
    params, state = jax.jit(lambda p, s: saggs.canonicalize(p, s, pairs))(params, state)
    save_npz("reference", train(params, state, BEFORE, AFTER)[0])
  elif role == "every":
    for kind in ("Auto", "Explicit"):
      kind_mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(getattr(jax.sharding.AxisType, kind),))
      with jax.set_mesh(kind_mesh):
        if kind == "Auto":  # GSPMD shards the batch and the gradient's collectives
          loss = models.llama_loss
        else:  # FSDP spelled out: gather the params, every device runs the whole batch
          loss = lambda p, b: models.llama_loss(
            jax.sharding.reshard(p, P()),  # noqa: E731
            jax.sharding.reshard(b, P()),
          )
        params, balanced = skipping_run(
          loss,
          jax.tree.map(lambda x, m=kind_mesh: global_array(x, m), models.llama_init(0)),
          lambda b, m=kind_mesh: global_array(b, m),
        )
        save_npz(f"every-{kind}", params, balanced=np.array(balanced))
      log(f"{kind}: {SKIPPING_STEPS} full steps, balanced {balanced}")
    if jax.process_index() == 0:
      local = functools.partial(jax.device_put, device=jax.local_devices()[0])
      params, balanced = skipping_run(models.llama_loss, local(models.llama_init(0)), local)
      save_npz("every-oracle", params, balanced=np.array(balanced))
  elif role == "order":
    import head_axis_llama as m

    order_mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

    def fsdp(x):  # on the first axis that divides over the devices
      axis = next((a for a, n in enumerate(x.shape) if n % 8 == 0), None)
      spec = P() if axis is None else P(*[None] * axis, "x")
      return jax.make_array_from_callback(
        x.shape, NamedSharding(order_mesh, spec), lambda index: x[index]
      )

    def ordered_run(make_tx, params):
      """ORDER_STEPS jitted full steps from an eager init, each process making its batch
      with eager JAX ops."""
      tx = make_tx()

      @jax.jit
      def full_step(params, state, tokens):
        updates, state = tx.update(jax.grad(m.loss)(params, tokens), state, params)
        return optax.apply_updates(params, updates), state

      state = tx.init(params)
      for i in range(ORDER_STEPS):
        params, state = full_step(params, state, m.batch(jax.random.PRNGKey(100 + i)))
      return params

    for name, make_tx in _order_variants().items():
      with jax.set_mesh(order_mesh):
        params = ordered_run(make_tx, jax.tree.map(fsdp, order_start()))
      save_npz(f"order-{name}", params)
      log(f"order: {name}")
      if jax.process_index() == 0:
        local = jax.device_put(order_start(), jax.local_devices()[0])
        save_npz(f"order-{name}-oracle", ordered_run(make_tx, local))
  else:
    raise ValueError(f"Unknown role {role!r}: expected train, resume, reference, every or order.")
  log("done")


if __name__ == "__main__":
  faulthandler.dump_traceback_later(float(os.environ.get("WORKER_TIMEOUT", 120)), exit=True)
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # models.py
  sys.path.insert(1, str(pathlib.Path(__file__).resolve().parents[1]))  # saggs_jax
  role, process_id, num_processes, port, directory = sys.argv[1:]
  main(role, int(process_id), int(num_processes), int(port), directory)
