"""Symmetry-compatible update rules as optax ``scale_by_*`` transformations.

Each rule keeps a momentum ``M`` of the gradient and maps it, matrix by matrix,
to an update that is equivariant under the symmetry group of the weight block
(Lau and Su 2026, see :mod:`saggs_jax.equivariant`). A parameter is viewed as a
stack of matrices ``(batch..., rows, cols)``:

* unit rules (row-norm, spectral, hybrid): rows are the units the symmetry
  permutes, columns the axes that carry features (``unit_axis``, or a
  :class:`~saggs_jax.equivariant.UnitDimensionNumbers`);
* polar: rows are the reduction (input) axes, columns the output axes, given
  as axes or as an ``optax.contrib.MuonDimensionNumbers``.

Batch axes (stacked layers, experts, heads) are independent copies.
Every rule declares the axes it needs (and the rank, unless its dimension
numbers batch every other axis), and ``init`` raises a ValueError naming the
parameter path when a parameter does not fit. Reductions run in at
least float32; updates keep the dtype of the gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers

from saggs_jax._src.equivariant import gather, linalg
from saggs_jax._src.equivariant.dimension_numbers import (
  Axes,
  Heads,
  UnitDimensionNumbers,
  unit_dimension_numbers,
)
from saggs_jax._src.equivariant.dimension_numbers import as_tuple as _as_tuple
from saggs_jax._src.equivariant.dimension_numbers import normalize as _normalize
from saggs_jax._src.equivariant.matrices import (
  from_matrix,
  joint_blocks,
  polar_planner,
  stacked_map,
  to_matrix,
  unit_planner,
)
from saggs_jax._src.equivariant.settings import InverseSqrt, NewtonSchulz
from saggs_jax._src.paths import path_str
from saggs_jax._src.transport import register_transport


class MomentumState(NamedTuple):
  """State of every rule: ``mu``, the EMA of the gradients, shaped like the params."""

  mu: optax.Updates


# SAGGS chained after these rules transports their momentum like Adam's mu.
register_transport(MomentumState, {"mu": 1})


def _accumulate(g, mu, beta: float, ema: bool):
  """``beta mu + (1 - beta) g`` (an EMA) or ``beta mu + g`` (a sum, as in torch's SGD)."""
  if ema:
    return optax.tree.update_moment(g, mu, beta, 1)
  return jax.tree.map(lambda g, m: beta * m + g, g, mu)


def _rule(
  name: str,
  planner,
  direction,
  *,
  beta,
  nesterov,
  joint=(),
  batched=False,
  ema=True,
  whole=False,
):
  """Momentum, then ``direction`` on every block of matrices ``(batch..., rows, cols)``.

  Leaves of one ``joint`` group are concatenated along the columns, so a unit's
  vector is the concatenation of its vectors in each member. ``direction``
  must act on each matrix of the leading axes independently; with ``batched``
  the blocks of equal matrix size share one call (``matrices.stacked_map``), which
  is worth its copies for directions built on matmuls, not for elementwise ones.
  With ``whole`` (iterations of matmuls on each matrix) every device computes
  on whole matrices under a mesh, moved once in and once out (see
  :mod:`saggs_jax._src.equivariant.gather`).
  """

  def plan_tree(tree):
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [path_str(kp) for kp, _ in flat]
    leaves = [x for _, x in flat]
    plans = []
    for path, x in zip(paths, leaves):
      try:
        plans.append(planner(tuple(x.shape)))
      except ValueError as e:
        raise ValueError(
          f"{name}: parameter {path or '<root>'!r} of shape {tuple(x.shape)}: {e}."
        ) from None
    blocks = joint_blocks(paths, joint)
    for block in blocks:
      if len({plans[i].matrix_shape[:-1] for i in block}) > 1:
        raise ValueError(
          f"{name}: joint parameters {[paths[i] for i in block]} must agree on "
          f"their batch and unit axes, got shapes {[leaves[i].shape for i in block]}."
        )
    return leaves, treedef, plans, blocks

  def init_fn(params):
    plan_tree(params)
    return MomentumState(mu=optax.tree.zeros_like(params))

  def update_fn(updates, state, params=None):
    del params
    mu = _accumulate(updates, state.mu, beta, ema)
    m = _accumulate(updates, mu, beta, ema) if nesterov else mu
    leaves, treedef, plans, blocks = plan_tree(m)
    dtypes = [g.dtype for g in jax.tree.leaves(updates)]

    def local(x):
      return gather.locally(direction, x, axes, batched)

    def matrices(leaves):
      xs = []
      for block in blocks:
        x = jnp.concatenate([to_matrix(leaves[i], plans[i]) for i in block], axis=-1)
        xs.append(x.astype(jnp.promote_types(x.dtype, jnp.float32)))
      results = stacked_map(local, xs) if batched else [local(x) for x in xs]
      out: list[jax.Array | None] = [None] * len(leaves)
      for block, result in zip(blocks, results):
        cols = np.cumsum([plans[i].matrix_shape[-1] for i in block])[:-1]
        for i, piece in zip(block, jnp.split(result, cols, axis=-1)):
          out[i] = from_matrix(piece, plans[i], leaves[i].shape).astype(dtypes[i])
      return out

    with gather.on_mesh(leaves):  # the mesh of the context, else of the leaves' types
      axes = gather.spread_axes(leaves) if whole else ()
      out = gather.in_place(matrices, leaves, jax.tree.leaves(updates), axes)
    return jax.tree_util.tree_unflatten(treedef, out), MomentumState(
      optax.tree.cast_like(mu, state.mu)
    )

  return optax.GradientTransformation(init_fn, update_fn)


def _maybe_center(center: bool) -> Callable[[jax.Array], jax.Array]:
  return linalg.center if center else (lambda x: x)


def scale_by_polar(
  reduction_axes: Axes | MuonDimensionNumbers = -2,
  output_axes: Axes = -1,
  batch_axes: Axes = (),
  *,
  heads: Heads | None = None,
  beta: float = 0.95,
  nesterov: bool = True,
  ema: bool = True,
  newton_schulz: NewtonSchulz = NewtonSchulz(),
  eps: float = 1e-7,
  eps_form: linalg.EpsForm = "floor",
) -> optax.GradientTransformation:
  """Muon: the polar factor of the Nesterov momentum, per matrix (and per head).

    M <- β M + (1 - β) G,   u = √max(1, n_out / n_in) · polar(β M + (1 - β) G)

  ``polar(X) = U Vᵀ`` by Newton-Schulz; equivariant under ``X ↦ A X B`` for orthogonal
  ``A``, ``B``. The matrix is (reduction axes) x (output axes); docs/dimension_numbers.md
  shows the layouts (DenseGeneral kernels, gpt-oss fused experts, ``Heads`` per kernel).

  Args:
    reduction_axes: input axes (rows of Flax's ``(in, out)``), or an
      ``optax.contrib.MuonDimensionNumbers``: its axes make the matrix and every other
      axis is batched, whatever the rank (then give neither of the next two).
    output_axes: output axes.
    batch_axes: axes holding independent matrices (layers, experts).
    heads: split one reduction or output axis into heads (:class:`Heads`), each
      orthogonalised on its own; default one matrix.
    beta: momentum decay.
    nesterov: use the look-ahead ``beta M + (1 - beta) G``.
    ema: ``False`` accumulates ``M <- beta M + G`` like torch's SGD momentum.
    newton_schulz: coefficients, steps, dtype and Gram form (:class:`NewtonSchulz`).
    eps: floor of the Frobenius normaliser.
    eps_form: ``"floor"`` (``max(h ||X||, eps)``) or ``"add"`` (``h ||X|| + eps``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> tx = scale_by_polar(heads=Heads(num=2))  # a (d, H*hd) query kernel, per head
    >>> g = {"q": jax.random.normal(jax.random.key(0), (8, 2 * 4))}
    >>> u, _ = tx.update(g, tx.init(g))
    >>> o = u["q"][:, :4]  # head 0's 8 x 4 block: orthonormal columns (5 steps: roughly)
    >>> bool(jnp.allclose(o.T @ o, jnp.eye(4), atol=0.2))
    True

  References:
    Jordan et al., `Muon <https://kellerjordan.github.io/posts/muon/>`_, 2024; Amsel et
    al., `The Polar Express <https://arxiv.org/abs/2505.16932>`_, 2025; Lau and Su,
    `Symmetry-Compatible Principle for Optimizer Design`, 2026.
  """
  planner = polar_planner(reduction_axes, output_axes, batch_axes, heads)

  def direction(x):
    width = math.sqrt(max(1.0, x.shape[-1] / x.shape[-2]))
    ns = newton_schulz
    return width * linalg.newton_schulz(x, ns.coeffs, ns.steps, ns.dtype, eps, eps_form, ns.gram)

  return _rule(
    "scale_by_polar",
    planner,
    direction,
    beta=beta,
    nesterov=nesterov,
    batched=True,
    ema=ema,
    whole=True,
  )


def scale_by_row_norm(
  unit_axis: int | UnitDimensionNumbers,
  *,
  center: bool = False,
  joint: Sequence[str] = (),
  beta: float = 0.95,
  eps: float = 1e-8,
  eps_form: linalg.EpsForm = "floor",
) -> optax.GradientTransformation:
  """Row-norm: every unit vector of the momentum scaled to unit length.

    M <- β M + (1 - β) G,   u = R(M),   R(X)_i = X_i / max(||X_i||, ε)

  and with ``center``, ``u = P(R(P(M)))``, ``P(X) = X - mean_i X_i`` (the mean
  over units). Equivariant under unit permutations and orthogonal maps of the
  features; the centred form is also invariant under a shared shift
  ``X_i ↦ X_i + s``. Units with a zero momentum get a zero update (without
  ``center``).

  Args:
    unit_axis: the axis of units (vocabulary: 0 for a ``(V, d)`` embedding,
      1 for a Flax ``(d, V)`` LM head; hidden neurons: 1 for SwiGLU gate/up,
      0 for down), or the whole layout as a :class:`UnitDimensionNumbers`
      (batch axes of stacked layers and experts, fused branches).
    center: remove the shared-shift direction before and after.
    joint: path patterns whose parameters (paired by equal captures, see
      ``saggs_jax._src.paths``) share units, e.g. ``("gate_proj/kernel",
      "up_proj/kernel")``: a neuron's vector is its gate vector followed by
      its up vector.
    beta: momentum decay.
    eps: floor of the row norms.
    eps_form: ``"floor"`` (``max(||x||, eps)``) or ``"add"`` (``||x|| + eps``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> tx = scale_by_row_norm(unit_axis=0, beta=0.0)
    >>> g = {"embedding": jnp.array([[3.0, 4.0], [0.0, 0.0]])}
    >>> tx.update(g, tx.init(g))[0]["embedding"]
    Array([[0.6, 0.8],
           [0. , 0. ]], dtype=float32)
    >>> stacked = UnitDimensionNumbers(unit_axis=-1, feature_axis=-2)  # (layers, d, F), F neurons
    >>> tx = scale_by_row_norm(stacked, beta=0.0)
    >>> g = {"gate": jnp.ones((2, 4, 3))}
    >>> tx.update(g, tx.init(g))[0]["gate"][0, :, 0]
    Array([0.5, 0.5, 0.5, 0.5], dtype=float32)

  References:
    Lau and Su, `Symmetry-Compatible Principle for Optimizer Design:
    Embeddings, LM Heads, SwiGLU MLPs, and MoE Routers`, 2026
  """
  p = _maybe_center(center)
  return _rule(
    "scale_by_row_norm",
    unit_planner(unit_dimension_numbers(unit_axis)),
    lambda x: p(linalg.row_normalize(p(x), eps, eps_form)),
    beta=beta,
    nesterov=False,
    joint=joint,
  )


def _nuclear_scale(nu: jax.Array, alpha: float, floor: float) -> jax.Array:
  """``max(nu, floor) ** alpha``: the nuclear-norm factor of the spectral and hybrid rules."""
  nu = jnp.maximum(nu, floor)
  return nu if alpha == 1.0 else nu**alpha


def _spectral_rule(
  name,
  unit_axis,
  center,
  joint,
  beta,
  eps,
  alpha,
  inverse_sqrt,
):
  """Both spectral rules, which differ only in their name and ``center``'s default."""
  p = _maybe_center(center)
  floor = 0.0 if inverse_sqrt.relative_eps else eps

  def direction(m):
    u, nu = _inverse_sqrt_polar(p(m), eps, inverse_sqrt)
    return p(_nuclear_scale(nu, alpha, floor) * u)

  return _rule(
    name,
    unit_planner(unit_dimension_numbers(unit_axis)),
    direction,
    beta=beta,
    nesterov=False,
    joint=joint,
    batched=True,
    whole=True,
  )


def _inverse_sqrt_polar(x, eps, inverse_sqrt: InverseSqrt):
  """``(X (Xᵀ X + ε' I)^(-1/2), ν)`` by :class:`InverseSqrt`'s method."""
  if not isinstance(inverse_sqrt, InverseSqrt):
    raise TypeError(f"expected a saggs_jax.equivariant.InverseSqrt, got {inverse_sqrt!r}.")
  i = inverse_sqrt
  return linalg.spectral(
    x, eps, relative=i.relative_eps, method=i.method, steps=i.steps, gram=i.gram
  )


def scale_by_right_spectral(
  unit_axis: int | UnitDimensionNumbers,
  *,
  center: bool = False,
  joint: Sequence[str] = (),
  beta: float = 0.95,
  eps: float = 1e-6,
  alpha: float = 1.0,
  inverse_sqrt: InverseSqrt = InverseSqrt(),
) -> optax.GradientTransformation:
  """Right (one-sided) spectral update.

    u = ν^α X (Xᵀ X + ε' I)^(-1/2),   ν = tr(C (C + ε' I)^(-1/2)),   C = Xᵀ X,

  with ``X = M`` (rows: units) or ``P(M)`` with ``center`` (then the update is
  re-centred), and ``ε' = ε ||X||_F²`` so the rule is scale-equivariant
  (``InverseSqrt(relative_eps=False)``: ``ε' = ε``). By default computed with ``eigh`` in
  float32 on the smaller Gram matrix. Equivariant under unit permutations and
  orthogonal maps of the features. Zero units stay zero (without ``center``).

  Args:
    unit_axis: the axis of units, or a :class:`UnitDimensionNumbers`.
    center: use ``P(M)`` (shared-shift invariant).
    joint: units shared by several parameters (see :func:`scale_by_row_norm`).
    beta: momentum decay.
    eps: eigenvalue floor (relative to ``||X||_F²`` with ``inverse_sqrt.relative_eps``).
    alpha: power of the nuclear-norm factor (0: none; ``ν`` is clamped
      below at ``eps`` when the floor is absolute).
    inverse_sqrt: the method, steps, Gram matrix and floor of the inverse square root
      (:class:`InverseSqrt`).

  Example:
    >>> import jax.numpy as jnp
    >>> tx = scale_by_right_spectral(unit_axis=0, beta=0.0, eps=1e-12)
    >>> g = {"w": jnp.array([[2.0, 0.0], [0.0, 1.0]])}
    >>> tx.update(g, tx.init(g))[0]["w"].round(4)  # nuclear norm x polar factor
    Array([[3., 0.],
           [0., 3.]], dtype=float32)

  References:
    Lau and Su, `Symmetry-Compatible Principle for Optimizer Design:
    Embeddings, LM Heads, SwiGLU MLPs, and MoE Routers`, 2026
  """
  return _spectral_rule(
    "scale_by_right_spectral",
    unit_axis,
    center,
    joint,
    beta,
    eps,
    alpha,
    inverse_sqrt,
  )


def scale_by_left_spectral(
  unit_axis: int | UnitDimensionNumbers,
  *,
  center: bool = True,
  joint: Sequence[str] = (),
  beta: float = 0.95,
  eps: float = 1e-6,
  alpha: float = 1.0,
  inverse_sqrt: InverseSqrt = InverseSqrt(),
) -> optax.GradientTransformation:
  """Left spectral update, for MoE routers (units = experts).

    u = P(ν^α (X Xᵀ + ε' I)^(-1/2) X),   X = P(M),

  equivariant under expert permutations and invariant under a shared shift of
  the expert vectors. By the push-through identity
  ``(X Xᵀ + ε' I)^(-1/2) X = X (Xᵀ X + ε' I)^(-1/2)`` it is the centred
  :func:`scale_by_right_spectral`; the ``experts x experts`` Gram matrix is the
  one decomposed whenever it is the smaller (``gram="left"`` always uses it).
  Arguments as there; ``center`` defaults to True.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> tx = scale_by_left_spectral(unit_axis=1, beta=0.0)  # (d, E) router
    >>> g = {"router": jax.random.normal(jax.random.key(0), (6, 4))}
    >>> u = tx.update(g, tx.init(g))[0]["router"]
    >>> bool(jnp.allclose(u.sum(axis=1), 0.0, atol=1e-4))  # centred over experts
    True

  References:
    Lau and Su, `Symmetry-Compatible Principle for Optimizer Design:
    Embeddings, LM Heads, SwiGLU MLPs, and MoE Routers`, 2026
  """
  return _spectral_rule(
    "scale_by_left_spectral",
    unit_axis,
    center,
    joint,
    beta,
    eps,
    alpha,
    inverse_sqrt,
  )


def scale_by_hybrid(
  unit_axis: int | UnitDimensionNumbers,
  *,
  order: Literal["row_then_polar", "polar_then_row"] = "row_then_polar",
  center: bool = False,
  joint: Sequence[str] = (),
  beta: float = 0.95,
  eps: float = 1e-8,
  eps_form: linalg.EpsForm = "floor",
  alpha: float = 1.0,
  nuclear_norm_axes: Axes = (),
  polar: NewtonSchulz | InverseSqrt = NewtonSchulz(),
) -> optax.GradientTransformation:
  """Hybrid row-norm / spectral update.

  ``"row_then_polar"``: ``u = ν(X)^α · polar(X)`` with ``X = R(M)`` and ``ν(X) =
  <polar(X), X>``, the nuclear norm of X. ``"polar_then_row"``: ``u = R(ν(M)^α ·
  polar(M))``. With ``center``, ``P`` is applied first, last and (row_then_polar)
  between ``R`` and the polar step. Equivariant under unit permutations and orthogonal
  maps of the features (and shared shifts with ``center``); docs/equivariant.md.

  Args:
    unit_axis: the axis of units, or a :class:`UnitDimensionNumbers`.
    order: which map comes first.
    center: apply ``P`` first and last (and between).
    joint: units shared by several parameters (see :func:`scale_by_row_norm`).
    beta: momentum decay.
    eps: floor of the row norms, of the Frobenius normaliser and of ``ν``; the damping
      of an :class:`InverseSqrt` polar factor.
    eps_form: ``"floor"`` (``max(||x||, eps)``) or ``"add"`` (``||x|| + eps``).
    alpha: power of the nuclear-norm factor.
    nuclear_norm_axes: batch axes over which ``ν`` is summed, so their matrices share
      one factor (Lau & Su's batched experts); default one per matrix.
    polar: Newton-Schulz (:class:`NewtonSchulz`, the default) or the Gram inverse
      square root (:class:`InverseSqrt`, as :func:`scale_by_right_spectral`).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> tx = scale_by_hybrid(unit_axis=0, center=True)  # a (V, d) tied embedding
    >>> g = {"embed": jax.random.normal(jax.random.key(0), (16, 4))}
    >>> u = tx.update(g, tx.init(g))[0]["embed"]
    >>> bool(jnp.allclose(u.mean(axis=0), 0.0, atol=1e-5))
    True

  References:
    Lau and Su, `Symmetry-Compatible Principle for Optimizer Design`, 2026; Amsel et
    al., `The Polar Express <https://arxiv.org/abs/2505.16932>`_, 2025.
  """
  if order not in ("row_then_polar", "polar_then_row"):
    raise ValueError(f"order must be 'row_then_polar' or 'polar_then_row', got {order!r}.")
  if not isinstance(polar, (NewtonSchulz, InverseSqrt)):
    raise TypeError(
      "polar must be a saggs_jax.equivariant.NewtonSchulz or InverseSqrt (the Gram inverse"
      f" square root), got {polar!r}."
    )
  dims = unit_dimension_numbers(unit_axis)
  batch_axes = () if dims.batch_axis is None else dims.batch_axis
  if nuclear_norm_axes != () and (
    dims.feature_axis is not None
    or not set(_as_tuple(nuclear_norm_axes)) <= set(_as_tuple(batch_axes))
  ):
    raise ValueError(
      f"nuclear_norm_axes {nuclear_norm_axes} must be among the named batch axes of "
      f"{dims} (and its feature_axis None)."
    )
  p = _maybe_center(center)
  row = lambda x: linalg.row_normalize(x, eps, eps_form)

  def polar_and_scale(x):
    if isinstance(polar, InverseSqrt):
      o, nu = _inverse_sqrt_polar(x, eps, polar)
    else:
      ns = polar
      o = linalg.newton_schulz(x, ns.coeffs, ns.steps, ns.dtype, eps, eps_form, ns.gram)
      nu = jnp.sum(o * x, axis=(-2, -1), keepdims=True)
    if nuclear_norm_axes != ():
      batch = sorted(_normalize(batch_axes, x.ndim))
      shared = tuple(batch.index(a) for a in _normalize(nuclear_norm_axes, x.ndim))
      nu = jnp.sum(nu, axis=shared, keepdims=True)
    return _nuclear_scale(nu, alpha, eps) * o

  def direction(m):
    if order == "polar_then_row":
      return p(row(polar_and_scale(p(m))))
    return p(polar_and_scale(p(row(p(m)))))

  return _rule(
    "scale_by_hybrid",
    unit_planner(dims),
    direction,
    beta=beta,
    nesterov=False,
    joint=joint,
    batched=nuclear_norm_axes == (),
    whole=True,
  )


# Lau & Su's reference code (timlautk/equivariant_optimizers): the keyword
# arguments that make each rule compute what its class computes. Add the
# block's layout; for its torch (out, in) tensors:
#   MuonHeadsPolarExpress: scale_by_polar(1, 0), per head Heads(num=H, axis=0)
#     (q/k/v) or Heads(num=H, axis=1) (o);
#   BatchedExpertMuonPolarExpress (E, a, b): scale_by_polar(2, 1, 0), "col"
#     scale_by_polar(1, 2, 0), gpt-oss pairs Heads(num=2, axis=2, interleaved=True),
#     OLMoE pairs Heads(num=2, axis=1);
#   RowNormM / HybridPolarGradM: unit_axis=0 ("row") or 1 ("col"),
#     center=center_rows, and the hybrid's order, alpha, gram="left" when left;
#   BatchedExpert{RowNormM,HybridPolarGradM}: UnitDimensionNumbers with
#     batch_axis=0 and unit_axis=1 ("row", OLMoE pairs with fused=2) or 2
#     ("col", gpt-oss pairs with fused=2, interleaved=True); the hybrid with
#     nuclear_norm_axes=0;
#   Right/LeftPolarGradM: unit_axis=0, center=center_rows, alpha.
REFERENCE: Mapping[str, Mapping[str, Any]] = MappingProxyType(
  {
    # MuonHeadsPolarExpress, BatchedExpertMuonPolarExpress.
    "scale_by_polar": MappingProxyType(
      dict(ema=False, newton_schulz=NewtonSchulz("polar_express_cushion"), eps=1e-6, eps_form="add")
    ),
    # RowNormM, BatchedExpertRowNormM (row_mode="inverse_eps").
    "scale_by_row_norm": MappingProxyType(dict(eps=1e-8, eps_form="add")),
    # RightPolarGradM, LeftPolarGradM (backend="polar_express", num_steps=5).
    "scale_by_right_spectral": MappingProxyType(
      dict(
        eps=1e-8, inverse_sqrt=InverseSqrt("polar_express_1.05", gram="right", relative_eps=False)
      )
    ),
    "scale_by_left_spectral": MappingProxyType(
      dict(
        eps=1e-8, inverse_sqrt=InverseSqrt("polar_express_1.05", gram="left", relative_eps=False)
      )
    ),
    # HybridPolarGradM, BatchedExpertHybridPolarGradM.
    "scale_by_hybrid": MappingProxyType(
      dict(
        eps=1e-8,
        eps_form="add",
        polar=InverseSqrt("polar_express_1.05", gram="right", relative_eps=False),
      )
    ),
  }
)
