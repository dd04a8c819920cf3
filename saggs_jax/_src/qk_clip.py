"""QK-clip (MuonClip, Kimi K2) that clips the gauge-invariant product and transports its gauge.

Kimi K2 bounds attention logits after each step: for every head h whose largest
pre-softmax logit ``S_h`` on the batch exceeds ``τ``, with ``γ_h = τ / S_h``,
``W_q^h ← W_q^h·γ_h^α`` and ``W_k^h ← W_k^h·γ_h^(1−α)`` (α = 1/2), momentum
untouched. Only the product ``q·k`` is clipped; the split is a gauge:

  (γ^α, γ^(1−α)) = (γ^½, γ^½) ∘ (γ^(α−½), γ^(½−α)),

and the second factor is exactly the Q/K symmetry that :func:`saggs_jax.saggs`
balances. This stage applies the first factor as K2 does (moments untouched)
and the second as a symmetry move (moments of the stages before it transported
by their degree, as SAGGS does), so a clip with any α is the α = 1/2 clip moved
along its orbit; with hard SAGGS the trajectory does not depend on α.

Under GQA a key head is shared by the ``n`` query heads of its group. Each
query head's ``γ_h`` multiplies its own ``W_q`` rows (exact per head); the
split of the group's common part is the per-KV-head gauge,
``W_q^h ← W_q^h·γ_h·Γ^(α−1)``, ``W_k ← W_k·Γ^(1−α)`` with ``Γ`` the geometric
mean of the group's ``γ_h``. With one query head per KV head (MHA) this is K2's
clip.

:func:`max_logits` measures ``S_h`` inside the attention code, from the same
``q`` and ``k`` the forward pass uses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import cast

import jax
import jax.numpy as jnp
import optax

from saggs_jax._src.pairs import Pair
from saggs_jax._src.plan import Plan
from saggs_jax._src.stage import (
  Correction,
  Stage,
  SymmetryTransformation,
  stage_pairs,
  symmetry_stage,
)
from saggs_jax._src.validation import check_number


def max_logits(
  q: jax.Array,
  k: jax.Array,
  *,
  scale: float | None = None,
  mask: jax.Array | None = None,
  is_causal: bool = False,
) -> jax.Array:
  """The largest pre-softmax logit ``q·k·scale`` of each query head, over batch and positions.

  Takes ``q`` (batch, q_len, heads, head_dim) and ``k`` (batch, kv_len,
  kv_heads, head_dim) as :func:`jax.nn.dot_product_attention` does (after RoPE,
  before the softmax), query head h reading KV head ``h // (heads // kv_heads)``.
  Masked positions (``mask`` False, broadcastable to (batch, heads, q_len,
  kv_len), or above the diagonal with ``is_causal``) are excluded; a head
  whose every logit is masked gets ``-inf`` (never clipped). The result, of
  shape (heads,), is in float32 and carries no gradient: call it beside the
  attention it measures and hand it to :func:`qk_clip` through ``update``. It
  costs one more ``q·kᵀ`` (no backward, no second forward pass); attention code
  that forms the logits itself can take their masked max directly.

  From flax.nnx, ``self.sow(nnx.Intermediate, "max_logits", max_logits(q, k))``;
  from linen, ``self.sow("intermediates", "max_logits", max_logits(q, k))``.
  Scanned layers then stack them to (layers, heads).

  Args:
    q: queries, (batch, q_len, heads, head_dim).
    k: keys, (batch, kv_len, kv_heads, head_dim); kv_heads divides heads.
    scale: logit scale; default ``1 / sqrt(head_dim)``.
    mask: boolean, True where a query may attend.
    is_causal: mask positions after the query's (query i at the end of the keys).

  Example:
    >>> import jax.numpy as jnp, saggs_jax as saggs
    >>> q = jnp.ones((1, 2, 2, 4)).at[:, :, 1].set(2.0)  # 2 heads, 2 positions
    >>> k = jnp.ones((1, 2, 1, 4)).at[:, 1].set(3.0)     # 1 KV head; key 1 is large
    >>> saggs.max_logits(q, k, is_causal=True)           # query 1 sees key 1: 4·3·h/2
    Array([ 6., 12.], dtype=float32)
    >>> saggs.max_logits(q, k, mask=jnp.array([[True, False], [True, False]]))
    Array([2., 4.], dtype=float32)
  """
  if q.ndim != 4 or k.ndim != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
    raise ValueError(
      f"max_logits takes q (batch, q_len, heads, head_dim) and k (batch, kv_len,"
      f" kv_heads, head_dim); got q {q.shape} and k {k.shape}."
    )
  batch, q_len, heads, head_dim = q.shape
  kv_heads, kv_len = k.shape[2], k.shape[1]
  if heads % kv_heads:
    raise ValueError(f"max_logits: {kv_heads} KV heads do not divide {heads} query heads.")
  dtype = jnp.promote_types(q.dtype, jnp.float32)
  q = jax.lax.stop_gradient(q).astype(dtype).reshape(batch, q_len, kv_heads, -1, head_dim)
  k = jax.lax.stop_gradient(k).astype(dtype)
  logits = jnp.einsum("bqgnd,bkgd->bgnqk", q, k).reshape(batch, heads, q_len, kv_len)
  logits = logits * (head_dim**-0.5 if scale is None else scale)
  keep = jnp.ones((1, 1, q_len, kv_len), bool)
  if is_causal:
    keep = keep & jnp.tril(jnp.ones((q_len, kv_len), bool), kv_len - q_len)
  if mask is not None:
    keep = keep & jnp.broadcast_to(mask, (batch, heads, q_len, kv_len))
  return jnp.max(jnp.where(keep, logits, -jnp.inf), axis=(0, 2, 3))


def _kv_heads(inst, heads: int) -> int:
  """The KV heads of an instance: its declared groups, else (one group per entry, the Q and
  K axes of one size: MHA) one per query head."""
  return heads if inst.pair.groups is None else inst.factor_shape[-1]


def _heads_plan(plan: Plan, heads: Mapping[str, int]) -> Plan:
  """``plan`` with each instance's Q members and followers grouped per query head (key
  ``<key>@q``) and its K side turned into a +1 slot of its own grouped per KV head (key
  ``<key>@k``), so that one :func:`scale_tree` with power 1 applies both multipliers."""
  slots: dict[str, tuple] = {}
  for inst in plan.instances:
    for name in inst.members_a + inst.followers_a + inst.members_b + inst.followers_b:
      slot = plan.slot(name, inst.key)
      if slot.sign > 0:
        slot = dataclasses.replace(slot, key=f"{inst.key}@q", groups=heads[inst.key])
      else:
        kv = _kv_heads(inst, heads[inst.key])
        slot = dataclasses.replace(slot, key=f"{inst.key}@k", sign=1, groups=kv)
      path = plan.part(name).path
      slots[path] = slots.get(path, ()) + (slot,)
  return Plan((), slots, plan.shapes, plan.parts)


def _head_axis_size(plan: Plan, name: str, key: str) -> int:
  """The entries of a member's group axis (within its block for a fused leaf)."""
  slot = plan.slot(name, key)
  start, stop = slot.tiled(plan.shapes[plan.part(name).path][cast(int, slot.axis)])
  return stop - start


