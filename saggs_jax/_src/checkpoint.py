"""Orbax save and restore of training states; restore lands on the canonical orbit member.

The public functions are re-exported by :mod:`saggs_jax.checkpoint`; docs/checkpoints.md
explains the items a checkpoint holds, the checksums and the compile overlap.
"""

from __future__ import annotations

import concurrent.futures
import functools
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from saggs_jax._src import canonical, paths
from saggs_jax._src.checksums import (
  ANOTHER_STEP,
  checksums,
  hashers,
  is_key,
  verify,
)
from saggs_jax._src.pairs import Pair, as_pairs
from saggs_jax._src.paths import Layout, first_difference, is_empty, layout
from saggs_jax._src.plan import resolve
from saggs_jax._src.transform import SaggsState
from saggs_jax._src.transport import registered_types, transport

if TYPE_CHECKING:
  import orbax.checkpoint as ocp


# What restore says of a checkpoint whose tree, shapes or dtypes differ from the target.
LAYOUT_MSG = (
  "{what} does not fit the target at {path!r}: {there} there, the target {want}."
  " Restore with the pairs, optimizer and dtypes it was saved with."
)
# The end of a refusal to restore a step whose arrays cannot be read or verified.


def check_layout(saved: Layout, target: Any, what: str = "The checkpoint") -> None:
  """Raises ValueError naming the first path where ``saved`` and ``target``'s layout differ.

  Target entries are compared in flatten order, then entries only ``saved`` has.

  Example:
    >>> import jax.numpy as jnp, saggs_jax as saggs
    >>> saved = saggs.checkpoint.layout({"w": jnp.ones((2, 3))})
    >>> saggs.checkpoint.check_layout(saved, {"w": jnp.ones((2, 4))})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: The checkpoint does not fit the target at 'w': float32[2, 3] there, the target float32[2, 4]. ...
  """
  expected = layout(target)
  first = first_difference(saved, expected)
  if first is not None:
    there, want = saved.get(first, "nothing"), expected.get(first, "nothing")
    raise ValueError(LAYOUT_MSG.format(what=what, path=first, there=there, want=want))


# ---------------------------------------------------------------------------
# Orbax writes no typed PRNG keys: their raw uint32 key data instead. Static
# leaves are not written: None stands in for them.


def _arrays(tree: Any) -> Any:
  """``tree`` with None for its static leaves."""
  return jax.tree.map(lambda x: x if paths.is_array(x) else None, tree)


def _storable(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, _arrays(tree))


def _abstract(leaf) -> jax.ShapeDtypeStruct:
  """What Orbax restores ``leaf`` from: its shape, dtype and sharding (key data for keys)."""
  import orbax.checkpoint as ocp  # here, not at the top: `import saggs_jax` loads no Orbax

  if not is_key(leaf):
    return cast(jax.ShapeDtypeStruct, ocp.utils.to_shape_dtype_struct(leaf))  # an array's
  data = jax.eval_shape(jax.random.key_data, leaf)
  # Key data has trailing axes the key's sharding leaves unnamed, i.e. replicated.
  return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=getattr(leaf, "sharding", None))


def _unstorable(target: Any, restored: Any) -> Any:
  return jax.tree.map(
    lambda t, x: jax.random.wrap_key_data(x, impl=jax.random.key_impl(t)) if is_key(t) else x,
    target,
    restored,
  )


def _with_statics(target: Any, arrays: Any) -> Any:
  """``arrays`` (None for static leaves) with the static leaves of ``target``."""
  return jax.tree.map(lambda t, x: x if paths.is_array(t) else t, target, arrays)


def _check_step(step) -> None:
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
    raise TypeError(f"step must be an int, got {step!r} of type {type(step).__name__}.")


