"""Group norms: the log squared norm and log largest magnitude of every group, scale-safe.

Norms are kept as logarithms, taken in at least float32. A leaf in one pair
instance off a mesh is read once by a plain sum of squares per group, a
reduction XLA vectorises; only a piece with a group whose sum over- or
underflowed, met a non-finite entry or is past its pair's dtype is read again, by a
scale-safe pass under one ``lax.cond`` for all such leaves. That pass reduces each group to
``(s, q)``, its largest magnitude ``s`` and the sum ``q`` of its entries'
squares relative to it, ``||x_g||**2 = s**2 q`` with ``1 <= q <= size``; two
partial results combine as

  s = max(s1, s2),   q = q1 (s1 / s)**2 + q2 (s2 / s)**2,

so no square overflows or underflows (LAPACK's scaled sum of squares, as one
reduction that XLA fuses with the read), and ``log ||x_g||**2 = 2 log s + log q``.
Its combiner divides, so XLA emits it as a scalar loop, several times slower
than the plain sum: hence the plain sum first.

On a mesh (the context's, or that of an Explicit-sharded leaf) XLA would
combine such partial results across devices by gathering them from every
device, and a leaf in several instances (overlapping pairs) needs sums per
combination of groups, a contraction. Off a mesh under jit, a leaf in overlapping
pairs takes the two scale-safe passes below at once (their compile is half that of a
first pass with a recompute under control flow); on a mesh, or eagerly, such a leaf takes
one float32 pass instead, its squares summed per group where the data lives and combined with
one all-reduce of at most one value per group; a piece whose sums overflow,
underflow or meet a non-finite entry is recomputed in two passes, the group
maxima and then the squares of entries divided by the tensor's largest finite
group maximum (see :func:`_recompute_traced`). Inside ``shard_map``
``axis_name`` names the mesh axes to sum over.

A zero norm is reported as ``-inf``, a group with a non-finite entry as
``+inf``, and a non-finite entry only affects its own group.

A leaf with blocks (see :class:`saggs_jax.Block`) is cut at their boundaries
into pieces (:attr:`saggs_jax._src.plan.Plan.pieces`) whose entries move by the
same slots; its statistics are taken per piece through a mask along the block
axis, so a sharded block axis stays sharded.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import core

from saggs_jax._src import paths
from saggs_jax._src.numerics import (
  AxisName,
  compute_dtype,
  is_explicit,
  log_dtype_max,
  ordered_control_flow,
  replicated,
)
from saggs_jax._src.plan import Piece, Plan, Slot, Span

# A float32 sum of squares this small may have lost digits to underflow: such
# norms (and overflowing or non-finite ones) are recomputed on the safe path.
_SMALLEST_SAFE_SUM = 1e-20

Combine = Callable[[tuple, tuple], tuple]  # a monoid on partial results, identity all zeros


def _rescale(q: jax.Array, s: jax.Array, to: jax.Array) -> jax.Array:
  """``q (s / to)**2``: a sum of squares relative to ``s`` made relative to ``to >= s``
  (0 where ``to`` is; NaN where ``to`` is inf or NaN and ``s`` is too)."""
  r = s / jnp.where(to > 0, to, 1)
  return q * r * r


def _scaled(a: tuple, b: tuple) -> tuple:
  """Combines ``(s, q)`` partial results (see the module docstring)."""
  s = jnp.maximum(a[0], b[0])
  return s, _rescale(a[1], a[0], s) + _rescale(b[1], b[0], s)


def _sum(a: tuple, b: tuple) -> tuple:
  return (a[0] + b[0],)


def _max(a: tuple, b: tuple) -> tuple:
  return (jnp.maximum(a[0], b[0]),)


def _reduce_all(vs: Sequence[jax.Array], axes: Sequence[int], combine: Combine) -> list[jax.Array]:
  """``vs`` (each ``>= 0``) reduced over ``axes`` by ``combine``. Several operands make one
  variadic reduction, which XLA fuses with the elementwise work that makes them into
  one read (but across devices gathers its partial results rather than all-reducing)."""
  if combine is _sum or combine is _max:
    return [(jnp.sum if combine is _sum else jnp.max)(vs[0], axis=tuple(axes))]
  zero = jnp.zeros((), vs[0].dtype)
  return list(jax.lax.reduce(tuple(vs), (zero,) * len(vs), combine, tuple(axes)))


def _on_mesh(x: jax.Array) -> bool:
  """Whether ``x`` is laid out on a mesh: the context's (``jax.set_mesh``), or that of its
  own Explicit-mode sharding, which types it even outside ``jax.set_mesh``."""
  return not jax.sharding.get_abstract_mesh().empty or is_explicit(x)


def _group_reduce(
  vs: Sequence[jax.Array], slot: Slot, combine: Combine, square: bool = False
) -> list[jax.Array]:
  """``vs`` (squared first with ``square``) reduced by ``combine`` over each group of
  ``slot``: each of shape ``stacked_shape (+ (groups,))``.

  On a mesh it is one reduction over every axis but the stacked ones, whatever the
  layout: each device reduces its own entries per group and a single all-reduce of
  one value per group combines them. Several indices per group are then masked by a
  one-hot broadcast inside that reduction (``groups`` multiply-adds per entry, fused):
  reducing the other axes first would all-reduce one value per index when they are
  sharded, and reshaping the group axis into (groups, size) would gather it when its
  shards straddle groups. Without a mesh that reshape is free, and one reduction over it
  compiles once where per-index reductions and a second one over that small vector
  compiled twice (each a kernel and a reducer of its own, per leaf).
  """
  v, axis = vs[0], slot.axis
  masked = axis is not None and not slot.per_index(v.shape[axis]) and _on_mesh(v)
  if square and not masked:
    vs = [jnp.square(x) for x in vs]
  if axis is None or slot.per_index(v.shape[axis]):
    return [_group_last(r, slot) for r in _reduce_all(vs, slot.reduce_axes(v.ndim), combine)]
  if not _on_mesh(v):  # the group axis split into (groups, size), one reduction
    start, stop = slot.tiled(v.shape[axis])  # (within a block)
    if (start, stop) != (0, v.shape[axis]):
      vs = [jax.lax.slice_in_dim(x, start, stop, axis=axis) for x in vs]
    split = [x.reshape(x.shape[:axis] + (slot.groups, -1) + x.shape[axis + 1 :]) for x in vs]
    axes = tuple(i + (i > axis) for i in slot.reduce_axes(v.ndim)) + (axis + 1,)
    return [_group_last(r, slot) for r in _reduce_all(split, axes, combine)]
  # On a mesh: the sum or maximum of one operand, its group axis masked by the one-hot
  # membership, which XLA broadcasts inside the reduction unless two reductions share
  # it: then it is materialised, the size of the leaf times its groups. The mask passes
  # an optimization barrier with the operand, so that leaves of one shape (k and v) do
  # not share theirs, and the maximum (of the safe passes) puts the group axis first. A sum
  # of squares squares inside the masked product: jax 0.11+'s CPU backend hands the
  # reduction and the mask's product to a library fusion that takes no other elementwise
  # work, so a square before it was materialised (the size of the leaf's shard).
  (x,) = vs
  one_hot = slot.membership(x.shape[axis]).astype(x.dtype)  # (size, groups)
  if combine is _max:
    one_hot = one_hot.T.reshape((slot.groups,) + (1,) * axis + (-1,) + (1,) * (x.ndim - axis - 1))
  else:
    one_hot = one_hot.reshape((1,) * axis + (-1,) + (1,) * (x.ndim - axis - 1) + (slot.groups,))
  mask, x = jax.lax.optimization_barrier((jnp.asarray(one_hot), x))
  if combine is _max:
    (r,) = _reduce_all(
      [x[None] * mask], [i + 1 for i in slot.reduce_axes(x.ndim) + (axis,)], combine
    )
    return [jnp.moveaxis(r, 0, -1)]
  masked = x[..., None] * mask * x[..., None] if square else x[..., None] * mask
  return _reduce_all([masked], slot.reduce_axes(x.ndim) + (axis,), combine)


def _group_last(r: jax.Array, slot: Slot) -> jax.Array:
  """A reduction ``r`` over ``slot.reduce_axes``, its kept axes in leaf order, with the group
  axis moved after the copy axes: a transpose of the small result, never of the leaf."""
  return r if slot.axis is None else jnp.moveaxis(r, slot.group_position, -1)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _plain_sq(x: jax.Array, slot: Slot, block: Span | None) -> jax.Array:
  """``sum x**2`` per group of ``slot`` off a mesh, of the piece ``block`` of ``x``: one plain
  sum of squares in its compute dtype, which XLA vectorises, kept in float32 (inexact or
  infinite where the squares or the sum leave that range). Traced (and lowered) once per
  shape and slot layout, not per leaf: the caller passes ``slot`` without its instance (see
  :func:`_layout`)."""
  (sq,) = _group_reduce([_restrict(x.astype(compute_dtype(x.dtype)), block)], slot, _sum, True)
  return (sq if slot.axis is not None else sq[..., None]).astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _scaled_log_stats(x: jax.Array, slot: Slot, block: Span | None) -> tuple[jax.Array, ...]:
  """:func:`_scaled_stats` in float32, traced once per shape and slot layout."""
  return tuple(v.astype(jnp.float32) for v in _scaled_stats(x, slot, block))


def _one_pass_stats(plan: Plan, pieces: dict[tuple, Piece], leaves: dict, limit: dict) -> Stats:
  """The statistics of ``pieces`` (each in one instance, off a mesh) from one read each: a
  plain sum of squares (:func:`_plain_sq`), checked by :func:`_checked`, whose untrusted
  groups :func:`_scaled_stats` recomputes under one ``lax.cond`` (:func:`_recompute_cond`)."""
  packing = _Packing.of(pieces, leaves)
  sums = {k: _plain_sq(leaves[pc.path], _layout(pc.slots[0]), pc.block) for k, pc in pieces.items()}
  safe = [
    lambda x, pc=pc: [v.ravel() for v in _scaled_log_stats(x, _layout(pc.slots[0]), pc.block)]
    for pc in pieces.values()
  ]
  return _checked(
    plan, pieces, leaves, limit, packing, jnp.log(packing.pack(sums)), safe, _recompute_cond
  )


def _scaled_stats(x: jax.Array, slot: Slot, block: Span | None) -> tuple[jax.Array, jax.Array]:
  """``(log sum x**2, log max |x|)`` per group of ``slot`` off a mesh, scale-safe, from one
  read of the piece ``block`` of ``x`` (in its compute dtype): each group's ``(s, q)`` (see
  the module docstring), a reduction whose combiner divides, so XLA emits it as a scalar
  loop. Every entry starts as ``(|x|, 1)``: a zero one then counts nothing once combined,
  and a group whose ``s`` is 0 has ``log s = -inf`` whatever its ``q``."""
  magnitude = jnp.abs(_restrict(x.astype(compute_dtype(x.dtype)), block))
  top, q = _group_reduce([magnitude, jnp.ones_like(magnitude)], slot, _scaled)
  if slot.axis is None:
    top, q = top[..., None], q[..., None]
  log_max = jnp.log(top)
  log_sq = 2 * log_max + jnp.log(q)
  return jnp.where(jnp.isnan(log_sq), jnp.inf, log_sq), log_max  # a NaN entry


def _layout(slot: Slot) -> Slot:
  """``slot`` without the instance it belongs to: what its statistics depend on."""
  return dataclasses.replace(slot, key="", sign=1)


def _reduce(v: jax.Array, slots: Sequence[Slot], axis_name: AxisName, op: str) -> jax.Array:
  """``v`` reduced per group of every slot of one leaf, ``op`` ``"sum_sq"`` (its squares
  summed) or ``"max"`` (of ``v >= 0``): the leaf's stacked axes (those
  of its slot with the most) plus one axis per slot (of size 1 for a whole-tensor slot),
  replicated.

  With several slots (a leaf in overlapping pairs) the sum is taken per combination of
  groups, as one contraction with each grouped axis's one-hot membership; the ``max``
  is then bounded by the smallest of the per-slot maxima, which suffices for the
  overflow bounds it serves.
  """
  stacked = stacked_axes(slots)
  if len(slots) == 1:
    (r,) = _group_reduce([v], slots[0], _sum if op == "sum_sq" else _max, op == "sum_sq")
    r = replicated(r if slots[0].axis is not None else r[..., None])
    collective = jax.lax.psum if op == "sum_sq" else jax.lax.pmax
    return collective(r, axis_name) if axis_name else r  # () names no axis: nothing to sum
  if op == "max":
    return functools.reduce(
      jnp.minimum,
      [along_slot(_reduce(v, (s,), axis_name, op), i, slots) for i, s in enumerate(slots)],
    )
  operands, out = [jnp.square(v), list(range(v.ndim))], list(stacked)
  for s in slots:
    if s.axis is None:
      continue
    if s.per_index(v.shape[s.axis]):
      out.append(s.axis)
    else:
      operands += [jnp.asarray(s.membership(v.shape[s.axis]), v.dtype), [s.axis, v.ndim + len(out)]]
      out.append(v.ndim + len(out))
  r = jnp.einsum(*operands, out, precision=jax.lax.Precision.HIGHEST)
  for i, s in enumerate(slots):
    if s.axis is None:
      r = jnp.expand_dims(r, len(stacked) + i)
  r = replicated(r)
  return jax.lax.psum(r, axis_name) if axis_name else r


def _fast_log_sq(x: jax.Array, slots: Sequence[Slot], axis_name: AxisName):
  """``log sum x**2`` per group from one float32 pass. Inexact or infinite when the
  squares over- or underflow."""
  return jnp.log(_reduce(x.astype(compute_dtype(x.dtype)), slots, axis_name, "sum_sq"))


def _exponent(x: jax.Array) -> jax.Array:
  """``e`` with ``x = m 2**e``, ``0.5 <= m < 1``, for a normal ``x >= 0`` (``frexp``'s), read
  from its exponent bits: the smallest normal's for 0 and subnormals (then ``x 2**-e < 1``
  still). Three operations where ``jnp.frexp`` traces about forty: the safe passes take it
  per leaf, and XLA's compile time follows the program's size."""
  info = jnp.finfo(x.dtype)
  bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"int{info.bits}"))
  field = (bits >> info.nmant) & ((1 << info.nexp) - 1)
  return (jnp.maximum(field, 1) - (info.maxexp - 2)).astype(jnp.int32)


def _power_of_two(k: jax.Array, dtype) -> jax.Array:
  """``2.0**k`` in ``dtype``, exactly, for integers ``k`` in its normal range (the biased
  exponent written into the bits, as ``jnp.ldexp(1, k)`` does in many more operations)."""
  info = jnp.finfo(dtype)
  ints = jnp.dtype(f"int{info.bits}")
  return jax.lax.bitcast_convert_type((k.astype(ints) + (info.maxexp - 1)) << info.nmant, dtype)


def _safe_stats(x: jax.Array, slots: Sequence[Slot], axis_name: AxisName):
  """``(log sum x**2, log max |x|)`` per group in two passes: the group maxima, then the
  squares of entries scaled by their copy's largest finite group maximum (to the nearest
  power of two), which cannot overflow. A non-finite group's sum is +inf and a zero
  group's -inf: both mean "do not balance"."""
  stacked = stacked_axes(slots)
  dtype = compute_dtype(x.dtype)
  x = x.astype(dtype)
  group_max = _reduce(jnp.abs(x), slots, axis_name, "max")  # inf or NaN where an entry is
  scale = jnp.max(
    jnp.where(jnp.isfinite(group_max), group_max, 0),
    axis=tuple(range(len(stacked), group_max.ndim)),
  )
  # Divide by 2**e, the scale's binary exponent, as two exact multiplies by normal
  # powers of two: 1 / scale itself is subnormal near the dtype's maximum, and flushed.
  e = _exponent(scale)
  per_copy = e.reshape(tuple(n if i in stacked else 1 for i, n in enumerate(x.shape)))
  half = per_copy >> 1  # floor(e / 2), in one operation where // traces a dozen
  x = x * _power_of_two(-half, dtype)
  x = x * _power_of_two(half - per_copy, dtype)
  log_scale = (e.reshape(e.shape + (1,) * len(slots)) * np.log(2.0)).astype(dtype)
  sq = _reduce(x, slots, axis_name, "sum_sq")
  return jnp.where(jnp.isfinite(sq), 2 * log_scale + jnp.log(sq), jnp.inf), jnp.log(group_max)