def _checked_logits(plan: Plan, extra_args: dict, num_heads: int | None) -> dict[str, jax.Array]:
  """The ``max_logits`` extra argument, one entry per instance keyed by its Q member, each
  ``stacked_shape + (heads,)``, the heads those the pair declares (``num_heads`` for a pair
  with one group per entry); raises a ValueError naming what is missing or wrong."""
  wanted = {inst.a: inst for inst in plan.instances}
  spelled = ", ".join(
    f"{a!r}: {i.factor_shape[: len(i.pair.copy_axes)] + ('heads',)}" for a, i in wanted.items()
  )
  logits = extra_args.get("max_logits")
  if logits is None:
    raise ValueError(
      "qk_clip needs the measured maximum logits: call update(grads, state, params,"
      f" max_logits={{{spelled}}}), each the per-head max of q·k·scale (saggs_jax.max_logits)."
    )
  if not isinstance(logits, Mapping) or set(logits) != set(wanted):
    got = sorted(logits) if isinstance(logits, Mapping) else type(logits).__name__
    raise ValueError(
      f"qk_clip: max_logits must map each Q/K pair instance's query path to its"
      f" per-head max logits, {{{spelled}}}; got keys {got}."
    )
  out = {}
  for a, inst in wanted.items():
    slot = plan.slot(a, inst.key)
    if slot.axis is None:
      raise ValueError(
        f"qk_clip: {inst.pair.label} has no group axis; declare the Q/K pair"
        " with axes= (the head axis of each side) and groups= the KV heads."
      )
    s, stacked = logits[a], inst.factor_shape[:-1]
    q_size, k_size = (_head_axis_size(plan, name, inst.key) for name in (a, inst.b))
    if inst.pair.groups is None:  # one group per entry: the heads are not declared
      if num_heads is None or q_size % num_heads or k_size != q_size:
        raise ValueError(
          f"qk_clip: {inst.pair.label} has one group per entry and declares no heads (num_heads"
          f" {num_heads}, {q_size} query and {k_size} key entries). Pass num_heads= the query"
          " heads, dividing both, or declare groups= the KV heads."
        )
      heads, rule = num_heads, f"heads = num_heads = {num_heads}"
    elif (q_size * inst.factor_shape[-1]) % k_size:
      raise ValueError(
        f"qk_clip: {inst.pair.label} declares {inst.factor_shape[-1]} KV groups over"
        f" {k_size} key entries, which leaves no whole number of query heads in the"
        f" {q_size} entries of the query head axis."
      )
    else:  # head_dim = k_size / groups, as many query heads as fill the query axis
      heads = q_size * inst.factor_shape[-1] // k_size
      rule = f"heads = {heads}: {q_size} query entries, {inst.factor_shape[-1]} KV groups"
    shape = tuple(jnp.shape(s))
    if len(shape) != len(stacked) + 1 or shape[:-1] != stacked or shape[-1] != heads:
      raise ValueError(
        f"qk_clip: max_logits[{a!r}] has shape {shape}, not {stacked} + (heads,) with {rule}."
        " Pass one max logit per query head."
      )
    out[inst.key] = jnp.asarray(s, jnp.float32)
  return out


