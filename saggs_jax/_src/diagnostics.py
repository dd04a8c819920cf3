"""Watching and checking symmetries: imbalance metrics and an invariance check."""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from saggs_jax._src.balance import log_norms
from saggs_jax._src.pairs import Block, Pair, per_copy_axis
from saggs_jax._src.plan import Instance, Plan, resolve
from saggs_jax._src.scaling import scale_tree


class MootPairWarning(UserWarning):
  """A declared pair is exact, but each side is scale-invariant on its own (QK-norm): balancing
  it changes nothing that matters."""


def imbalance(params: Any, pairs: Sequence[Pair]) -> dict[str, jax.Array]:
  """``log(||A_g|| / ||B_g||)`` for every pair instance and group.

  Keys are pair instances (``"a_path|b_path"``), values have shape
  ``stacked_shape + (groups,)``. Zero after hard SAGGS; ``log 64 ~ 4.16`` for
  Q scaled by 8 and K by 1/8 from a balanced start. Jit-friendly.

  Example:
    >>> import jax.numpy as jnp, saggs_jax as saggs
    >>> params = {"q": jnp.full((4, 2), 8.0), "k": jnp.ones((4, 2))}
    >>> float(saggs.imbalance(params, [saggs.Pair("q", "k")])["q|k"])  # log 8
    2.079441...
  """
  plan = resolve(pairs, params)
  return {k: a - b for k, (a, b) in log_norms(plan, params).items()}


def check_symmetry(
  apply_fn: Callable[..., Any],
  params: Any,
  pairs: Sequence[Pair],
  *inputs: Any,
  key: jax.Array | None = None,
  rtol: float | None = None,
  atol: float = 0.0,
  low: float = 0.25,
  high: float = 4.0,
) -> dict[str, float]:
  """Checks that every declared pair is an exact symmetry of ``apply_fn``.

  Each pair instance in turn gets random factors in ``[low, high]``; the outputs
  ``apply_fn(params, *inputs)`` before and after must agree within
  ``atol + rtol * max|output|``, with matmuls at full precision. A failing instance is
  rescaled further to find why (rounding noise, a normalisation between the sides, a
  coarser grouping or another follower that would be exact, a function between the
  sides that is not positively homogeneous), and the error names that cause. A pair
  that is exact but moot (each side alone leaves the output put, as Q/K under a
  per-head QK-norm) warns. docs/declaring.md describes each diagnosis.

  Args:
    apply_fn: ``apply_fn(params, *inputs)`` returning an array or a pytree.
    params: the parameter tree the pairs are declared on.
    pairs: the :class:`~saggs_jax.Pair` declarations.
    *inputs: the model inputs.
    key: PRNG key for the factors (default ``PRNGKey(0)``).
    rtol: relative tolerance; default 1e-4 for float32 outputs, 3e-2 for 16-bit ones.
    atol: absolute tolerance.
    low, high: range of the random factors.

  Returns:
    The relative deviation measured for each pair instance.

  Raises:
    ValueError: naming the first pair instance whose transform changes the output
      beyond tolerance, what was measured and the likely cause.

  Warns:
    MootPairWarning: once per pair that is exact but moot.

  Example:
    >>> import jax, jax.numpy as jnp, saggs_jax as saggs
    >>> def g(p, x): return jax.nn.gelu(x @ p["up"]) @ p["down"]
    >>> params = {"up": jnp.ones((3, 5)), "down": jnp.ones((5, 2))}
    >>> saggs.check_symmetry(g, params, [saggs.Pair("up", "down", axes=(1, 0))], jnp.ones((1, 3)))
    Traceback (most recent call last):
    ...
    ValueError: Pair('up', 'down') is not a symmetry of the model: ... Likely cause: ...
    not positively homogeneous sits between 'up' and 'down' ...
  """
  plan = resolve(pairs, params)
  rng = jax.random.PRNGKey(0) if key is None else key
  probe = Probe(apply_fn, params, inputs, rtol=rtol, atol=atol)
  deviations, moot = {}, set()
  for inst in plan.instances:
    rng, sub = jax.random.split(rng)
    factors = jax.random.uniform(sub, inst.factor_shape, jnp.float32, low, high)
    deviations[inst.key] = probe(_only(plan, inst), factors)
    if not deviations[inst.key] <= probe.tolerance:  # NaN fails too
      measured, cause = _diagnose(probe, plan, inst, sub, max(high, 1 / low))
      error = ValueError(
        f"{inst.pair.label} is not a symmetry of the model: rescaling {_side(inst.members_a)} by"
        f" c and {_side(inst.members_b)} by 1/c (c in [{low}, {high}]) changed the output by"
        f" {deviations[inst.key]:.3g} (tolerance {probe.tolerance:.3g}). Diagnosis below."
      )
      # The diagnosis is long (measurements, then the likely cause and its fix): a note, which
      # the traceback prints after the message (PEP 678).
      error.add_note(f"Measured: {'; '.join(measured)}. Likely cause: {cause}")
      raise error
    # Moot only if each side alone, by per-group factors (never all 1), is invisible: a norm
    # after the whole product (a post-norm) hides one common factor, not the groups' relative
    # ones.
    if inst.pair.label not in moot and all(
      probe(_only(plan, inst, sign), 2 * factors) <= probe.tolerance for sign in (1, -1)
    ):
      moot.add(inst.pair.label)
      warnings.warn(
        f"{inst.pair.label} is exact but moot: rescaling {_side(inst.members_a)} alone, or"
        f" {_side(inst.members_b)} alone, by per-group factors leaves the output put (each"
        " is followed by a normalization of its own, as with QK-norm), so balancing the"
        " pair changes nothing that matters.",
        MootPairWarning,
        stacklevel=2,
      )
  return deviations


