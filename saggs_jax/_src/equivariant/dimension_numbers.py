"""Where the matrices of a parameter lie, in the manner of ``optax.contrib.muon``.

``optax.contrib.MuonDimensionNumbers(reduction_axis, output_axis)`` says which
axes of a weight ``W`` in ``x W = y`` are reduced and which are produced; every
other axis is a batch axis (stacked layers, heads, experts), each index an
independent matrix. Negative axes count from the end, so one declaration
serves a layer and a scanned stack of them.

* :func:`~saggs_jax.equivariant.scale_by_polar` takes a ``MuonDimensionNumbers``
  where it takes reduction and output axes.
* The unit rules (row-norm, spectral, hybrid) permute the units of one axis:
  :class:`UnitDimensionNumbers` names it, the axis that carries each unit's
  features, and fused branches; it converts from and to ``MuonDimensionNumbers``.
* :func:`muon_dimension_numbers` builds the tree ``optax.contrib.muon`` takes
  as ``muon_weight_dimension_numbers`` from path patterns or a preset's layout, and
  :func:`role_dimension_numbers` from the roles of
  :func:`~saggs_jax.equivariant.symmetry_compatible` (or of
  ``saggs_jax.discover(...).roles``), so optax's Muon and this library's
  polar rule see the same matrices.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import jax
from optax.contrib import MuonDimensionNumbers

from saggs_jax._src.paths import is_array, match, path_str

Axes = int | Sequence[int]
Side = Literal["reduction", "output"]


def as_tuple(axes: Axes) -> tuple[int, ...]:
  return (axes,) if isinstance(axes, int) else tuple(axes)


def normalize(axes: Axes, ndim: int) -> tuple[int, ...]:
  """``axes`` as non-negative ints; a ValueError when one is out of range or repeats."""
  axes = as_tuple(axes)
  if any(not -ndim <= a < ndim for a in axes):
    raise ValueError(f"axes {axes} are out of range for rank {ndim}")
  out = tuple(a % ndim for a in axes)
  if len(set(out)) < len(out):
    raise ValueError(f"axes {axes} name an axis twice for rank {ndim}")
  return out


def partition(ndim: int, named: Sequence[Axes], batch: Axes | None) -> tuple[tuple[int, ...], ...]:
  """The ``named`` axes and the batch axes, normalised for rank ``ndim``.

  ``batch=None`` takes every axis not named (``MuonDimensionNumbers``'s
  convention); otherwise the named and batch axes must partition the axes.
  """
  groups = [normalize(a, ndim) for a in named]
  taken = [a for g in groups for a in g]
  if len(set(taken)) < len(taken):
    raise ValueError(f"axes {tuple(named)} overlap")
  if batch is None:
    return (*groups, tuple(a for a in range(ndim) if a not in taken))
  batch = normalize(batch, ndim)
  if sorted(taken + list(batch)) != list(range(ndim)):
    raise ValueError(f"axes {tuple(named)} and batch axes {batch} do not partition rank {ndim}")
  return (*groups, batch)


class UnitDimensionNumbers(NamedTuple):
  """The matrices a unit rule acts on: rows are the units a symmetry permutes.

  A parameter is viewed as a stack of ``units x features`` matrices:

  * ``unit_axis``: the axis of units (vocabulary rows of a ``(V, d)``
    embedding: 0; the hidden neurons of a Flax ``(d, F)`` gate kernel: -1);
  * ``feature_axis``: the axes holding each unit's vector; ``None``: the one
    axis left once the unit and batch axes are taken;
  * ``batch_axis``: independent copies (layers, experts); ``None``: every
    axis not named when ``feature_axis`` is given (as in
    ``MuonDimensionNumbers``), none otherwise. Naming both checks the rank;
  * ``fused``: the unit axis holds this many branches per unit (a fused
    ``gate_up`` kernel: 2), and a unit's vector is its vectors in every branch;
    ``interleaved``: the branches alternate (gate, up, gate, up, ...) instead
    of following each other.

  Example:
    >>> from optax.contrib import MuonDimensionNumbers
    >>> dims = UnitDimensionNumbers.from_muon(MuonDimensionNumbers(-2, -1), units="output")
    >>> dims
    UnitDimensionNumbers(unit_axis=-1, feature_axis=-2, batch_axis=None, fused=1, interleaved=False)
    >>> dims.to_muon(units="output")
    MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)
  """

  unit_axis: int = 0
  feature_axis: Axes | None = None
  batch_axis: Axes | None = None
  fused: int = 1
  interleaved: bool = False

  @classmethod
  def from_muon(
    cls, dims: MuonDimensionNumbers, units: Side, *, fused: int = 1, interleaved: bool = False
  ) -> UnitDimensionNumbers:
    """The layout whose units are the ``units`` side of ``dims`` (a single axis)."""
    unit, features = _sides(dims, units)
    if len(as_tuple(unit)) != 1:
      raise ValueError(f"the {units} side of {dims} must be a single axis to hold units")
    return cls(as_tuple(unit)[0], features, None, fused, interleaved)

  def to_muon(self, units: Side) -> MuonDimensionNumbers:
    """The same matrices for ``optax.contrib.muon``, with the units on the ``units`` side."""
    if self.feature_axis is None or self.fused != 1:
      raise ValueError(
        f"{self} has no MuonDimensionNumbers: name its feature_axis, and "
        "Muon cannot split fused branches"
      )
    unit, features = _sides(MuonDimensionNumbers(self.unit_axis, self.feature_axis), units)
    return MuonDimensionNumbers(unit, features)

  def axes(self, ndim: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """``(unit, features, batch)`` for a parameter of rank ``ndim``."""
    if self.feature_axis is not None:
      (unit,), features, batch = partition(
        ndim, [self.unit_axis, self.feature_axis], self.batch_axis
      )
      return unit, features, batch
    batch = as_tuple(() if self.batch_axis is None else self.batch_axis)
    if ndim != len(batch) + 2:
      raise ValueError(
        f"expected rank {len(batch) + 2} (units, features and {len(batch)} batch axes)"
      )
    (unit,), batch, features = partition(ndim, [self.unit_axis, batch], None)
    return unit, features, batch


class Heads(NamedTuple):
  """How one axis of a weight splits into heads, each a matrix of its own.

  Exactly one of ``num`` and ``dim`` is given.

  * ``num``: the axis holds this many heads; ``dim``: heads of this size;
  * ``axis``: the axis holding them (one of the matrix axes): a ``(d, H*hd)`` query
    kernel's -1, a ``(H*hd, d)`` output kernel's -2;
  * ``interleaved``: head k holds indices k, k + H, ... instead of a contiguous block
    (the gate and up halves of gpt-oss's fused expert kernel are
    ``Heads(num=2, axis=-1, interleaved=True)``).

  Example:
    >>> Heads(num=4)
    Heads(num=4, dim=None, axis=-1, interleaved=False)
  """

  num: int | None = None
  dim: int | None = None
  axis: int = -1
  interleaved: bool = False


def _sides(dims: MuonDimensionNumbers, units: Side):
  """``(units side, other side)`` of ``dims``."""
  if units not in ("reduction", "output"):
    raise ValueError(f"units must be 'reduction' or 'output', got {units!r}")
  if units == "output":
    return dims.output_axis, dims.reduction_axis
  return dims.reduction_axis, dims.output_axis


def unit_dimension_numbers(dims: int | UnitDimensionNumbers) -> UnitDimensionNumbers:
  """A unit rule's layout: an int is ``UnitDimensionNumbers(unit_axis=dims)``."""
  if isinstance(dims, UnitDimensionNumbers):
    return dims
  if isinstance(dims, MuonDimensionNumbers):
    raise TypeError(
      f"{dims} does not say which side holds the units: pass "
      "UnitDimensionNumbers.from_muon(dims, units='reduction' or 'output')"
    )
  return UnitDimensionNumbers(unit_axis=dims)


