"""Saving training states with Orbax and restoring them onto the canonical orbit member.

Two checkpoints that are equivalent (same function, moments transported)
restart AdamW onto different trajectories. :func:`restore` with ``pairs``
canonicalizes the restored state (:func:`saggs_jax.canonicalize`), so runs
restarted from either follow the same trajectory.

:func:`save` writes two items: ``state`` (the params and the optimizer state,
SAGGS stage state included) and ``layout``, a small JSON record of every leaf's
path, shape and dtype. :func:`restore` reads ``layout`` first and compares it
with the target, so a checkpoint made with other pairs or another optimizer
chain fails with the first mismatching path before any array is read: neither
the files nor the caller's state are touched. Use a manager dedicated to these
two functions (the items are fixed).

Example::

  >>> import tempfile, jax.numpy as jnp, optax, orbax.checkpoint as ocp
  >>> import saggs_jax as saggs
  >>> pairs = [saggs.Pair("up", "down", axes=(1, 0))]
  >>> params = {"up": jnp.full((3, 4), 4.0), "down": jnp.ones((4, 3))}
  >>> tx = saggs.chain(optax.adamw(1e-3), saggs.saggs(pairs, every=100))
  >>> opt_state = tx.init(params)
  >>> manager = ocp.CheckpointManager(tempfile.mkdtemp())
  >>> saggs.checkpoint.save(manager, 7, params, opt_state)
  True
  >>> params, opt_state, step = saggs.checkpoint.restore(manager, params, opt_state, pairs)
  >>> float(params["up"][0, 0]), float(params["down"][0, 0]), step
  (2.0, 2.0, 7)
  >>> manager.close()
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from saggs_jax import canonical, paths
from saggs_jax.pairs import Pair, resolve

Layout = dict[str, list]  # path -> [shape, dtype name]


def layout(tree: Any) -> Layout:
  """``{path: [shape, dtype]}`` for every leaf of ``tree``, in flatten order (JSON-ready)."""
  return {path: [list(np.shape(leaf)), np.dtype(leaf.dtype).name]
          for path, leaf in paths.leaves_with_paths(tree)}


def check_layout(saved: Layout, target: Any, what: str = "The checkpoint") -> None:
  """Raises ValueError naming the first path where ``saved`` and ``target``'s layout differ.

  Target leaves are compared in flatten order, then leaves only ``saved`` has.

  Example::

    >>> import jax.numpy as jnp, saggs_jax as saggs
    >>> saved = saggs.checkpoint.layout({"w": jnp.ones((2, 3))})
    >>> saggs.checkpoint.check_layout(saved, {"w": jnp.ones((2, 4))})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: The checkpoint does not fit the target at 'w': float32[2, 3] there, the target float32[2, 4]. ...
  """
  def fmt(entry):
    return f"{entry[1]}{entry[0]}" if entry else "nothing"

  expected = layout(target)
  differing = [p for p in expected if saved.get(p) != expected[p]]
  differing += [p for p in saved if p not in expected]
  if differing:
    first = differing[0]
    raise ValueError(
        f"{what} does not fit the target at {first!r}: {fmt(saved.get(first))} there, the"
        f" target {fmt(expected.get(first))}. Was it saved with other pairs or another optimizer"
        " chain? Nothing was restored.")


def save(manager: ocp.CheckpointManager, step: int, params: Any, opt_state: Any) -> bool:
  """Saves ``params`` and ``opt_state`` as checkpoint ``step``.

  Saving is asynchronous, as with ``manager.save``: call
  ``manager.wait_until_finished()`` before the process exits (:func:`restore`
  waits by itself).

  Returns:
    Whether a checkpoint was written (the manager's ``save_interval_steps``
    and similar options may skip a step).
  """
  state = {"params": params, "opt_state": opt_state}
  return manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), layout=ocp.args.JsonSave(layout(state))))


def restore(manager: ocp.CheckpointManager, params: Any, opt_state: Any,
            pairs: Sequence[Pair] | None = None, step: int | None = None,
            canonicalize: bool = True) -> tuple[Any, Any, int]:
  """Restores a checkpoint written by :func:`save`, in the structure of the target.

  Args:
    manager: the ``orbax.checkpoint.CheckpointManager`` it was saved with.
    params, opt_state: the target: any state with the same tree structure,
      shapes and dtypes (a fresh ``tx.init``, or an equivalent but different
      state); its arrays' shardings are kept. It is not modified.
    pairs: the :class:`~saggs_jax.Pair` declarations; with ``canonicalize``,
      the restored state is mapped to its canonical (norm-balanced) form.
    step: the step to restore; default the latest.
    canonicalize: canonicalize when ``pairs`` is given.

  Returns:
    ``(params, opt_state, step)``.

  Raises:
    FileNotFoundError: the manager holds no checkpoint.
    ValueError: the checkpoint's layout differs from the target's (the
      message names the first differing path), or ``pairs`` do not resolve
      on ``params``. Raised before any array is read.
  """
  manager.wait_until_finished()  # a save still in flight is not readable yet
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"No checkpoint in {manager.directory}.")
  canonicalize = canonicalize and pairs is not None
  if canonicalize:
    resolve(pairs, params)  # a bad declaration fails before anything is read
  target = {"params": params, "opt_state": opt_state}
  saved = manager.restore(step, args=ocp.args.Composite(layout=ocp.args.JsonRestore()))
  check_layout(saved["layout"], target, f"Checkpoint {step} in {manager.directory}")
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
  state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
  params, opt_state = state["state"]["params"], state["state"]["opt_state"]
  if canonicalize:
    params, opt_state = canonical.canonicalize(params, opt_state, pairs)
  return params, opt_state, step