def _check_not_nnx_objects(params: Any, opt_state: Any) -> None:
  """Refuses a Flax nnx object where its state belongs, before anything is written or read."""
  nnx = sys.modules.get("flax.nnx")  # no nnx object exists unless flax.nnx was imported
  if nnx is None:
    return
  objects = tuple(getattr(nnx, n) for n in ("Pytree", "Object") if hasattr(nnx, n))  # by version
  for name, value in (("params", params), ("opt_state", opt_state)):
    if isinstance(value, objects):
      raise TypeError(
        f"{name} is an nnx {type(value).__name__} object, not its state. Save"
        " nnx.state(model, nnx.Param) and nnx.state(optimizer); put them back with"
        " nnx.update(model, params), nnx.update(optimizer, opt_state)."
      )


def save(
  manager: ocp.CheckpointManager,
  step: int,
  params: Any,
  opt_state: Any,
  *,
  tx: optax.GradientTransformation | None = None,
  pairs: Sequence[Pair] | None = None,
) -> bool:
  """Saves ``params`` and ``opt_state`` as checkpoint ``step``, with their layout and checksums.

  Given ``tx``, the optimizer that made ``opt_state``, it also records the transport degree
  of every leaf of its state (:func:`saggs_jax._src.degrees.measure` on ``pairs``, by default the
  pairs of ``tx``'s first symmetry stage), so that :func:`restore` refuses a ``tx`` whose
  degrees differ (another optimizer with the same layout: adamax for adam), which the layout
  alone cannot tell.

  Saving is asynchronous, as with ``manager.save``: call
  ``manager.wait_until_finished()`` before the process exits (:func:`restore`
  waits by itself). In a multi-process job every process calls it, with the
  same ``step``, on its global arrays and a directory all processes share.

  With ``flax.nnx``, save ``nnx.state(model, nnx.Param)`` and
  ``nnx.state(optimizer)`` (or ``optimizer.opt_state``); an nnx object itself
  is a ``TypeError`` here rather than at :func:`restore`.

  Returns:
    Whether a checkpoint was written (the manager's ``save_interval_steps``
    and similar options may skip a step).

  Raises:
    TypeError: ``step`` is not an int, or ``params`` or ``opt_state`` is an
      nnx object, or a degree of ``tx`` cannot be measured.
    ValueError: ``tx`` does not make ``opt_state``, or is given with no ``pairs`` and has
      no symmetry stage to take them from.

  Example:
    >>> import tempfile, jax.numpy as jnp, optax, orbax.checkpoint as ocp, saggs_jax as saggs
    >>> params = {"w": jnp.ones((2, 3))}
    >>> manager = ocp.CheckpointManager(tempfile.mkdtemp())
    >>> saggs.checkpoint.save(manager, 1, params, optax.adam(1e-3).init(params))
    True
    >>> manager.close()
  """
  import orbax.checkpoint as ocp  # as in _abstract

  _check_step(step)
  _check_not_nnx_objects(params, opt_state)
  state = {"params": params, "opt_state": opt_state}
  items = {
    "state": ocp.args.StandardSave(_storable(state)),
    "layout": ocp.args.JsonSave(layout(state)),
    "checksums": ocp.args.JsonSave(checksums(state)),
  }
  if tx is not None:
    items[_RECORD] = ocp.args.JsonSave(_degree_record(tx, params, opt_state, pairs))
  return manager.save(step, args=ocp.args.Composite(**items))


# ---------------------------------------------------------------------------
# What the layout cannot tell: two optimizers with one layout (adam and adamax, both
# ScaleByAdamState) whose moments move by other degrees. save(tx=) records the degrees of
# every leaf of tx's state, measured on the pairs; restore(tx=) measures its own on the same
# pairs and refuses a difference. Hyperparameters that change no degree (a learning rate, a
# schedule, b1) pass: canonicalising by them is exact.

_RECORD = "degrees"


def _pairs_of(tx: optax.GradientTransformation) -> tuple[Pair, ...] | None:
  stages = getattr(tx.update, "stages", ())
  return stages[0].pairs if stages else None