def muon_axes(dims: MuonDimensionNumbers, ndim: int) -> tuple[tuple[int, ...], ...]:
  """``(reduction, output, batch)`` axes of ``dims`` for rank ``ndim``, as ``optax.contrib.muon``
  reads them (stricter: an axis out of range or named twice is an error)."""
  if ndim < 2:
    raise ValueError(f"{dims} needs a matrix, got rank {ndim}")
  return partition(ndim, [dims.reduction_axis, dims.output_axis], None)


def dense_dimension_numbers(
  ndim: int, copy_axes: Sequence[int], *, reads: bool
) -> MuonDimensionNumbers:
  """The matrices of a Dense-like kernel of rank ``ndim`` whose copy axes (layers, experts)
  are at ``copy_axes``: its other axes are its inputs, then its outputs. A kernel that reads
  the hidden state (``reads``: q/k/v (d, heads, head_dim), gate/up (d, F)) reduces over its
  first such axis and outputs the rest; one that writes it (o (heads, head_dim, d), down
  (F, d)) outputs its last and reduces over the rest. Axes are non-negative.

  Example (MaxText's scanned query (emb, layers, heads, head_dim) and out (heads, layers,
  head_dim, emb)):
    >>> dense_dimension_numbers(4, (1,), reads=True)
    MuonDimensionNumbers(reduction_axis=(0,), output_axis=(2, 3))
    >>> dense_dimension_numbers(4, (1,), reads=False)
    MuonDimensionNumbers(reduction_axis=(0, 2), output_axis=(3,))
  """
  free = [a for a in range(ndim) if a not in set(copy_axes)]
  if len(free) < 2:
    raise ValueError(
      f"a kernel of rank {ndim} with copy axes {tuple(copy_axes)} has no matrix (fewer than"
      " two other axes)"
    )
  reduction, output = (free[:1], free[1:]) if reads else (free[:-1], free[-1:])
  return MuonDimensionNumbers(tuple(reduction), tuple(output))


