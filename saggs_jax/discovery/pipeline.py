"""The pipeline: jaxpr -> program -> candidates -> numeric confirmation -> declarations."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from saggs_jax import paths
from saggs_jax.diagnostics import default_rtol
from saggs_jax.discovery import declarations
from saggs_jax.discovery.candidates import Analysis, Candidate, group_options
from saggs_jax.discovery.confirmation import Checker, confirm
from saggs_jax.discovery.result import Discovery

_UNCONFIRMED = (
  "unconfirmed: rescaling side a alone does not change the output on the example"
  " inputs, even with all-zero parameters drawn at random, so no check could fail"
)
_ABSTRACT = (
  "unconfirmed: the parameters are abstract (jax.ShapeDtypeStruct or tracers), so no"
  " numerical check ran; call discover with concrete parameters to confirm"
)
_REFUTED = "the jaxpr suggests it, but random factors change the output"


def discover(
  apply_fn: Callable[..., Any],
  params: Any,
  *example_args,
  rtol: float | None = None,
  seed: int = 0,
  **example_kwargs,
) -> Discovery:
  """Finds the exact rescaling symmetries of ``apply_fn`` in ``params``.

  Reads the jaxpr of ``apply_fn(params, *example_args, **example_kwargs)``
  traced on abstract shapes, proposes every rescaling of one parameter that
  another cancels (see the module docstring), and keeps those that random
  factors in [1/4, 4] leave exact on the example inputs: the outputs agree to
  ``rtol * max|output|`` with full-precision matmuls, and their tangent along the
  rescaling is at most ``rtol`` times the change that side a makes alone (the
  power to see a candidate that moves the outputs little, tiny attention logits
  at init std 0.02, say). All instances of one candidate (every layer) are
  checked at once, at the finest grouping the jaxpr suggests that is exact (per
  channel, per head, per KV head), on ``params`` with all-zero leaves drawn at
  random, and only where the check could have failed. Blocks of a fused leaf
  enter pairs as :class:`~saggs_jax.Block` members.

  The check needs the parameters' values; with abstract ones (``jax.ShapeDtypeStruct``
  leaves, or tracers under ``jax.jit``) only the jaxpr is read, nothing is
  allocated at the parameters' size, and every candidate is reported as
  unconfirmed (``confirmation == "none"``). On a large model, confirm with its
  values on the smallest inputs that can fail: one short sequence.

  Args:
    apply_fn: ``apply_fn(params, *example_args, **example_kwargs)``, returning
      an array or a pytree.
    params: the parameter tree (an ``nnx.State``, a Linen dict, an Equinox
      module): its inexact arrays, concrete or abstract (see ``is_parameter``),
      are the parameters; every other leaf (flags, activation functions, integer
      buffers) is static, as under ``eqx.filter``.
    *example_args: small example inputs (one short sequence is enough).
    rtol: relative tolerance of the numerical check (>= 0); default 1e-4 in
      float32, 3e-2 with 16-bit parameters or outputs.
    seed: seed of the random factors.
    **example_kwargs: keyword inputs of ``apply_fn``.

  Returns:
    A :class:`Discovery`: a sequence of :class:`~saggs_jax.Pair` whose patterns
    cover every layer, with ``.rejected`` (what was considered and why it is
    no exact symmetry), :meth:`Discovery.report`, and ``.roles``: the path
    patterns of each role of :func:`saggs_jax.equivariant.symmetry_compatible`
    found (attention from the Q/K and V/O pairs, MLP up/gate/down from the MLP
    pairs, stacked experts, the embedding read by a gather on the inputs, the
    LM head producing the output), for ``symmetry_compatible(patterns=...)``;
    ``.confirmation`` says which check ran (``"parameters"``, ``"parameters,
    finite only"`` for a model that cannot be differentiated forward, or
    ``"none"`` for abstract parameters).

  Raises:
    ValueError: ``rtol`` is negative or NaN.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from saggs_jax.discovery import discover
    >>> def mlp(p, x): return jax.nn.relu(x @ p["up"]) @ p["down"]
    >>> params = {"up": jnp.ones((3, 4)), "down": jnp.ones((4, 2))}
    >>> discover(mlp, params, jnp.ones((2, 3)))
    Discovery(pairs=[
        Pair(a='up', b='down', axes=(1, 0), groups=None, stacked=0, follow_a=(), follow_b=(),
             name='ReLU MLP up/down (positive factors)'),
    ], rejected=[], roles={'gate_up': ('up',), 'down': ('down',)}, confirmation='parameters')
    >>> shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    >>> discover(mlp, shapes, jnp.ones((2, 3))).confirmation  # traced only: nothing confirmed
    'none'
  """
  if rtol is not None and not rtol >= 0:  # NaN too
    raise ValueError(f"rtol must be a non-negative number, got {rtol!r}.")
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  traced = [is_parameter(x) for _, x in flat]
  names = [paths.path_str(k) for (k, _), t in zip(flat, traced) if t]
  leaves = [x for (_, x), t in zip(flat, traced) if t]

  def fn(arrays, *args, **kwargs):
    arrays = iter(arrays)
    tree = treedef.unflatten([next(arrays) if t else x for (_, x), t in zip(flat, traced)])
    return apply_fn(tree, *args, **kwargs)

  abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
  closed = jax.make_jaxpr(lambda p, a, k: fn(p, *a, **k))(abstract, example_args, example_kwargs)
  shapes = [tuple(x.shape) for x in leaves]
  floating = [bool(jnp.issubdtype(x.dtype, jnp.floating)) for x in leaves]
  analysis = Analysis(closed, names, shapes, floating)

  units = analysis.units
  groups_of: dict[tuple, list[Candidate]] = collections.defaultdict(list)
  for inst in sorted(
    analysis.candidates,  # in the order of the tree
    key=lambda i: (units[i.a[0][0]].leaf, i.a[0][0]),
  ):
    groups_of[declarations.key(units, analysis.names, inst)].append(inst)
  pairs, rejections, confirmed = [], list(analysis.rejected), []
  concrete = not any(isinstance(x, (jax.ShapeDtypeStruct, jax.core.Tracer)) for x in leaves)
  confirmation = "parameters" if concrete else "none"
  if not concrete:
    rejections += [_rejection(analysis, i, _ABSTRACT) for g in groups_of.values() for i in g]
  elif groups_of:  # the check compiles the model: only when there is something to check
    rtol = default_rtol(leaves + list(closed.out_avals)) if rtol is None else rtol
    checker = Checker(
      fn, leaves, example_args, example_kwargs, rtol, seed, units, analysis.candidates
    )
    for instances in groups_of.values():
      sizes = [analysis.shapes[unit][axis] for unit, axis in instances[0].a + instances[0].b]
      options = group_options(sizes, set().union(*(i.splits for i in instances)))
      passed, failed = confirm(checker, instances, options)
      for insts, groups, tested in passed:
        if not tested:
          rejections += [_rejection(analysis, i, _UNCONFIRMED) for i in insts]
          continue
        confirmed.append(insts)
        pairs += declarations.declare(units, analysis.names, analysis.shapes, insts, groups)
      rejections += [_rejection(analysis, i, _REFUTED) for i in failed]
    confirmation = "parameters" if checker.first_order else "parameters, finite only"
  return Discovery(
    pairs,
    declarations.rejected(rejections),
    declarations.roles(analysis, names, shapes, confirmed),
    confirmation,
  )


def is_parameter(leaf: Any) -> bool:
  """Whether a leaf of the parameter tree is a parameter: an inexact array, concrete
  (``jax.Array``, ``np.ndarray``) or abstract (``jax.ShapeDtypeStruct``, a tracer). Every
  other leaf (flags, activation functions, integer buffers of an Equinox module, Python
  scalars) is static, as under ``eqx.filter``."""
  return isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) and bool(
    jnp.issubdtype(leaf.dtype, jnp.inexact)
  )


def _rejection(analysis: Analysis, inst: Candidate, reason: str):
  return analysis.rejection([u for u, _ in inst.a], [u for u, _ in inst.b], reason)