def _clip_factors(plan: Plan, logits: dict[str, jax.Array], tau: float, alpha: float):
  """``(clip factors for the heads plan, gauge factors for plan)``: ``γ_h = τ / S_h`` where
  ``S_h > τ`` (else 1, and 1 for a non-finite ``S_h``), each query head's ``γ_h·Γ^(α−1)``,
  each KV head's ``Γ^(1−α)``, and the gauge ``Γ^(α−½)`` that moves the moments."""
  clip, gauge = {}, {}
  for inst in plan.instances:
    s = logits[inst.key]
    log_gamma = jnp.where(jnp.isfinite(s) & (s > tau), math.log(tau) - jnp.log(s), 0.0)
    kv, groups = _kv_heads(inst, s.shape[-1]), inst.factor_shape[-1]
    log_g = log_gamma.reshape(s.shape[:-1] + (kv, -1)).mean(-1)  # log Γ per KV head
    per_head = jnp.repeat(log_g, s.shape[-1] // kv, axis=-1)
    clip[f"{inst.key}@q"] = jnp.exp(log_gamma + (alpha - 1) * per_head)
    clip[f"{inst.key}@k"] = jnp.exp((1 - alpha) * log_g)
    # The gauge moves the pair's own groups (one per entry when none are declared).
    gauge[inst.key] = jnp.exp((alpha - 0.5) * jnp.repeat(log_g, groups // kv, axis=-1))
  return clip, gauge


def qk_clip(
  pairs: Sequence[Pair], tau: float = 100.0, alpha: float = 0.5, num_heads: int | None = None
) -> SymmetryTransformation:
  """QK-clip (MuonClip) per query head, its gauge transported like a Q/K symmetry.

  With ``γ_h = τ / S_h`` for the heads whose measured max logit ``S_h`` exceeds ``τ`` (else
  1) and ``Γ`` the geometric mean of ``γ_h`` over a KV head's query heads, ``p + u`` becomes

    W_q^h ← W_q^h·γ_h·Γ^(α−1),   W_k^g ← W_k^g·Γ^(1−α)   (biases with their kernels),

  scaling head h's logits by ``γ_h``; the ``Γ^(α−½)`` part transports earlier stages' moments
  as a Q/K symmetry. Chain it last; ``update`` takes ``max_logits={query path: (..., heads)}``
  measured on ``params`` (:func:`max_logits`). Semantics, composition: ``docs/qk_clip.md``.

  Args:
    pairs: the Q/K :class:`~saggs_jax.Pair` declarations, grouped by KV head
      (``presets.llama(...)[0]``, ``discover``'s Q/K pairs, ...).
    tau: the logit bound τ > 0 (default 100, K2's).
    alpha: the split, in [0, 1] (default 0.5); the product clipped does not depend on it.
    num_heads: the query heads, for a pair with one group per channel (``groups=None``);
      default None: read from the declared KV groups.

  Returns:
    A :class:`~saggs_jax.SymmetryTransformation`.

  Raises:
    ValueError: ``tau``, ``alpha`` or ``num_heads`` out of range; α ≠ 1/2 outside
      :func:`saggs_jax.chain` (at ``init``); ``max_logits`` missing or misshapen (at ``update``).

  References:
    Kimi Team, *Kimi K2: Open Agentic Intelligence*, arXiv:2507.20534 (2025), MuonClip.

  Example:
    >>> import jax.numpy as jnp, optax, saggs_jax as saggs
    >>> params = {"q": jnp.ones((4, 2)), "k": jnp.ones((4, 2))}  # (d, heads·head_dim), 2 heads
    >>> qk = saggs.Pair("q", "k", axes=(1, 1), groups=2)
    >>> tx = saggs.chain(optax.sgd(0.0), saggs.qk_clip([qk], tau=1.0))
    >>> state = tx.init(params)
    >>> logits = {"q": jnp.array([4.0, 0.5])}  # head 0 over τ: γ = 1/4
    >>> updates, state = tx.update(params, state, params, max_logits=logits)
    >>> optax.apply_updates(params, updates)["q"][0]  # γ^½ on head 0's Q, head 1 untouched
    Array([0.5, 1. ], dtype=float32)
  """
  pairs = stage_pairs(pairs, "saggs_jax.qk_clip")
  check_number("tau", tau, lambda t: 0 < t < math.inf, "in (0, inf)", integer=False)
  check_number("alpha", alpha, lambda a: 0 <= a <= 1, "in [0, 1]", integer=False)
  if num_heads is not None:
    check_number("num_heads", num_heads, lambda n: n >= 1, ">= 1", integer=True)

  def after(state, params, updates, plan, **extra_args):
    """The clip of ``params + updates`` per query head, and its Q/K gauge."""
    del updates  # the clip reads the logits measured on params, not the step
    logits = _checked_logits(plan, extra_args, num_heads)
    heads = {inst.key: logits[inst.key].shape[-1] for inst in plan.instances}
    factors, gauge = _clip_factors(plan, logits, tau, alpha)
    return Correction(_heads_plan(plan, heads), factors, gauge), state

  # Outside saggs_jax.chain only the split alpha = 1/2 is exact: its gauge moves no moment.
  stage = Stage(
    "saggs_jax.qk_clip", pairs, lambda params: optax.EmptyState(), after=after, alone=alpha == 0.5
  )
  return symmetry_stage(stage)