def _measured(tx: optax.GradientTransformation, params: Any, pairs: Sequence[Pair]) -> dict:
  """``{path: degree}`` of every leaf of ``tx.init(params)`` (paths in its layout): a measured
  degree, or ``"as registered"``."""
  plan = resolve(pairs, params)
  found = canonical._degrees(tx, params, jax.eval_shape(tx.init, params), plan)
  return {} if found is None else dict(paths.leaves_with_paths(found))


def _degree_record(tx, params: Any, opt_state: Any, pairs: Sequence[Pair] | None) -> dict:
  pairs = _pairs_of(tx) if pairs is None else as_pairs(pairs)
  if not pairs:
    raise ValueError(
      "save(tx=...) records the degrees measured on the pairs: tx has no symmetry stage to"
      " take them from, so pass pairs= too (those restore will canonicalize with)."
    )
  arrays = _arrays(params)
  nodes, _, i = _split(tx, arrays, _arrays(opt_state))
  made = jax.eval_shape(tx.init, arrays)
  _made_by(tx, arrays, _laid_out(nodes[i], made))  # a tx that did not make it: ValueError
  return {"pairs": [repr(p) for p in pairs], "degrees": _measured(tx, arrays, pairs)}


def _check_record(manager, step: int, what: str, tx, params: Any, pairs) -> None:
  """Raises a ValueError if checkpoint ``step`` records degrees (:func:`save` with ``tx=``) on
  these ``pairs`` and ``tx``'s differ. A checkpoint saved without ``tx=`` records none, one
  saved with other pairs others: neither can be checked (see docs/checkpoints.md)."""
  import orbax.checkpoint as ocp  # as in _abstract

  try:
    record = manager.restore(step, args=ocp.args.Composite(**{_RECORD: ocp.args.JsonRestore()}))
  except KeyError as e:  # Orbax: 'Item "degrees" was not found in the checkpoint'
    if "not found" not in str(e):
      raise
    return
  record = record[_RECORD]
  if record["pairs"] != [repr(p) for p in as_pairs(pairs)]:
    return
  saved, ours = record["degrees"], _measured(tx, params, pairs)
  for path in [*ours, *(p for p in saved if p not in ours)]:
    if saved.get(path) != ours.get(path):
      raise ValueError(
        f"{what} was saved by another optimizer: its leaf {path!r} has degree"
        f" {saved.get(path, 'none')!r} there, {ours.get(path, 'none')!r} in tx. Pass the"
        " optimizer that saved it."
      )


# ---------------------------------------------------------------------------
# Canonicalising a restored state moves its moments, each by its degree. A state type
# registers the degrees it has where optax usually puts it, but its place in the chain
# decides them: optax.adamax and adamaxw keep an infinity norm (degree 1) in Adam's nu; any
# moment after a normaliser holds updates of degree 0 (the trace of rmsprop(centered=True,
# momentum=...), chain(scale_by_rms(), scale_by_lion()), chain(scale_by_rms(),
# MultiSteps(sgd, 4))'s accumulator), after a trust ratio parameter-like ones (lars's
# trace, -1), after a stage scaling by a parameter norm one less. No state type is safe
# from such a stage before it, so restore measures the degrees on the optimizer
# (saggs_jax._src.degrees.measure) and refuses, without it, every leaf it would move.

_TX_FIX = " Nothing was restored; pass the chain: restore(..., pairs, tx=tx)."


def _nodes(tree: Any, types: tuple[type, ...]) -> list[tuple[str, Any]]:
  """``(path, node)`` for every node of ``tree`` of one of ``types``, outermost first."""
  found = paths.leaves_with_paths(tree, is_leaf=lambda x: isinstance(x, types))
  return [(p, x) for p, x in found if isinstance(x, types)]


