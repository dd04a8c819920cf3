"""Layouts as dimension numbers: the rules given ``MuonDimensionNumbers`` /
``UnitDimensionNumbers``, the trees ``discover`` and the presets emit, and the
round trip with ``optax.contrib.muon``: the same tree in optax's Muon and the
library's polar rule with the same coefficients gives the same trajectory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers as MDN

import discover_models as dm
import saggs_jax as saggs
from saggs_jax import equivariant as eqv
from saggs_jax._src.equivariant import linalg

EXACT_NS = {"newton_schulz": eqv.NewtonSchulz("polar_express", steps=10, dtype=jnp.float32)}


def polar(x):
  u, _, vt = np.linalg.svd(x, full_matrices=False)
  return u @ vt


def one_step(tx, g):
  return jax.jit(lambda g: tx.update(g, tx.init(g), g)[0])(g)


def gaussian(shape, seed=0):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------- the rules


def test_polar_takes_muon_dimension_numbers_like_its_axes_and_a_numpy_oracle():
  # (out0, batch, out1, red): tuples, a negative axis and a batch axis in the middle.
  g = {"w": gaussian((4, 3, 2, 6))}
  dims = one_step(
    eqv.scale_by_polar(MDN(reduction_axis=-1, output_axis=(0, 2)), beta=0.0, **EXACT_NS), g
  )
  axes = one_step(eqv.scale_by_polar(3, (0, 2), 1, beta=0.0, **EXACT_NS), g)
  np.testing.assert_array_equal(dims["w"], axes["w"])
  # Oracle: rows = axis 3, columns = axes (0, 2) in that order, one matrix per index of axis 1.
  x = np.asarray(g["w"], np.float64)
  want = np.empty_like(x)
  for b in range(3):
    m = x[:, b].transpose(2, 0, 1).reshape(6, 8)  # m[r, c0 * 2 + c2] = x[c0, b, c2, r]
    want[:, b] = (np.sqrt(8 / 6) * polar(m)).reshape(6, 4, 2).transpose(1, 2, 0)
  np.testing.assert_allclose(dims["w"], want, atol=2e-3)


def test_polar_dimension_numbers_batch_every_other_axis_heads_included():
  g = {"q": gaussian((2, 8, 12), 1)}  # (layers, d, H*hd)
  dims = one_step(eqv.scale_by_polar(MDN(-2, -1), heads=eqv.Heads(num=3), beta=0.0, **EXACT_NS), g)
  axes = one_step(eqv.scale_by_polar(batch_axes=0, heads=eqv.Heads(num=3), beta=0.0, **EXACT_NS), g)
  np.testing.assert_array_equal(dims["q"], axes["q"])
  head = np.asarray(g["q"][1, :, 4:8], np.float64)
  np.testing.assert_allclose(dims["q"][1, :, 4:8], polar(head), atol=2e-3)


def test_unit_rules_take_unit_dimension_numbers_like_their_axes():
  g = {"gate": gaussian((2, 4, 3), 2)}  # (layers, d, F): the F neurons are the units
  muon_style = eqv.UnitDimensionNumbers.from_muon(MDN(-2, -1), units="output")
  explicit = eqv.UnitDimensionNumbers(2, batch_axis=0)
  a = one_step(eqv.scale_by_row_norm(muon_style, beta=0.0), g)["gate"]
  b = one_step(eqv.scale_by_row_norm(explicit, beta=0.0), g)["gate"]
  x = np.asarray(g["gate"])
  np.testing.assert_allclose(a, x / np.linalg.norm(x, axis=1, keepdims=True), rtol=1e-6)
  np.testing.assert_array_equal(a, b)
  h1 = one_step(eqv.scale_by_hybrid(muon_style, beta=0.0, polar=EXACT_NS["newton_schulz"]), g)[
    "gate"
  ]
  h2 = one_step(eqv.scale_by_hybrid(explicit, beta=0.0, polar=EXACT_NS["newton_schulz"]), g)["gate"]
  np.testing.assert_array_equal(h1, h2)
  assert muon_style.to_muon(units="output") == MDN(-2, -1)


@pytest.mark.parametrize(
  "make, match",
  [
    (lambda: eqv.scale_by_polar(MDN(0, (1, 0))), "'w' of shape \\(3, 4\\).*overlap"),
    (lambda: eqv.scale_by_polar(MDN(0, 2)), "'w' of shape \\(3, 4\\).*out of range"),
    (
      lambda: eqv.scale_by_row_norm(eqv.UnitDimensionNumbers(0, feature_axis=1, batch_axis=1)),
      "'w' of shape \\(3, 4\\).*do not partition rank 2",
    ),
  ],
)
def test_bad_dimension_numbers_name_the_parameter(make, match):
  tx = make()
  with pytest.raises(ValueError, match=match):
    tx.init({"w": jnp.ones((3, 4))})


def test_dimension_numbers_misuse_is_refused_at_construction():
  with pytest.raises(ValueError, match="give neither output_axes nor batch_axes"):
    eqv.scale_by_polar(MDN(0, 1), batch_axes=0)
  with pytest.raises(TypeError, match="which side holds the units"):
    eqv.scale_by_row_norm(MDN(0, 1))
  with pytest.raises(ValueError, match="single axis"):
    eqv.UnitDimensionNumbers.from_muon(MDN((0, 1), 2), units="reduction")
  with pytest.raises(ValueError, match="Muon cannot split fused"):
    eqv.UnitDimensionNumbers(0, 1, fused=2).to_muon(units="reduction")


# ------------------------------------------------------------- the trees


def test_muon_dimension_numbers_tree_and_its_errors():
  params = {
    "a": {"kernel": jnp.ones((2, 3))},
    "b": {"kernel": jnp.ones((2, 3, 4))},
    "norm": jnp.ones(3),
  }
  tree = saggs.equivariant.muon_dimension_numbers(
    params, {"a/kernel": MDN(0, 1), "b/kernel": MDN(-2, -1)}
  )
  assert tree == {"a": {"kernel": MDN(0, 1)}, "b": {"kernel": MDN(-2, -1)}, "norm": None}
  with pytest.raises(ValueError, match="'norm' of shape \\(3,\\)"):
    saggs.equivariant.muon_dimension_numbers(params, {"norm": MDN(0, 1)})
  with pytest.raises(ValueError, match="'a/kernel' matches patterns with different"):
    saggs.equivariant.muon_dimension_numbers(params, {"a/kernel": MDN(0, 1), "a/*": MDN(1, 0)})
  with pytest.raises(ValueError, match="No parameter matches"):
    saggs.equivariant.muon_dimension_numbers(params, {"q_proj/kernel": MDN(0, 1)})
  # prefix restricts a mapping's patterns as it does a preset's layout.
  nested = {"enc": params, "dec": params}
  tree = saggs.equivariant.muon_dimension_numbers(nested, {"*/kernel": MDN(0, -1)}, prefix="dec")
  assert tree["dec"]["a"]["kernel"] == MDN(0, -1) and tree["enc"]["a"]["kernel"] is None
  with pytest.raises(ValueError, match="Unknown layout 'gpt3'.*or a mapping"):
    saggs.equivariant.muon_dimension_numbers(params, "gpt3")


def test_one_muon_dimension_numbers():
  """One function per concept (issue 45): the presets' layouts are names it takes."""
  assert saggs.equivariant.muon_dimension_numbers is saggs.equivariant.muon_dimension_numbers
  assert not hasattr(saggs.presets, "muon_dimension_numbers")