Patterns = str | Sequence[str]
Dims = MuonDimensionNumbers | None
Layout = Dims | Callable[[str, tuple[int, ...]], Dims]


def _join(prefix: str | None, pattern: str) -> str:
  return f"{prefix}/{pattern}" if prefix else pattern


# The hidden matrices of each layout for Muon; negative axes, so that the
# leading axes of scanned layers are batched too.
_MUON_LAYOUTS: dict[str, dict[tuple[str, ...], MuonDimensionNumbers]] = {
  # Dense (in, out) kernels.
  "llama": {
    (
      "q_proj/kernel",
      "k_proj/kernel",
      "v_proj/kernel",
      "o_proj/kernel",
      "gate_proj/kernel",
      "up_proj/kernel",
      "down_proj/kernel",
    ): MuonDimensionNumbers(-2, -1)
  },
  # (d, H, hd) query/key/value and (H, hd, d) output kernels: one matrix per head.
  "flax_mha": {
    ("query/kernel", "key/kernel", "value/kernel"): MuonDimensionNumbers(-3, -1),
    ("out/kernel",): MuonDimensionNumbers(-2, -1),
  },
  # FlaxConv1D (out, in) kernels; c_attn's q, k and v blocks form one matrix.
  "gpt2": {
    (
      "attn/c_attn/kernel",
      "attn/c_proj/kernel",
      "mlp/c_fc/kernel",
      "mlp/c_proj/kernel",
    ): MuonDimensionNumbers(-1, -2)
  },
}


# MaxText's matrices, per layer: (per-layer rank, reduction axes, output axes), first match
# wins; the layer axis is then inserted at param_scan_axis (see _maxtext_muon).
_MAXTEXT_EXCLUDED = frozenset({"scale", "bias", "embedding", "logits_dense"})
_MAXTEXT_MATRICES: tuple[tuple[str, tuple[int, tuple[int, ...], tuple[int, ...]]], ...] = (
  ("MoeBlock_0/wi_*", (3, (1,), (2,))),  # (experts, in, out): per expert, bare leaves
  ("MoeBlock_0/wo", (3, (1,), (2,))),
  ("self_attention*/out/kernel", (3, (0, 1), (2,))),  # (heads, head_dim, emb): one matrix
  *(
    (f"self_attention*/{name}/kernel", (3, (0,), (1, 2)))  # (in, heads, head_dim)
    for name in ("query", "key", "value", "wq_b", "wkv_b")
  ),
)


def _maxtext_muon(params: Any, prefix: str | None, scan_axis: int | None) -> Any:
  """MaxText's ``muon_weight_dimension_numbers`` (see :func:`muon_dimension_numbers`)."""
  if scan_axis not in (0, 1, None):
    raise ValueError(f"param_scan_axis must be 0, 1 or None (unscanned), got {scan_axis!r}.")
  scanned = scan_axis is not None
  # Per-layer axes before the layer axis count from the start, the others from the end:
  # MaxText's own numbers for the layer axis at 1 (or none); at 0 all count from the end.
  split = 1 if scan_axis is None else scan_axis

  def leaf(key_path, x):
    path = path_str(key_path)
    if not is_array(x) or _MAXTEXT_EXCLUDED & set(path.split("/")):
      return None
    if prefix is not None and match(_join(prefix, "**"), path) is None:
      return None
    rule = next((r for pat, r in _MAXTEXT_MATRICES if match(pat, path) is not None), None)
    n = len(x.shape) - (scanned and "layers_remainder" not in path)  # gemma3's, unscanned
    if rule is None:  # a Dense kernel (in, out), or no matrix
      if n < 2:
        return None
      rule = (n, (0,), (n - 1,))
    rank, reduction, output = rule
    if n != rank:
      raise ValueError(
        f"muon_dimension_numbers(..., 'maxtext'): {path!r} has shape"
        f" {tuple(x.shape)}, {n} axes per layer; MaxText's layout has {rank}"
        f" (param_scan_axis={scan_axis}; None for scan_layers=False)."
      )

    def at(axes):  # before the layer axis from the start, after it from the end
      return tuple(a if a < split else a - n for a in axes)

    return MuonDimensionNumbers(at(reduction), at(output))

  return jax.tree_util.tree_map_with_path(leaf, params)