def moved_without_tx(params: Any, opt_state: Any, pairs: Sequence[Pair]) -> list[str]:
  """The paths of the leaves of ``opt_state`` that canonicalising by ``pairs`` would move by
  their state types' registered degrees: every moment of a declared parameter, each of whose
  degrees a stage before it can change (see above). Read off the transport's program on
  abstract values (a leaf it returns as it came is not moved): nothing is computed.

  Example:
    >>> import jax.numpy as jnp, optax, saggs_jax as saggs
    >>> params = {"q": jnp.ones((2, 2)), "k": jnp.ones((2, 2)), "b": jnp.ones(2)}
    >>> state = optax.chain(optax.scale_by_rms(), optax.scale_by_lion()).init(params)
    >>> saggs._src.checkpoint.moved_without_tx(params, state, [saggs.Pair("q", "k")])
    ['0/nu/k', '0/nu/q', '1/mu/k', '1/mu/q']
  """
  plan = resolve(pairs, params)
  found = list(paths.arrays_with_paths(opt_state))
  specs = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for _, x in found]
  factors = {i.key: jax.ShapeDtypeStruct(i.factor_shape, jnp.float32) for i in plan.instances}
  treedef = jax.tree.structure(opt_state)

  def moved(leaves, f):
    return jax.tree.leaves(transport(plan, treedef.unflatten(leaves), f))

  jaxpr = jax.make_jaxpr(moved)(specs, factors).jaxpr
  inputs = jaxpr.invars[: len(specs)]
  return [path for (path, _), i, o in zip(found, inputs, jaxpr.outvars) if o is not i]


def _refuse_moments(params: Any, opt_state: Any, pairs: Sequence[Pair]) -> None:
  found = moved_without_tx(params, opt_state, pairs)
  if found:
    owners = [  # the registered states holding it, by the length of their paths
      (len(p), type(x).__name__)
      for t in registered_types()
      for p, x in _nodes(opt_state, (t,))
      if found[0].startswith(p + "/") or not p
    ]
    what = f"{max(owners)[1]} leaf" if owners else "leaf"
    others = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    raise TypeError(
      f"Cannot canonicalize opt_state without its optimizer: the {what} at"
      f" opt_state/{found[0]}{others} is a moment." + _TX_FIX
    )


def _refuse_params_inside(params: Any, opt_state: Any) -> None:
  """Refuses a train state that holds ``params`` themselves (a Linen ``TrainState``): that
  copy would come back as saved, beside canonicalised ``params``."""
  ids = {id(x) for x in jax.tree.leaves(params)}
  inside = [p for p, x in paths.leaves_with_paths(opt_state) if id(x) in ids]
  if inside:
    raise ValueError(
      f"opt_state holds params themselves (at 'opt_state/{inside[0]}'), which would come back"
      " uncanonicalised. Nothing was restored; save and restore state.replace(params=None)."
    )


def _refuse_nnx_mappings(opt_state: Any) -> None:
  nnx = sys.modules.get("flax.nnx")
  if nnx is not None and _nodes(opt_state, (nnx.State,)):
    raise TypeError(
      "Cannot canonicalize an nnx state without its optimizer: nnx.state(optimizer) keeps"
      " plain mappings, so only tx can tell their degrees." + _TX_FIX
    )


def _made_by(tx: optax.GradientTransformation, params: Any, opt_state: Any) -> tuple[Any, ...]:
  """``(optimizer, n, treedef)``: ``opt_state[:n]`` (all of it when ``n`` is -1) is what
  ``optimizer`` makes, in the structure ``treedef``; the rest are the states of a
  :func:`saggs_jax.chain`'s symmetry stages."""
  optimizer = getattr(tx, "optimizer", None)  # a saggs.chain: the stages before its symmetry
  if optimizer is not None:
    made = jax.eval_shape(optimizer.init, params)
    part, n = (opt_state[: len(made)], len(made)) if isinstance(opt_state, tuple) else (None, 0)
    name = "tx.optimizer"
  else:
    optimizer, part, n, name = tx, opt_state, -1, "tx"
    made = jax.eval_shape(tx.init, params)
    if _nodes(made, (SaggsState,)):
      raise TypeError(
        "tx holds a SAGGS stage inside another transformation, which hides the degrees of the"
        " moments. Nothing was restored; pass the saggs.chain itself as tx."
      )
  ours, theirs = layout(made), layout(part)
  first = first_difference(theirs, ours)
  if first is not None:  # a chain's state that is no tuple lacks all of it
    raise ValueError(
      f"tx does not make this opt_state: at {first!r}, {name}.init(params) gives"
      f" {ours.get(first, 'nothing')}, it holds {theirs.get(first, 'nothing')}." + _TX_FIX
    )
  return optimizer, n, jax.tree.structure(made)


