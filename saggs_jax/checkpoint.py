"""Saving training states with Orbax and restoring them onto the canonical orbit member.

Two equivalent checkpoints (same function, moments transported) restart AdamW onto
different trajectories. :func:`restore` with ``pairs`` canonicalizes the restored state, so
runs restarted from either follow one trajectory; each moment moves by the degree measured
on the optimizer that made it (``tx=``). :func:`save` writes the state, its ``layout`` and
``checksums`` (and, given ``tx=``, the degrees), and :func:`restore` checks each before it
returns; a failed restore touches neither the files nor the caller's state
(docs/checkpoints.md).

Example:
  >>> import tempfile, jax.numpy as jnp, optax, orbax.checkpoint as ocp
  >>> import saggs_jax as saggs
  >>> pairs = [saggs.Pair("up", "down", axes=(1, 0))]
  >>> params = {"up": jnp.full((3, 4), 4.0), "down": jnp.ones((4, 3))}
  >>> tx = saggs.chain(optax.adamw(1e-3), saggs.saggs(pairs, every=100))
  >>> opt_state = tx.init(params)
  >>> manager = ocp.CheckpointManager(tempfile.mkdtemp())
  >>> saggs.checkpoint.save(manager, 7, params, opt_state)
  True
  >>> params, opt_state, step = saggs.checkpoint.restore(manager, params, opt_state, pairs, tx=tx)
  >>> float(params["up"][0, 0]), float(params["down"][0, 0]), step
  (2.0, 2.0, 7)
  >>> manager.close()
"""

from saggs_jax._src.checkpoint import (
  check_layout,
  restore,
  save,
)
from saggs_jax._src.paths import layout

__all__ = ["check_layout", "layout", "restore", "save"]