class Probe:
  """The relative change of a model's outputs when its parameters change.

  ``probe.deviation(new_params)`` is the largest absolute change of any
  floating-point output of ``apply_fn(params, *args, **kwargs)``, relative to
  the largest output entry; ``tolerance`` is ``atol / that entry + rtol``.
  Matmuls run at full float32 precision on every backend (TF32 on GPUs or
  bf16 passes on TPUs would show up as deviations of a symmetry that is
  exact). The default ``rtol`` is 1e-4, or 3e-2 when the outputs or the
  parameters are 16-bit floats. Shared by :func:`check_symmetry` and
  :func:`saggs_jax.discover`.
  """

  def __init__(self, apply_fn, params, args=(), kwargs=None, rtol=None, atol=0.0):
    jitted = jax.jit(lambda p: apply_fn(p, *args, **(kwargs or {})))

    def fn(p):
      with jax.default_matmul_precision("highest"):
        return [
          o.astype(jnp.float32)
          for o in jax.tree.leaves(jitted(p))
          if jnp.issubdtype(o.dtype, jnp.floating)
        ]

    self.fn, self.params, self.reference = fn, params, fn(params)
    if rtol is None:
      rtol = default_rtol(jax.tree.leaves((params, jax.eval_shape(jitted, params))))
    self.scale = max(
      max(float(jnp.max(jnp.abs(r))) for r in self.reference), float(np.finfo(np.float32).tiny)
    )
    self.tolerance = atol / self.scale + rtol

  def deviation(self, params) -> float:
    return (
      max(float(jnp.max(jnp.abs(o - r))) for o, r in zip(self.fn(params), self.reference))
      / self.scale
    )

  def __call__(self, plan: Plan, factors) -> float:
    """The deviation when ``plan`` (one instance) is scaled by ``factors`` (broadcast)."""
    (inst,) = plan.instances
    factors = {inst.key: jnp.broadcast_to(jnp.asarray(factors, jnp.float32), inst.factor_shape)}
    return self.deviation(scale_tree(plan, self.params, factors, 1.0))

  def exact(self, plan: Plan, factors) -> bool:
    return bool(self(plan, factors) <= self.tolerance)


def default_rtol(arrays) -> float:
  """The relative tolerance of a symmetry check on ``arrays`` (parameters and outputs, arrays
  or shapes): 3e-2 if any floating one is 16-bit, else 1e-4."""
  bits = min(jnp.finfo(x.dtype).bits for x in arrays if jnp.issubdtype(x.dtype, jnp.floating))
  return 3e-2 if bits <= 16 else 1e-4