def _arrays_by_path(tree: Any) -> dict[str, str]:
  """``{path: "dtype[shape]"}`` of ``tree``'s array leaves: its layout up to order and empty
  nodes, which an ``nnx.state(optimizer)`` keeps its optax state without."""
  return {p: d for p, d in layout(tree).items() if d.endswith("]")}


def _relaid(values: Any, like: Any) -> Any:
  """``like``'s structure holding, at each of its leaves' paths, the leaf ``values`` has
  there (an optax state and the mapping ``nnx.state(optimizer)`` keeps it as, both ways)."""
  found = dict(paths.leaves_with_paths(values))
  leaves = [found[p] for p, _ in paths.leaves_with_paths(like)]
  return jax.tree.structure(like).unflatten(leaves)


def _laid_out(node: Any, made: Any) -> Any:
  """``node`` in the structure of ``made``, the state ``tx.init`` makes, when it holds the
  same arrays at the same paths (an ``nnx.state(optimizer)``'s mappings); else as it is."""
  return _relaid(node, made) if _arrays_by_path(node) == _arrays_by_path(made) else node


def _split(tx: optax.GradientTransformation, params: Any, opt_state: Any) -> tuple[Any, ...]:
  """``(nodes, treedef, i)``: ``opt_state`` flattened down to the state ``tx`` makes, which
  is ``nodes[i]``. A train state may hold more than the optax state (an RNG key, a step,
  EMA weights, an ``nnx.Optimizer``'s step): its one subtree with the arrays
  ``tx.init(params)`` makes, at the same paths, is ``tx``'s."""
  want = _arrays_by_path(jax.eval_shape(tx.init, params))
  whole = [opt_state], jax.tree.structure(0), 0
  if _arrays_by_path(opt_state) == want:
    return whole
  is_tx_state = lambda x: not is_empty(x) and _arrays_by_path(x) == want  # noqa: E731
  nodes, treedef = jax.tree.flatten(opt_state, is_leaf=is_tx_state)
  found = [i for i, x in enumerate(nodes) if is_tx_state(x)]
  if len(found) > 1:
    raise ValueError(
      f"{len(found)} subtrees of opt_state have the layout tx.init(params) makes, so which one"
      " tx made is ambiguous. Pass that one alone as opt_state. Nothing was restored."
    )
  return (nodes, treedef, found[0]) if found else whole  # else _made_by says where it differs


def _canonical(params, opt_state, pairs, tx, n, treedef):
  """``(params, opt_state, residual)``: :func:`saggs_jax._src.canonical.canonical_form` by
  ``tx``'s degrees (the registered ones without it) on ``opt_state[:n]``, laid out as
  ``tx.init`` lays it out (``treedef``); the rest unmoved."""
  if tx is None:
    return canonical.canonical_form(params, opt_state, pairs, None)
  part = opt_state if n < 0 else opt_state[:n]
  params, moved, residual = canonical.canonical_form(
    params, treedef.unflatten(jax.tree.leaves(part)), pairs, tx
  )
  moved = jax.tree.structure(part).unflatten(jax.tree.leaves(moved))  # nnx boxes and all
  if n < 0:
    return params, moved, residual
  rest = (*moved, *opt_state[n:])  # a wrapper's SymmetryState stays one
  return params, type(opt_state)(*rest) if hasattr(opt_state, "_fields") else rest, residual