def muon_dimension_numbers(
  params: Any,
  layouts: Mapping[Patterns, Layout] | Literal["llama", "flax_mha", "gpt2", "maxtext"],
  *,
  prefix: str | None = None,
  param_scan_axis: int | None = 1,
) -> Any:
  """The tree of ``MuonDimensionNumbers`` that ``optax.contrib.muon`` takes.

  Each array leaf whose path matches a pattern of ``layouts`` gets that pattern's
  ``MuonDimensionNumbers`` (or ``fn(path, shape)``'s); every other leaf gets ``None``, which
  ``optax.contrib.muon`` hands to AdamW. A preset's name gives the hidden matrices of its
  layout; ``"maxtext"`` gives what MaxText's ``muon_utils`` gives, with the layer axis
  always batched (``docs/dimension_numbers.md``).

  Args:
    params: the parameters (arrays or ``jax.ShapeDtypeStruct`` leaves).
    layouts: ``{patterns: MuonDimensionNumbers or fn(path, shape)}`` (patterns of
      :mod:`saggs_jax._src.paths`), or ``"llama"``, ``"flax_mha"``, ``"gpt2"``, ``"maxtext"``.
    prefix: restricts the patterns to this part of the tree (``"decoder/**"``); default all.
    param_scan_axis: ``"maxtext"`` only: its scanned layer axis (default 1, MaxText's;
      0; or ``None`` for ``scan_layers=False``).

  Returns:
    A tree with the structure of ``params`` (an ``nnx.State`` included).

  Raises:
    ValueError: naming the path, when two patterns match one leaf or a leaf
      does not have the axes its dimension numbers name; naming the layout when it is
      unknown.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from optax.contrib import MuonDimensionNumbers
    >>> params = {"attn": {"kernel": jnp.ones((4, 2, 3))}, "norm": jnp.ones(4)}
    >>> dims = muon_dimension_numbers(params, {"attn/kernel": MuonDimensionNumbers(0, 2)})
    >>> dims
    {'attn': {'kernel': MuonDimensionNumbers(reduction_axis=0, output_axis=2)}, 'norm': None}
    >>> tx = optax.contrib.muon(0.02, muon_weight_dimension_numbers=dims)
    >>> updates, _ = tx.update(params, tx.init(params), params)
    >>> params = {"attn": {"query": {"kernel": jnp.ones((8, 2, 4))}}, "ln": {"scale": jnp.ones(8)}}
    >>> dims = muon_dimension_numbers(params, "flax_mha")
    >>> dims["attn"]["query"]["kernel"], dims["ln"]["scale"]
    (MuonDimensionNumbers(reduction_axis=-3, output_axis=-1), None)
  """
  if isinstance(layouts, str):
    if layouts == "maxtext":
      return _maxtext_muon(params, prefix, param_scan_axis)
    if layouts not in _MUON_LAYOUTS:
      raise ValueError(
        f"Unknown layout {layouts!r}; expected one of {sorted(_MUON_LAYOUTS) + ['maxtext']}"
        " or a mapping of path patterns to MuonDimensionNumbers."
      )
  table: Mapping[Any, Layout] = _MUON_LAYOUTS[layouts] if isinstance(layouts, str) else layouts
  entries = [
    (tuple(_join(prefix, p) for p in ((pats,) if isinstance(pats, str) else pats)), dims)
    for pats, dims in table.items()
  ]

  def leaf(key_path, x):
    if not is_array(x):
      return None
    path = path_str(key_path)
    try:
      hits = {
        dims(path, tuple(x.shape)) if callable(dims) else dims
        for pats, dims in entries
        for p in pats
        if match(p, path) is not None
      }
    except ValueError as e:
      raise ValueError(f"Parameter {path!r} of shape {tuple(x.shape)}: {e}.") from None
    if len(hits) > 1:
      raise ValueError(
        f"Parameter {path!r} matches patterns with different dimension numbers {hits}."
      )
    dims = next(iter(hits), None)
    if dims is not None:
      try:
        muon_axes(dims, x.ndim)
      except ValueError as e:
        raise ValueError(f"Parameter {path!r} of shape {tuple(x.shape)}: {e}.") from None
    return dims

  tree = jax.tree_util.tree_map_with_path(leaf, params)
  emitted = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, MuonDimensionNumbers))
  if not emitted and any(d is not None for _, d in entries):
    raise ValueError(
      f"No parameter matches the patterns {[p for pats, _ in entries for p in pats]}: "
      "the tree would leave every parameter to AdamW."
    )
  return tree
