"""The roles of Lau and Su's layerwise stack: which parameters each role names, and the Muon
dimension numbers of each (read by ``symmetry_compatible`` and by ``discover``'s result)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from optax.contrib import MuonDimensionNumbers

from saggs_jax._src.equivariant.dimension_numbers import (
  Layout,
  Patterns,
  dense_dimension_numbers,
  muon_dimension_numbers,
)


def as_patterns(patterns: Patterns) -> tuple[str, ...]:
  """``patterns`` as a tuple: one pattern or several."""
  return (patterns,) if isinstance(patterns, str) else tuple(patterns)


# Role -> path patterns: LLaMA-style Hugging Face names on Flax modules, with
# Flax (in, out) kernels: q/k/v (d, H*hd), o (H*hd, d), gate/up (d, F),
# down (F, d), embedding (V, d), lm_head (d, V), router (d, E) and stacked
# experts (E, in, out): the expert matrices by name (HF gpt-oss's ``gate_up_proj``
# and ``down_proj``, ``w``, ``w_in``/``w_up``/...), never ``experts/*``, which takes an MoE's
# expert biases (E, F) too.
ROLE_PATTERNS: Mapping[str, tuple[str, ...]] = MappingProxyType(
  {
    "embedding": ("embed/embedding",),
    "lm_head": ("lm_head/kernel",),
    "query": ("q_proj/kernel",),
    "key_value": ("k_proj/kernel", "v_proj/kernel"),
    "output": ("o_proj/kernel",),
    "gate_up": ("gate_proj/kernel", "up_proj/kernel"),
    "down": ("down_proj/kernel",),
    "router": ("router/kernel",),
    "experts": (
      "experts/*_proj",
      "experts/w",
      *(f"experts/w_{n}" for n in ("in", "out", "up", "down", "gate")),
    ),
  }
)


# Per role of ``symmetry_compatible``: the hidden matrices, reduced over the
# Flax (in, out) kernel's rows, every leading axis (layers, experts) batched.
# Embedding, LM head and router: None, as Muon leaves them to AdamW.
ROLE_DIMENSION_NUMBERS: Mapping[str, MuonDimensionNumbers | None] = MappingProxyType(
  {
    **dict.fromkeys(
      ("query", "key_value", "output", "gate_up", "down", "experts"), MuonDimensionNumbers(-2, -1)
    ),
    **dict.fromkeys(("embedding", "lm_head", "router"), None),
  }
)


# Whether a role's kernels read the hidden state (reduced over their first axis per copy) or
# write it (producing their last): see dense_dimension_numbers.
_WRITES = frozenset({"output", "down"})


def role_dimension_numbers(
  params: Any,
  roles: Mapping[str, Patterns] | None = None,
  *,
  copy_axes: int | Sequence[int] | Mapping[str, Sequence[int]] | None = None,
) -> Any:
  """:func:`muon_dimension_numbers` for the roles of ``symmetry_compatible``.

  ``roles`` maps roles to path patterns, as :data:`ROLE_PATTERNS` (the
  default) or ``saggs_jax.discover(...).roles`` do; each role's leaves get
  :data:`ROLE_DIMENSION_NUMBERS`: Dense (in, out) kernels, any leading axes
  batched. Query, key/value and output kernels are orthogonalised whole:
  ``MuonDimensionNumbers`` cannot split one axis into heads
  (``scale_by_polar(heads=Heads(num=...))`` can).

  With ``copy_axes`` (the copy axes of every leaf: a number of leading axes, their
  positions, or ``{path: positions}`` as :func:`saggs_jax.copy_axes` reads them) the
  kernels may have several input or output axes, as MaxText's (emb, layers, heads,
  head_dim) query and (heads, layers, head_dim, emb) output do: each gets
  :func:`~saggs_jax._src.equivariant.dimension_numbers.dense_dimension_numbers`, the copy
  axes batched, the output and down projections producing their last axis and the
  others reduced over their first (a kernel whose copy axes are all but its last two, as
  without ``copy_axes``: ``MuonDimensionNumbers(-2, -1)``).

  Example:
    >>> import jax.numpy as jnp
    >>> params = {"q_proj": {"kernel": jnp.ones((2, 8, 8))}, "embed": {"embedding": jnp.ones((16, 8))}}
    >>> role_dimension_numbers(params)["q_proj"]["kernel"]
    MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)
  """
  roles = ROLE_PATTERNS if roles is None else roles
  if unknown := set(roles) - set(ROLE_DIMENSION_NUMBERS):
    raise ValueError(
      f"Unknown roles {sorted(unknown)}; the roles are {sorted(ROLE_DIMENSION_NUMBERS)}."
    )
  layouts: dict[Patterns, Layout]
  if copy_axes is None:
    layouts = {as_patterns(pats): ROLE_DIMENSION_NUMBERS[r] for r, pats in roles.items()}
  else:

    def dims_of(role):
      def dims(path, shape):
        copy = copy_axes.get(path, ()) if isinstance(copy_axes, Mapping) else copy_axes
        copy = tuple(range(copy) if isinstance(copy, int) else copy)
        if copy == tuple(range(len(shape) - 2)):  # a Dense kernel, as without copy_axes
          return ROLE_DIMENSION_NUMBERS[role]
        return dense_dimension_numbers(len(shape), copy, reads=role not in _WRITES)

      return None if ROLE_DIMENSION_NUMBERS[role] is None else dims

    layouts = {as_patterns(pats): dims_of(r) for r, pats in roles.items()}
  return muon_dimension_numbers(params, layouts)