@pytest.fixture(scope="module")
def scanned_lm():
  forward, params = dm.nnx_lm(scanned=True)
  return params, saggs.discover(forward, params, dm.lm_tokens())


HIDDEN = (
  "attn/q_proj",
  "attn/k_proj",
  "attn/v_proj",
  "attn/o_proj",
  "mlp/gate_proj",
  "mlp/up_proj",
  "mlp/down_proj",
)


def by_path(tree):
  flat = jax.tree_util.tree_flatten_with_path(
    tree, is_leaf=lambda x: x is None or isinstance(x, MDN)
  )[0]
  return {
    jax.tree_util.keystr(k, simple=True, separator="/").removesuffix("/value"): v for k, v in flat
  }


def test_discovery_and_llama_preset_emit_the_hidden_matrices(scanned_lm):
  params, found = scanned_lm
  tree = by_path(found.muon_dimension_numbers(params))
  want = {f"layers/{m}/kernel": MDN(-2, -1) for m in HIDDEN}
  assert {p: d for p, d in tree.items() if d is not None} == want
  assert set(tree) == set(by_path(params))  # embedding, LM head, norms: None
  assert by_path(saggs.equivariant.muon_dimension_numbers(params, "llama")) == tree


def test_optax_muon_with_the_discovered_tree_equals_the_polar_rule(scanned_lm):
  """The round trip: ``discover`` -> tree -> ``optax.contrib.muon`` equals the
  library's polar rule routed to the same roles, with Muon's quintic, its
  ``||X|| + eps`` normaliser, fp32 iterations and plain (non-Nesterov) momentum
  (optax's Nesterov look-ahead mixes bias-corrected terms with step-dependent
  weights; the bias correction of plain momentum is a scale the normaliser removes)."""
  params, found = scanned_lm
  lr, wd, beta, eps = 0.01, 0.1, 0.9, 1e-8
  muon = optax.contrib.muon(
    lr,
    ns_coeffs=linalg.QUINTIC[0],
    ns_steps=5,
    beta=beta,
    eps=eps,
    weight_decay=wd,
    adam_weight_decay=wd,
    nesterov=False,
    muon_weight_dimension_numbers=found.muon_dimension_numbers(params),
  )
  rule = eqv.scale_by_polar(
    MDN(-2, -1),
    beta=beta,
    nesterov=False,
    newton_schulz=eqv.NewtonSchulz(
      eqv.CoefficientSet(linalg.QUINTIC, headroom=1.0), 5, jnp.float32
    ),
    eps=eps,
    eps_form="add",
  )
  hidden = [p for r in ("query", "key_value", "output", "gate_up", "down") for p in found.roles[r]]
  library = eqv.layerwise(
    {tuple(hidden): eqv.optimizer(rule, lr, wd)}, default=optax.adamw(lr, eps=eps, weight_decay=wd)
  )

  def run(tx):
    @jax.jit
    def step(g, s, p):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    p, s = params, tx.init(params)
    for k in range(3):
      p, s = step(dm.random_like(params, 10 + k), s, p)
    return by_path(p)

  got, want = run(muon), run(library)
  moved = 0
  for path in want:
    np.testing.assert_allclose(got[path], want[path], atol=2e-6, rtol=0, err_msg=path)
    moved += any(path.startswith(f"layers/{m}") for m in HIDDEN) and not np.allclose(
      want[path], by_path(params)[path], atol=1e-3
    )
  assert moved == len(HIDDEN)