def _restrict(x: jax.Array, block: Span | None) -> jax.Array:
  """``x`` with zeros outside ``block``: a mask along the block axis, which keeps every
  axis of ``x`` (and its sharding) and fuses into the reduction that reads it."""
  if block is None:
    return x
  axis, start, stop = block
  index = jax.lax.broadcasted_iota(
    jnp.int32, tuple(n if i == axis else 1 for i, n in enumerate(x.shape)), axis
  )
  return jnp.where((index >= start) & (index < stop), x, jnp.zeros((), x.dtype))


Stats = dict[tuple, tuple[jax.Array, jax.Array]]


class _Packing(NamedTuple):
  """The statistics of all pieces as one flat float32 vector, each piece a static span
  (its shape: its stacked axes, then one axis per slot)."""

  shapes: dict[tuple, tuple[int, ...]]
  spans: list[tuple[int, int]]

  @classmethod
  def of(cls, pieces: dict[tuple, Piece], leaves: dict[str, Any]) -> _Packing:
    shapes = {
      k: tuple(leaves[piece.path].shape[i] for i in stacked_axes(piece.slots))
      + tuple(1 if s.axis is None else s.groups for s in piece.slots)
      for k, piece in pieces.items()
    }
    ends = np.cumsum([int(np.prod(s)) for s in shapes.values()])
    return cls(shapes, [(int(e - np.prod(s)), int(e)) for s, e in zip(shapes.values(), ends)])

  def pack(self, values: dict) -> jax.Array:
    return jnp.concatenate([jnp.ravel(values[p]).astype(jnp.float32) for p in self.shapes])

  def unpack(self, log_sq: jax.Array, log_max: jax.Array) -> Stats:
    return {
      p: (log_sq[a:b].reshape(s), log_max[a:b].reshape(s))
      for (p, s), (a, b) in zip(self.shapes.items(), self.spans)
    }


