"""Routing parameters to update rules by path, and Lau and Su's layerwise stack."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from saggs_jax._src.equivariant.dimension_numbers import (
  Heads,
  Patterns,
  UnitDimensionNumbers,
)
from saggs_jax._src.equivariant.roles import ROLE_PATTERNS, as_patterns
from saggs_jax._src.equivariant.rules import (
  REFERENCE,
  scale_by_hybrid,
  scale_by_left_spectral,
  scale_by_polar,
  scale_by_row_norm,
)
from saggs_jax._src.equivariant.settings import InverseSqrt, NewtonSchulz
from saggs_jax._src.paths import match, path_str

Rules = (
  Mapping[Patterns, optax.GradientTransformation]
  | Sequence[tuple[Patterns, optax.GradientTransformation]]
)


def optimizer(
  rule: optax.GradientTransformation,
  learning_rate: optax.ScalarOrSchedule,
  weight_decay: optax.ScalarOrSchedule = 0.0,
) -> optax.GradientTransformation:
  """A full optimizer from a ``scale_by_*`` rule, with decoupled weight decay.

    W <- W (1 - η_t λ) - η_t u

  where ``u`` is the rule's update, ``η_t`` the learning rate (a float or an
  optax schedule) and ``λ`` the weight decay. Like ``optax.adamw``, ``update``
  needs the params.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from saggs_jax.equivariant import scale_by_row_norm
    >>> tx = optimizer(scale_by_row_norm(unit_axis=0), 0.1, weight_decay=0.5)
    >>> w = {"embedding": jnp.ones((3, 2))}
    >>> u, _ = tx.update(w, tx.init(w), w)
    >>> optax.apply_updates(w, u)["embedding"][0]  # 1 * (1 - 0.05) - 0.1 / sqrt(2)
    Array([0.8792893, 0.8792893], dtype=float32)
  """
  return optax.chain(
    rule,
    optax.add_decayed_weights(weight_decay),
    optax.scale_by_learning_rate(learning_rate),
  )


def layerwise(
  rules: Rules,
  default: optax.GradientTransformation | None = None,
) -> optax.GradientTransformation:
  """Routes every parameter to the transformation whose path pattern matches it.

  Patterns use ``saggs_jax._src.paths.match``: anchored at the end of the path, a
  trailing Flax ``value`` ignored, so the same rules serve plain dicts, Linen
  ``{"params": ...}`` trees and pure ``nnx.State``. Built on
  ``optax.multi_transform``; each transformation sees only its parameters and
  keeps its own state, learning rate and weight decay (see :func:`optimizer`).

  Args:
    rules: ``{pattern or patterns: transformation}`` or a sequence of such pairs.
    default: the transformation for parameters no pattern matches (e.g.
      ``optax.adamw``); without it such a parameter is an error.

  Returns:
    A GradientTransformation. Its ``init`` (and ``update``) raise a ValueError
    naming the parameter path when two patterns match one parameter, when none
    matches and there is no default, and when a rule does not accept the
    parameter's rank.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from saggs_jax.equivariant import scale_by_row_norm
    >>> tx = layerwise({"embed/embedding": optimizer(scale_by_row_norm(0), 0.1)},
    ...                default=optax.adamw(1e-3))
    >>> params = {"embed": {"embedding": jnp.ones((5, 4))}, "norm": {"scale": jnp.ones(4)}}
    >>> state = tx.init(params)
  """
  return _layerwise(list(rules.items() if isinstance(rules, Mapping) else rules), default, ())


def _layerwise(rules, default, wins) -> optax.GradientTransformation:
  """:func:`layerwise` on the ``(patterns, transformation)`` pairs ``rules``: those at indices
  ``wins`` win over the others where both match (a role given in ``patterns`` over the
  defaults: ``gpt-oss``'s ``experts/down_proj/kernel`` is an expert, not a ``down``), and
  ``rule_i`` is the state of ``rules[i]``."""
  entries = [(as_patterns(pats), tx) for pats, tx in rules]
  wins = set(wins)

  def label(key_path, _):
    path = path_str(key_path)
    hits = [
      (p, i) for i, (pats, _) in enumerate(entries) for p in pats if match(p, path) is not None
    ]
    hits = [h for h in hits if h[1] in wins] or hits
    if len(hits) > 1:
      raise ValueError(
        f"Parameter {path!r} is matched by several patterns: {[p for p, _ in hits]}."
      )
    if hits:
      return f"rule_{hits[0][1]}"
    if default is None:
      raise ValueError(f"Parameter {path!r} matches no pattern and there is no default.")
    return "default"

  transforms: dict[Hashable, optax.GradientTransformation] = {
    f"rule_{i}": tx for i, (_, tx) in enumerate(entries)
  }
  if default is not None:
    transforms["default"] = default
  return optax.multi_transform(
    transforms, lambda params: jax.tree_util.tree_map_with_path(label, params)
  )


# Lau & Su's training scripts (timlautk/equivariant_optimizers, train_qwen3.py
# defaults; the router's rate from train_olmoe.py and train_gpt-oss.py):
# learning rate and decoupled weight decay per role, "adamw" for the rest.
REFERENCE_LEARNING_RATES: Mapping[str, float] = MappingProxyType(
  {
    "embedding": 0.5,
    "lm_head": 5e-3,
    "router": 7.5e-4,
    "adamw": 5e-2,
    **{r: 2e-2 for r in ("query", "key_value", "output", "gate_up", "down", "experts")},
  }
)
REFERENCE_WEIGHT_DECAYS: Mapping[str, float] = MappingProxyType(
  {
    "embedding": 0.0,
    "lm_head": 0.0,
    "router": 0.0,
    "adamw": 1e-3,
    **{r: 1e-3 for r in ("query", "key_value", "output", "gate_up", "down", "experts")},
  }
)


class RoleRules(NamedTuple):
  """The rule of each role of :func:`symmetry_compatible` that has a choice; ``None``: the
  preset's (``"row_norm"`` everywhere, but ``mlp="polar"`` for ``preset="reference"``).

  Attributes:
    embedding: rule of an untied embedding: ``"row_norm"`` or ``"hybrid"``.
    lm_head: rule of the LM head (always centred): ``"row_norm"`` or ``"hybrid"``.
    mlp: rule of gate/up and of a column-aware down: ``"row_norm"``, ``"hybrid"`` or
      ``"polar"``.
    down: ``"column"`` (column-aware, the ``mlp`` rule) or ``"polar"``.
    router: rule of an MoE router (always centred): ``"row_norm"`` or ``"left_spectral"``.
  """

  embedding: Literal["row_norm", "hybrid"] | None = None
  lm_head: Literal["row_norm", "hybrid"] | None = None
  mlp: Literal["row_norm", "hybrid", "polar"] | None = None
  down: Literal["column", "polar"] | None = None
  router: Literal["row_norm", "left_spectral"] | None = None


class Decoder(NamedTuple):
  """What :func:`symmetry_compatible` must know of the decoder LM that its parameters'
  names and shapes do not say.

  Attributes:
    num_heads: query / output heads; None (and no ``head_dim``): attention kernels are
      orthogonalised whole.
    num_kv_heads: key / value heads (GQA); default ``num_heads``.
    head_dim: head size; splits every attention kernel, GQA included.
    tie_embeddings: the embedding is also the LM head.
    stacked: hidden-layer parameters carry a leading layer axis (scan).

  Example:
    >>> Decoder(num_heads=12, num_kv_heads=4)
    Decoder(num_heads=12, num_kv_heads=4, head_dim=None, tie_embeddings=False, stacked=False)
  """

  num_heads: int | None = None
  num_kv_heads: int | None = None
  head_dim: int | None = None
  tie_embeddings: bool = False
  stacked: bool = False


class _Preset(NamedTuple):
  """What a preset of :func:`symmetry_compatible` sets: the keyword arguments of each rule by
  name (as :data:`REFERENCE`), its role rules and Newton-Schulz iterations, the experts'
  matrix orientation (transposed: Muon's shape factor of ``(E, in, out)`` experts),
  AdamW's ``b2``, and its rates and weight decays per role (``None``: the builder's)."""

  settings: Mapping[str, Mapping[str, Any]]
  rules: RoleRules
  newton_schulz: NewtonSchulz
  experts_transposed: bool
  adamw_b2: float
  learning_rates: Mapping[str, float] | None
  weight_decays: Mapping[str, float] | None


_ROW_NORM = RoleRules("row_norm", "row_norm", "row_norm", "column", "row_norm")
PRESETS: Mapping[str, _Preset] = MappingProxyType(
  {
    "default": _Preset(MappingProxyType({}), _ROW_NORM, NewtonSchulz(), False, 0.999, None, None),
    "reference": _Preset(
      REFERENCE,
      _ROW_NORM._replace(mlp="polar"),
      NewtonSchulz("polar_express_cushion"),
      experts_transposed=True,
      adamw_b2=0.95,
      learning_rates=REFERENCE_LEARNING_RATES,
      weight_decays=REFERENCE_WEIGHT_DECAYS,
    ),
  }
)
_MATRICES = ("query", "key_value", "output", "gate_up", "down", "experts")


def symmetry_compatible(
  learning_rate: optax.ScalarOrSchedule | None = None,
  *,
  preset: Literal["default", "reference"] = "default",
  weight_decay: optax.ScalarOrSchedule | None = None,
  learning_rates: Mapping[str, optax.ScalarOrSchedule] | None = None,
  weight_decays: Mapping[str, optax.ScalarOrSchedule] | None = None,
  decoder: Decoder = Decoder(),
  rules: RoleRules = RoleRules(),
  patterns: Mapping[str, Patterns] | None = None,
  beta: float = 0.95,
  newton_schulz: NewtonSchulz | None = None,
) -> optax.GradientTransformation:
  """The symmetry-compatible layerwise stack for a decoder LM (Lau and Su 2026).

  Polar per head or expert, row-norm on embedding, LM head, SwiGLU and router, AdamW for
  the rest; roles found by path pattern (the table and presets: ``docs/equivariant.md``).

  Args:
    learning_rate: of the matrix rules; required by ``preset="default"``.
    preset: ``"default"`` or ``"reference"`` (Lau & Su's scripts' stack and rates).
    weight_decay: decoupled weight decay of the matrix rules.
    learning_rates: per-role overrides; ``"adamw"``: AdamW's (default ``learning_rate``).
    weight_decays: per-role overrides; ``"adamw"``: AdamW's (default 0 for ``"default"``).
    decoder: the heads, tied embeddings and scanned layers (:class:`Decoder`).
    rules: the rule of each role that has a choice (:class:`RoleRules`).
    patterns: per-role overrides of :data:`ROLE_PATTERNS` (e.g. ``discover(...).roles``);
      ``"adamw"`` names matrices that stay on AdamW on purpose.
    beta: momentum decay of every rule (default 0.95).
    newton_schulz: the polar and hybrid rules' :class:`NewtonSchulz`; default the preset's.

  Raises:
    ValueError: an unknown preset; at ``init``, a role that matches no parameter while a
      matrix falls to AdamW, or a matrix no role matches, naming the role or path.
    TypeError: no ``learning_rate`` where required; ``rules`` or ``decoder`` mistyped.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> params = {"embed": {"embedding": jnp.ones((32, 8))},
    ...           "layers_0": {"q_proj": {"kernel": jnp.ones((8, 8))},
    ...                        "norm": {"scale": jnp.ones(8)}},
    ...           "lm_head": {"kernel": jnp.ones((8, 32))}}
    >>> tx = symmetry_compatible(0.02, learning_rates={"adamw": 3e-4}, decoder=Decoder(num_heads=2))
    >>> updates, state = tx.update(params, tx.init(params), params)
    >>> [round(float(jnp.linalg.norm(row)), 6) for row in updates["embed"]["embedding"][:2]]
    [0.02, 0.02]
    >>> round(float(updates["layers_0"]["norm"]["scale"][0]), 6)  # AdamW's first step
    -0.0003

  References:
    Lau and Su, `Symmetry-Compatible Principle for Optimizer Design: Embeddings, LM Heads,
    SwiGLU MLPs, and MoE Routers`, 2026; scripts in timlautk/equivariant_optimizers.
  """
  if preset not in PRESETS:
    raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}.")
  chosen = PRESETS[preset]
  if chosen.learning_rates is None and learning_rate is None:
    raise TypeError(f"symmetry_compatible(preset={preset!r}) needs a learning_rate.")
  if not isinstance(rules, RoleRules):
    raise TypeError(f"rules must be a RoleRules, got {rules!r}.")
  if not isinstance(decoder, Decoder):
    raise TypeError(f"decoder must be a saggs_jax.equivariant.Decoder, got {decoder!r}.")
  given = rules._asdict()
  choices = _Choices(
    decoder.num_heads,
    decoder.num_kv_heads,
    decoder.head_dim,
    decoder.tie_embeddings,
    RoleRules(**{k: given[k] or v for k, v in chosen.rules._asdict().items()}),
    decoder.stacked,
    patterns,
    beta,
    chosen.newton_schulz if newton_schulz is None else newton_schulz,
  )
  if chosen.weight_decays is None:  # the default preset: no weight decay unless given
    weight_decay = 0.0 if weight_decay is None else weight_decay
    weight_decays = {"adamw": 0.0, **(weight_decays or {})}
  tied = decoder.tie_embeddings
  lrs = _rates(chosen.learning_rates, learning_rate, learning_rates, tied)
  wds = _rates(chosen.weight_decays, weight_decay, weight_decays, tied)
  return _stack(chosen, choices, lrs, wds)


def _rates(table, value, overrides, tied) -> dict[str, optax.ScalarOrSchedule]:
  """A learning rate (or weight decay) per role. Without a preset ``table``: ``value`` for
  every role, AdamW's included. With one: the table's, ``value`` for the matrix roles where
  given, and a ``tied`` embedding the LM head's, as Lau & Su's scripts route it. Then
  ``overrides`` (``"adamw"``: AdamW's)."""
  if table is None:
    rates = {**dict.fromkeys(ROLE_PATTERNS, value), "adamw": value}
    return {**rates, **(overrides or {})}
  rates = dict(table)
  if value is not None:
    rates.update(dict.fromkeys(_MATRICES, value))
  rates.update(overrides or {})
  if tied and "embedding" not in (overrides or {}):
    rates["embedding"] = rates["lm_head"]
  return rates


class _Choices(NamedTuple):
  """The builder's arguments that :func:`_stack` reads, the preset's defaults filled in."""

  num_heads: int | None
  num_kv_heads: int | None
  head_dim: int | None
  tie_embeddings: bool
  rules: RoleRules
  stacked: bool
  patterns: Mapping[str, Patterns] | None
  beta: float
  newton_schulz: NewtonSchulz


def _stack(
  preset: _Preset,
  c: _Choices,
  lrs: Mapping[str, optax.ScalarOrSchedule],
  wds: Mapping[str, optax.ScalarOrSchedule],
) -> optax.GradientTransformationExtraArgs:
  """The stack of every preset: each role's rule, with ``preset.settings`` per rule name,
  under :func:`optimizer` with its rate ``lrs[role]`` and decay ``wds[role]``, AdamW for
  the rest."""
  roles = {**ROLE_PATTERNS}
  for overrides in (c.patterns or {}, lrs, wds):
    if unknown := set(overrides) - set(roles) - {"adamw"}:
      raise ValueError(
        f"Unknown roles {sorted(unknown)}; the roles are {sorted(roles) + ['adamw']}."
      )
  given = {r: as_patterns(p) for r, p in (c.patterns or {}).items()}
  kept = given.pop("adamw", ())  # the matrices that stay on AdamW on purpose
  roles.update(given)
  if c.rules.down not in ("column", "polar"):
    raise ValueError(f"down must be 'column' or 'polar', got {c.rules.down!r}.")
  layer = (0,) if c.stacked else ()
  ns = dict(newton_schulz=c.newton_schulz)

  def settings(rule, **ns):  # the momentum, the preset's keywords, then the builder's ns
    return {"beta": c.beta, **preset.settings.get(rule, {}), **ns}

  def polar(*axes, **kw):
    return scale_by_polar(*axes, **settings("scale_by_polar", **ns), **kw)

  def units(kind, unit_axis, center=False, batch_axis=(), joint=()):
    dims = UnitDimensionNumbers(unit_axis, batch_axis=batch_axis)
    if kind == "row_norm":
      return scale_by_row_norm(dims, center=center, joint=joint, **settings("scale_by_row_norm"))
    if kind == "hybrid":
      kw = settings("scale_by_hybrid")
      if not isinstance(kw.get("polar"), InverseSqrt):  # Newton-Schulz: the stack's iterations
        kw["polar"] = c.newton_schulz
      return scale_by_hybrid(dims, center=center, joint=joint, **kw)
    if kind == "left_spectral":
      return scale_by_left_spectral(
        dims, center=center, joint=joint, **settings("scale_by_left_spectral")
      )
    raise ValueError(f"Unknown rule {kind!r}.")

  def heads(n, axis):
    if c.head_dim is not None:
      return polar(batch_axes=layer, heads=Heads(dim=c.head_dim, axis=axis))
    return polar(batch_axes=layer, heads=None if n is None else Heads(num=n, axis=axis))

  if c.rules.mlp == "polar":
    gate_up = down_rule = polar(batch_axes=layer)
  else:
    gate_up = units(c.rules.mlp, -1, batch_axis=layer, joint=roles["gate_up"])
    down_rule = (
      units(c.rules.mlp, -2, batch_axis=layer)
      if c.rules.down == "column"
      else polar(batch_axes=layer)
    )
  experts = layer + (len(layer),)
  rules = {
    "embedding": units(c.rules.lm_head, 0, center=True)
    if c.tie_embeddings
    else units(c.rules.embedding, 0),
    "lm_head": units(c.rules.lm_head, 1, center=True),
    "query": heads(c.num_heads, -1),
    "key_value": heads(c.num_kv_heads or c.num_heads, -1),
    "output": heads(c.num_heads, -2),
    "gate_up": gate_up,
    "down": down_rule,
    "router": units(c.rules.router, -1, center=True, batch_axis=layer),
    "experts": polar(-1, -2, experts) if preset.experts_transposed else polar(batch_axes=experts),
  }
  default = optax.adamw(lrs["adamw"], b2=preset.adamw_b2, weight_decay=wds["adamw"])
  # A role given in patterns (AdamW's too) claims its leaves from the others.
  entries = [(roles[r], optimizer(rules[r], lrs[r], wds[r])) for r in roles]
  tx = _layerwise(
    entries + [(kept, default)] * bool(kept),
    default,
    [i for i, r in enumerate(roles) if r in given] + [len(entries)] * bool(kept),
  )
  optional = {"router", "experts"} | ({"lm_head"} if c.tie_embeddings else set())
  return _routed(tx, {**roles, "adamw": kept}, set(c.patterns or ()), optional, len(layer))


def _is_bias(path: str) -> bool:
  """A bias, however many axes it has (gpt-oss's ``(experts, width)`` ones): AdamW's."""
  name = path.rsplit("/", 1)[-1]
  return name in ("bias", "b") or name.endswith("_bias")


def _routed(tx, roles, given, optional, stacked) -> optax.GradientTransformationExtraArgs:
  """``tx`` whose ``init`` rejects a role that matches no parameter (one given in
  ``patterns``, or any but ``optional`` ones while a matrix falls to AdamW, as every matrix
  of a model named otherwise would), and a matrix that falls to AdamW unless ``roles["adamw"]``
  keeps it there on purpose."""

  def init(params):
    flat = [(path_str(k), x) for k, x in jax.tree_util.tree_flatten_with_path(params)[0]]
    if not flat:  # optax.tree.map_params's placeholder, an empty model: nothing to route
      return tx.init(params)
    hits = {
      r: [p for p, _ in flat if any(match(q, p) is not None for q in pats)]
      for r, pats in roles.items()
    }
    routed = set().union(*hits.values())
    adamw = [
      p for p, x in flat if p not in routed and jnp.ndim(x) >= 2 + stacked and not _is_bias(p)
    ]
    empty = [
      r
      for r in roles
      if not hits[r] and (r in given or (adamw and r not in optional and r != "adamw"))
    ]
    fix = ". Pass patterns={role: [...]} or {'adamw': [...]}."
    listed = f"{adamw[:4]}{' ...' if len(adamw) > 4 else ''}"
    if empty:
      raise ValueError(
        "symmetry_compatible: "
        + "; ".join(f"role {r!r} matches no parameter (patterns {list(roles[r])})" for r in empty)
        + (f", and {listed} fall to AdamW" if adamw else "")
        + fix
      )
    if adamw:
      raise ValueError(
        f"symmetry_compatible: the matrices {listed} match no role and would fall to AdamW" + fix
      )
    return tx.init(params)

  return optax.GradientTransformationExtraArgs(init, tx.update)