def _spec(x) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))


# Compiles the canonicalisation while Orbax reads the arrays (XLA's compile releases the GIL).
_COMPILER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="saggs-restore")


@functools.lru_cache(maxsize=16)
def _canonicalizer(
  pairs: tuple[Pair, ...], tx, n: int, made_treedef, treedef, specs: tuple
) -> concurrent.futures.Future:
  """The restore's canonicalisation for the target (``treedef``, ``specs``), in place (the
  restored arrays are donated) and onto the target's shardings: compiled on a thread of
  its own, so that the compile overlaps the read.

  Lowered here, on abstract values, before any array is read, so a ``tx`` whose degrees
  cannot be measured fails first."""
  shardings = [s.sharding for s in specs]
  out = None if None in shardings else jax.tree.unflatten(treedef, shardings)
  # The residual comes back to be checked on the host, not by a jax.debug.callback in the
  # program: JAX writes no program with a host callback to its persistent compilation
  # cache, so a restore in a new process would compile it again.
  fn = jax.jit(
    lambda p, s: _canonical(p, s, pairs, tx, n, made_treedef),
    out_shardings=None if out is None else (*out, None),
    donate_argnums=(0, 1),
  )
  return _COMPILER.submit(fn.lower(*jax.tree.unflatten(treedef, specs)).compile)