def _trust(plan: Plan, limit: dict, piece: tuple) -> tuple[float, float]:
  """The range of a piece's float32 ``log sum x**2`` that can be kept: neither so small
  that it may have lost digits to underflow (on a leaf whose norm the balancing
  minimises), nor so large that a factor bounded by it could overflow a dtype of its pair
  (``limit``)."""
  lowest = np.log(_SMALLEST_SAFE_SUM) if piece[0] in plan.counted else -np.inf
  return float(lowest), float(2 * limit[piece])


def _trusted(plan: Plan, limit: dict, packing: _Packing, log_sq: jax.Array) -> jax.Array:
  """Where the packed float32 ``log_sq`` lies within its piece's :func:`_trust` (NaN
  does not)."""
  bounds = {p: _trust(plan, limit, p) for p in packing.shapes}

  def full(i):  # the lower (0) or upper (1) bound of each statistic
    return packing.pack({p: np.full(s, bounds[p][i]) for p, s in packing.shapes.items()})

  return (log_sq >= full(0)) & (log_sq <= full(1))


Recompute = Callable[[jax.Array], list[jax.Array]]  # one leaf -> its piece's flat statistics


def _recompute_traced(
  packing: _Packing,
  safe: list[Recompute],
  operands: list[jax.Array],
  trusted: jax.Array,
  log_sq: jax.Array,
  log_max: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """The untrusted pieces recomputed one at a time by a ``lax.while_loop`` over a
  ``lax.switch`` on the piece: no iteration in the common case, and the compiled code
  holds the safe passes of one piece, not of all."""
  spans = packing.spans
  leaf_of = jnp.asarray(np.repeat(np.arange(len(spans)), [b - a for a, b in spans]))
  starts, stops = (jnp.asarray(v) for v in zip(*spans))
  width = max(b - a for a, b in spans)
  branches = [
    lambda xs, i=i: [jnp.pad(v, (0, width - v.size)) for v in safe[i](xs[i])]
    for i in range(len(spans))
  ]

  def body(carry):  # the first piece still untrusted, recomputed and written into its span
    bad, log_sq, log_max = carry
    leaf = leaf_of[jnp.argmax(bad)]
    index = jnp.arange(bad.size)
    span = (index >= starts[leaf]) & (index < stops[leaf])

    def place(v):  # v at its span, padded with zeros: typed as v (on its Explicit mesh even
      # outside jax.set_mesh, where jax 0.11+ make new zeros on no mesh)
      return jax.lax.dynamic_slice(jnp.pad(v, bad.size), (bad.size - starts[leaf],), (bad.size,))

    sq, top = jax.lax.switch(leaf, branches, operands)
    return bad & ~span, jnp.where(span, place(sq), log_sq), jnp.where(span, place(top), log_max)

  _, log_sq, log_max = jax.lax.while_loop(
    lambda c: jnp.any(c[0]), body, (~trusted, log_sq, log_max)
  )
  return log_sq, log_max


def _recompute_all(
  packing: _Packing,
  safe: list[Recompute],
  operands: list[jax.Array],
  trusted: jax.Array,
  log_sq: jax.Array,
  log_max: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """Every piece recomputed, kept where untrusted: where collectives inside a loop could be
  overtaken by later ones (see :func:`~saggs_jax._src.numerics.ordered_control_flow`), and in
  the branch of :func:`_recompute_cond`."""
  del packing
  sq, top = (jnp.concatenate(v) for v in zip(*(f(x) for f, x in zip(safe, operands))))
  return jnp.where(trusted, log_sq, sq), jnp.where(trusted, log_max, top)


def _recompute_cond(
  packing: _Packing,
  safe: list[Recompute],
  operands: list[jax.Array],
  trusted: jax.Array,
  log_sq: jax.Array,
  log_max: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """:func:`_recompute_all` under one ``lax.cond`` that runs it only when some group is
  untrusted: on a GPU each ``lax.cond`` waits for its predicate on the host (XLA's
  ConditionalThunk), so one per piece was a sync per piece."""
  return jax.lax.cond(
    ~jnp.all(trusted),
    lambda xs: _recompute_all(packing, safe, xs, trusted, log_sq, log_max),
    lambda xs: (log_sq, log_max),
    operands,
  )


def _recompute_eager(
  packing: _Packing,
  safe: list[Recompute],
  operands: list[jax.Array],
  trusted: jax.Array,
  log_sq: jax.Array,
  log_max: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """The untrusted pieces recomputed, known on the host: no loop is compiled."""
  for f, x, (a, b) in zip(safe, operands, packing.spans):
    if not np.all(np.asarray(trusted[a:b])):
      sq, top = f(x)
      log_sq, log_max = log_sq.at[a:b].set(sq), log_max.at[a:b].set(top)
  return log_sq, log_max


def _limits(plan: Plan, leaves: dict[str, Any]) -> dict[tuple, float]:
  """Per piece, the log of the smallest dtype maximum among the leaves of its instances."""
  dtype_max = {}
  for path, slots in plan.slots.items():
    for s in slots:
      dtype_max[s.key] = min(dtype_max.get(s.key, np.inf), log_dtype_max(leaves[path].dtype))
  return {k: min(dtype_max[s.key] for s in piece.slots) for k, piece in plan.pieces.items()}


def _two_pass_stats(
  plan: Plan, pieces: dict[tuple, Piece], leaves: dict, limit: dict, axis_name: AxisName
) -> Stats:
  """The statistics of ``pieces`` from one float32 pass each, those whose sums overflowed,
  underflowed or met a non-finite entry (or so large a norm that a factor bounded by it
  could overflow a dtype of its pair) recomputed by the scale-safe passes
  (:func:`_safe_stats`) by :func:`_checked`: under jit by :func:`_recompute_traced` (by
  :func:`_recompute_all` where control flow must hold no collective)."""
  packing = _Packing.of(pieces, leaves)
  log_sq = packing.pack(
    {
      k: _fast_log_sq(_restrict(leaves[pc.path], pc.block), pc.slots, axis_name)
      for k, pc in pieces.items()
    }
  )
  safe = [
    lambda x, pc=pc: [
      v.ravel().astype(jnp.float32)
      for v in _safe_stats(_restrict(x, pc.block), pc.slots, axis_name)
    ]
    for pc in pieces.values()
  ]
  recompute = _recompute_traced if ordered_control_flow() else _recompute_all
  return _checked(plan, pieces, leaves, limit, packing, log_sq, safe, recompute)


def _checked(
  plan: Plan,
  pieces: dict[tuple, Piece],
  leaves: dict,
  limit: dict,
  packing: _Packing,
  log_sq: jax.Array,
  safe: list[Recompute],
  recompute: Callable,
) -> Stats:
  """The statistics of ``pieces`` from their packed first-pass ``log_sq``: kept where it lies
  within :func:`_trust` (the bound on the largest magnitude there half of it: the norm bounds
  every entry), elsewhere (a sum that over- or underflowed, met a non-finite entry, or a norm
  past a dtype of its pair) recomputed by ``safe``: under jit by ``recompute``, called
  eagerly by :func:`_recompute_eager`, which compiles nothing."""
  trusted = _trusted(plan, limit, packing, log_sq)
  if not isinstance(trusted, core.Tracer) and trusted.is_fully_addressable:
    recompute = _recompute_eager
  # A piece is masked inside its branch: the leaf itself is the operand, never a copy.
  operands = [leaves[pc.path] for pc in pieces.values()]
  return packing.unpack(*recompute(packing, safe, operands, trusted, log_sq, 0.5 * log_sq))


def leaf_stats(plan: Plan, params: Any, axis_name: AxisName = None) -> Stats:
  """Per declared piece (a leaf, or a part of it between block boundaries) ``(log sum of
  squares, log of a bound on the largest magnitude)`` per group of each of its slots
  (its stacked axes, then one axis per slot, of size 1 for a whole-tensor slot), in
  float32; +inf for a group with a non-finite entry, -inf for a zero one.

  The bound is half the log squared norm (the norm bounds every entry) while the norm
  fits the smallest dtype of the piece's pairs, and the largest magnitude beyond it:
  a factor bounded by the norm could then not move the group at all. A piece in one
  instance off a mesh takes :func:`_one_pass_stats`, others :func:`_two_pass_stats`.

  Example:
    >>> import jax.numpy as jnp, saggs_jax as saggs
    >>> from saggs_jax._src.norms import leaf_stats
    >>> params = {"q": jnp.full((2, 4), 1e30), "k": jnp.ones((2, 4))}  # squares overflow
    >>> plan = saggs._src.plan.resolve([saggs.Pair("q", "k", axes=(1, 1), groups=2)], params)
    >>> log_sq, _ = leaf_stats(plan, params)["q", None]
    >>> [round(float(v) / 2.302585, 3) for v in log_sq]  # log10 ||q_g||**2 = log10 4e60
    [60.602, 60.602]
  """
  if not plan.slots:  # no pairs (an empty discover result): nothing to measure
    return {}
  leaves = dict(paths.leaves_with_paths(params))
  limit = _limits(plan, leaves)
  out: Stats = {}
  rest: dict[tuple, Piece] = {}
  single: dict[tuple, Piece] = {}
  for k, pc in plan.pieces.items():
    x = leaves[pc.path]
    if len(pc.slots) == 1 and not _on_mesh(x):
      single[k] = pc
    elif isinstance(x, core.Tracer) and not _on_mesh(x):
      # In overlapping pairs, under jit: the safe passes alone. A first pass with the
      # untrusted pieces recomputed under control flow (as on a mesh) compiled in twice
      # their time (bench/bench_compile.py), for one read less on the updates that balance.
      log_sq, log_max = _safe_stats(_restrict(x, pc.block), pc.slots, axis_name)
      out[k] = log_sq.astype(jnp.float32), log_max.astype(jnp.float32)
    else:
      rest[k] = pc
  if single:
    out.update(_one_pass_stats(plan, single, leaves, limit))
  if rest:
    out.update(_two_pass_stats(plan, rest, leaves, limit, axis_name))
  return {
    k: (out[k][0], jnp.where(out[k][0] <= 2 * limit[k], 0.5 * out[k][0], out[k][1]))
    for k in plan.pieces
  }


def stacked_axes(slots: Sequence[Slot]) -> tuple[int, ...]:
  """The copy axes kept in a leaf's statistics, in order: those of all its slots, a slot
  without some treating the others' copies as part of its groups (a norm gain shared
  by stacked experts)."""
  return tuple(sorted(set().union(*(s.stacked for s in slots))))


def along_slot(u: jax.Array, i: int, slots: Sequence[Slot]) -> jax.Array:
  """Log-factors of one instance (``stacked_shape (+ (groups,))``) laid out on the
  statistics of a leaf (see :func:`leaf_stats`) along slot ``i``."""
  copies = u.shape[: len(slots[i].stacked)]
  sizes = dict(zip(slots[i].stacked, copies))
  return u.reshape(
    tuple(sizes.get(a, 1) for a in stacked_axes(slots))
    + (1,) * i
    + (-1,)
    + (1,) * (len(slots) - 1 - i)
  )