def test_flax_mha_preset_orthogonalises_each_head_in_optax_and_the_library():
  # (layers, d, H, hd) query and (layers, H, hd, d) output kernels of a scanned MHA.
  g = {
    "attn": {
      "query": {"kernel": gaussian((2, 8, 2, 4), 3)},
      "out": {"kernel": gaussian((2, 2, 4, 8), 4)},
    },
    "ln": {"scale": gaussian((2, 8), 5)},
  }
  tree = saggs.equivariant.muon_dimension_numbers(g, "flax_mha")
  assert tree["ln"]["scale"] is None
  muon = optax.contrib.muon(
    1.0, ns_coeffs=linalg.QUINTIC[0], beta=0.0, nesterov=False, muon_weight_dimension_numbers=tree
  )
  got = one_step(muon, g)
  for leaf in ("query", "out"):
    dims = tree["attn"][leaf]["kernel"]
    rule = eqv.scale_by_polar(
      dims,
      beta=0.0,
      newton_schulz=eqv.NewtonSchulz(eqv.CoefficientSet(linalg.QUINTIC, 1.0), dtype=jnp.float32),
      eps=1e-8,
      eps_form="add",
    )
    want = one_step(rule, g["attn"][leaf]["kernel"])
    np.testing.assert_allclose(-got["attn"][leaf]["kernel"], want, atol=2e-6)
  # One matrix per (layer, head), mapped by the quintic: U f(S / ||X||) V^T in float64.
  for leaf, index, factor in (
    ("query", np.s_[1, :, 0, :], 1.0),
    ("out", np.s_[1, 0], np.sqrt(2.0)),
  ):
    x = np.asarray(g["attn"][leaf]["kernel"][index], np.float64)
    u, s, vt = np.linalg.svd(x, full_matrices=False)
    s = s / np.linalg.norm(x)
    for _ in range(5):
      s = sum(c * s**k for c, k in zip(linalg.QUINTIC[0], (1, 3, 5)))
    np.testing.assert_allclose(
      -got["attn"][leaf]["kernel"][index], factor * (u * s) @ vt, atol=1e-5
    )