def restore(
  manager: ocp.CheckpointManager,
  params: Any,
  opt_state: Any,
  pairs: Sequence[Pair] | None = None,
  step: int | None = None,
  canonicalize: bool = True,
  *,
  tx: optax.GradientTransformation | None = None,
) -> tuple[Any, Any, int]:
  """Restores a checkpoint written by :func:`save`, in the structure of the target.

  With ``pairs``, the state is canonicalised: the parameters balanced
  (:func:`saggs_jax.canonicalize`) and every moment moved by the degree it has in
  ``tx``, the optimizer that made ``opt_state`` (docs/checkpoints.md). Without ``tx``, a
  state holding a moment of a declared parameter is refused. Every check runs before
  any array is read, and a failed restore changes nothing.

  Args:
    manager: the ``orbax.checkpoint.CheckpointManager`` it was saved with.
    params, opt_state: the target, with the saved tree structure, shapes and dtypes; its
      shardings are kept and it is not modified. ``opt_state`` may be a whole train
      state: with ``tx``, its one subtree laid out as ``tx.init(params)`` is canonicalised.
    pairs: the :class:`~saggs_jax.Pair` declarations (none: the saved run continues).
    step: the step to restore (an int); default the latest.
    canonicalize: canonicalize when ``pairs`` is given.
    tx: the optimizer that made ``opt_state`` (a :func:`saggs_jax.chain`, or any
      transformation whose ``init(params)`` has its layout).

  Returns:
    ``(params, opt_state, step)``.

  Raises:
    TypeError: ``step`` is not an int, the target is an nnx object, a moment needs
      ``tx``, or no degree transports a leaf.
    FileNotFoundError: the manager holds no checkpoint ``step``.
    ValueError: not written by :func:`save`, its layout or degrees differ from the
      target's (naming the first path), or an array fails its checksum.

  Example:
    >>> import tempfile, jax.numpy as jnp, optax, orbax.checkpoint as ocp, saggs_jax as saggs
    >>> params, tx = {"q": jnp.full((2, 2), 4.0), "k": jnp.ones((2, 2))}, optax.adam(1e-3)
    >>> manager = ocp.CheckpointManager(tempfile.mkdtemp())
    >>> saggs.checkpoint.save(manager, 3, params, tx.init(params))
    True
    >>> restored, _, step = saggs.checkpoint.restore(
    ...     manager, params, tx.init(params), [saggs.Pair("q", "k")], tx=tx)
    >>> step, float(restored["q"][0, 0]), float(restored["k"][0, 0])  # canonicalised
    (3, 2.0, 2.0)
    >>> manager.close()
  """
  import orbax.checkpoint as ocp  # as in _abstract

  if step is not None:
    _check_step(step)
  _check_not_nnx_objects(params, opt_state)
  manager.wait_until_finished()  # a save still in flight is not readable yet
  steps = manager.all_steps()
  step = manager.latest_step() if step is None else int(step)
  if step is None or step not in steps:
    which = "No checkpoint" if step is None else f"No checkpoint {step}"
    held = f"it holds steps {sorted(steps)}" if steps else "it holds none"
    raise FileNotFoundError(f"{which} in {manager.directory}: {held}.")
  balanced_by = pairs if canonicalize else None  # the pairs to canonicalize with, if any
  if balanced_by is not None:
    resolve(balanced_by, params)  # a bad declaration fails before anything is read
    _refuse_params_inside(params, opt_state)
  target = {"params": params, "opt_state": opt_state}
  what = f"Checkpoint {step} in {manager.directory}"
  try:
    saved = manager.restore(
      step, args=ocp.args.Composite(layout=ocp.args.JsonRestore(), checksums=ocp.args.JsonRestore())
    )
  except Exception as e:  # a plain Orbax checkpoint: KeyError, ValueError, ... from Orbax
    raise ValueError(
      f"{what} was not written by saggs_jax.checkpoint.save: it has no readable 'layout' and"
      f" 'checksums' items (Orbax: {str(e).splitlines()[0]}). Restore it with Orbax directly."
    ) from e
  check_layout(saved["layout"], target, what)
  abstract = jax.tree.map(lambda x: _abstract(x) if paths.is_array(x) else None, target)
  jobs = hashers(abstract, _COMPILER)  # compiled first: the first program run after the read
  canonicalizer, nodes, i = None, [_arrays(opt_state)], 0
  node_def = jax.tree.structure(0)  # opt_state as one node: all of it tx's, or no tx
  if balanced_by is not None:
    optimizer, n, made, made_by_tx = None, -1, None, None
    if tx is not None and opt_state is not None:
      nodes, node_def, i = _split(tx, _arrays(params), nodes[0])
      made_by_tx = jax.eval_shape(tx.init, _arrays(params))
      optimizer, n, made = _made_by(tx, _arrays(params), _laid_out(nodes[i], made_by_tx))
      _check_record(manager, step, what, tx, _arrays(params), balanced_by)
    else:
      _refuse_nnx_mappings(opt_state)
      _refuse_moments(_arrays(params), _arrays(opt_state), balanced_by)
    node = nodes[i] if made_by_tx is None else _laid_out(nodes[i], made_by_tx)
    specs, treedef = jax.tree.flatten(jax.tree.map(_spec, _arrays((params, node))))
    canonicalizer = _canonicalizer(as_pairs(balanced_by), optimizer, n, made, treedef, tuple(specs))
  try:
    state = manager.restore(
      step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
    )["state"]
  except Exception as e:  # Orbax raises whatever TensorStore met (DATA_LOSS, zstd errors, ...)
    raise ValueError(f"{what} could not be read: {str(e).splitlines()[0]}." + ANOTHER_STEP) from e
  verify(saved["checksums"], state, what, jobs)
  state = _unstorable(target, state)
  arrays = state["params"], state["opt_state"]
  if canonicalizer is not None:  # tx's state alone is canonicalised; the rest comes back as read
    nodes = node_def.flatten_up_to(arrays[1])
    node = nodes[i] if made_by_tx is None else _laid_out(nodes[i], made_by_tx)
    restored, moved, residual = canonicalizer.result()(arrays[0], node)
    nodes[i] = moved if made_by_tx is None else _relaid(moved, nodes[i])
    arrays = restored, node_def.unflatten(nodes)
    canonical.warn_unconverged(residual)
  params, opt_state = _with_statics((params, opt_state), arrays)
  return params, opt_state, step