def _side(members: tuple[str, ...]) -> str:
  """The tensors of one side, quoted, for messages."""
  quoted = [repr(m) for m in members]
  return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


def _only(plan: Plan, inst: Instance, sign: int | None = None) -> Plan:
  """``plan`` reduced to ``inst``, and to one side of it (+1: A, -1: B) if ``sign``."""
  slots = {
    path: tuple(s for s in found if s.key == inst.key and sign in (None, s.sign))
    for path, found in plan.slots.items()
  }
  return Plan((inst,), {p: s for p, s in slots.items() if s}, plan.shapes, plan.parts)


def _variant(plan: Plan, inst: Instance, params: Any, **changes) -> Plan | None:
  """``inst`` declared otherwise (other axes, groups or followers, named as in ``inst`` or
  given as Blocks), or None if that does not resolve."""
  pair = inst.pair

  def specs(names):  # each member alone: its path, or a Block on its path
    return tuple(plan.part(n).spec if isinstance(n, str) else n for n in names)

  fields = {
    "axes": pair.axes,
    "groups": pair.groups,
    "follow_a": inst.followers_a,
    "follow_b": inst.followers_b,
    **changes,
  }
  fields["follow_a"], fields["follow_b"] = specs(fields["follow_a"]), specs(fields["follow_b"])
  try:
    other = resolve(
      [Pair(specs(inst.members_a), specs(inst.members_b), stacked=pair.stacked, **fields)], params
    )
  except ValueError:
    return None
  match = [i for i in other.instances if i.key == inst.key]
  return _only(other, match[0]) if match else None


def _declared_axes(plan: Plan, inst: Instance) -> tuple[int, int] | None:
  a, b = (plan.slot(p, inst.key).axis for p in (inst.a, inst.b))
  if a is None or b is None:  # whole tensors
    return None
  copy = inst.pair.copy_axes
  return per_copy_axis(a, copy), per_copy_axis(b, copy)


def _diagnose(probe: Probe, plan: Plan, inst: Instance, key, c_max: float) -> tuple[list[str], str]:
  """What further rescalings of ``inst`` show, and the cause they point to."""
  a, b, label = _side(inst.members_a), _side(inst.members_b), inst.pair.label
  measured = []

  # 1. Growth with c: an effect of the factors grows with |log c|, rounding noise does not.
  u = jax.random.uniform(key, inst.factor_shape, jnp.float32, -1.0, 1.0)
  near, far = (probe(_only(plan, inst), jnp.exp(t * u)) for t in (np.log(1.05), np.log(c_max)))
  measured.append(f"{near:.2g} with c within 5% of 1 and {far:.2g} with c up to {c_max:g}")
  if far < 3 * near:
    return measured, (
      "the deviation hardly depends on c, so it is rounding noise of the model's"
      " arithmetic rather than a broken symmetry: pass a larger rtol."
    )

  # 2. Sides: scaling one side alone by a common factor is invisible after a normalization.
  alone = {side: probe(_only(plan, inst, sign), 2.0**sign) for side, sign in ((a, 1), (b, -1))}
  invariant = [side for side, d in alone.items() if d <= probe.tolerance]
  uniform = probe(_only(plan, inst), 2.0)
  measured.append(
    f"{a} alone x2: {alone[a]:.2g}, {b} alone /2: {alone[b]:.2g},"
    f" both with one common factor: {uniform:.2g}"
  )
  if len(invariant) == 2:
    return measured, (
      f"{a} and {b} are each scale-invariant: a normalization follows each (QK-norm, say),"
      f" and it mixes the groups, so per-group factors change its output"
      f"{'' if uniform <= probe.tolerance else ' (and even one common factor does)'}. With"
      " one factor per tensor the pair is a symmetry, but balancing it is moot since neither"
      " norm reaches the output: drop the pair."
    )
  if invariant:
    other = b if invariant[0] == a else a
    return measured, (
      f"{invariant[0]} is scale-invariant on its own: a normalization follows it (a norm"
      f" between {a} and {b}), so nothing compensates the factor on {other}. This pair"
      " is no symmetry: drop it."
    )

  # 3. Groups, one at a time.
  shape = inst.factor_shape
  if shape and shape[-1] > 1:
    probed = sorted(set(np.linspace(0, shape[-1] - 1, min(shape[-1], 8)).round().astype(int)))
    bad = [
      int(g)
      for g in probed
      if not probe.exact(_only(plan, inst), jnp.ones(shape[-1]).at[g].set(2.0))
    ]
    which = "none" if not bad else "all" if len(bad) == len(probed) else str(bad)
    measured.append(
      f"groups deviating when rescaled alone: {which} of {len(probed)} probed ({shape[-1]} in all)"
    )

  # 4. Other declarations of the same two tensors.
  fix = _exact_variant(probe, plan, inst)
  if fix:
    return measured, fix
  return measured, (
    f"the deviation grows with c and no other group axis, grouping or follower is exact, so"
    f" a function that is not positively homogeneous sits between {a} and {b} (an"
    f" activation such as GELU, or a gate's SiLU, applied to the output of {a}): {label} is"
    " no symmetry: drop it."
  )


def _divisors(n: int) -> list[int]:
  return [d for d in range(n - 1, 0, -1) if n % d == 0]


def _exact_variant(probe: Probe, plan: Plan, inst: Instance) -> str | None:
  """A hint naming another declaration of ``inst`` that the probe finds exact, if any."""
  a, b, pair = inst.a, inst.b, inst.pair
  params = probe.params

  def exact(variant):
    if variant is None:
      return False
    (v,) = variant.instances
    factors = jnp.linspace(0.5, 2.0, int(np.prod(v.factor_shape))).reshape(v.factor_shape)
    return probe.exact(variant, factors)

  declared = _declared_axes(plan, inst)
  ndim = [len(plan.shapes[plan.part(p).path]) - len(pair.copy_axes) for p in (a, b)]
  two_tensors = len(inst.members_a) == len(inst.members_b) == 1
  for axes in itertools.product(range(ndim[0]), range(ndim[1])) if two_tensors else ():
    if axes != declared and exact(_variant(plan, inst, params, axes=axes)):
      return (
        f"the group axes: with axes={axes} (declared: {declared}) the pair is exact;"
        " the axes name the dimension that indexes the groups on each side."
      )
  if declared is not None:
    for groups in _divisors(inst.factor_shape[-1])[:8]:
      if exact(_variant(plan, inst, params, groups=groups)):
        if groups == 1:
          return (
            "the grouping: only one factor for the whole tensor (axes=None) is exact, so"
            " the groups are not independent."
          )
        return (
          f"the grouping: with groups={groups} (declared: {inst.factor_shape[-1]} groups)"
          " the pair is exact; under GQA, groups is the number of KV heads."
        )
  declared_paths = set(plan.slots)
  own = {
    plan.part(n).spec for n in inst.members_a + inst.members_b + inst.followers_a + inst.followers_b
  }
  for side, kernel, field, followers in (
    ("a", a, "follow_a", inst.followers_a),
    ("b", b, "follow_b", inst.followers_b),
  ):
    path_k, _, spec_k = plan.part(kernel)
    for path in plan.shapes:
      if path.rpartition("/")[0] != path_k.rpartition("/")[0]:
        continue
      # A block's bias is the same block of the bias; a whole kernel's is an undeclared leaf.
      if isinstance(spec_k, Block):
        candidate = dataclasses.replace(spec_k, pattern=path)
      elif path not in declared_paths:
        candidate = path
      else:
        continue
      if candidate not in own and exact(
        _variant(plan, inst, params, **{field: followers + (candidate,)})
      ):
        return (
          f"a follower left out: with {candidate!r} in {field} the pair is exact (a bias"
          f" moves with the kernel on side {side})."
        )
    for path in followers:
      rest = tuple(f for f in followers if f != path)
      if exact(_variant(plan, inst, params, **{field: rest})):
        return (
          f"a follower too many: without {path!r} in {field} the pair is exact, so it"
          " must not move."
        )
  return None
