"""saggs_jax._src.equivariant.rules: each rule against a float64 NumPy reference of its definition,
its symmetry group, zero rows, dtypes, per-head and joint layouts, and the errors that name a
parameter that does not fit.

Rules run with beta=0 (the update is the direction of the gradient itself) and
float32 Polar Express iterations unless a test is about the defaults.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from equivariant_oracles import (
  EXACT_NS,
  F,
  U,
  center,
  close,
  left_spectral,
  nuclear,
  orthogonal,
  polar,
  rand,
  right_spectral,
  row_norm,
)
from saggs_jax import equivariant as eqv

# name -> (rule with units on axis 0, reference, centred, zero rows stay zero)
RULES = {
  "row_norm": (eqv.scale_by_row_norm(0, beta=0.0), row_norm, False, True),
  "row_norm_centered": (
    eqv.scale_by_row_norm(0, center=True, beta=0.0),
    lambda x: center(row_norm(center(x))),
    True,
    False,
  ),
  "right_spectral": (eqv.scale_by_right_spectral(0, beta=0.0), right_spectral, False, True),
  "right_spectral_centered": (
    eqv.scale_by_right_spectral(0, center=True, beta=0.0),
    lambda x: right_spectral(center(x)),
    True,
    False,
  ),
  "left_spectral": (
    eqv.scale_by_left_spectral(0, beta=0.0),
    lambda x: center(left_spectral(center(x))),
    True,
    False,
  ),
  "hybrid_row_then_polar": (
    eqv.scale_by_hybrid(0, beta=0.0, polar=EXACT_NS["newton_schulz"]),
    lambda x: nuclear(row_norm(x)) * polar(row_norm(x)),
    False,
    True,
  ),
  "hybrid_row_then_polar_centered": (  # re-centred between R and the polar step
    eqv.scale_by_hybrid(0, center=True, beta=0.0, polar=EXACT_NS["newton_schulz"]),
    lambda x: center(nuclear(center(row_norm(center(x)))) * polar(center(row_norm(center(x))))),
    True,
    False,
  ),
  "hybrid_polar_then_row": (
    eqv.scale_by_hybrid(0, order="polar_then_row", beta=0.0, polar=EXACT_NS["newton_schulz"]),
    lambda x: row_norm(polar(x)),
    False,
    True,
  ),
  "hybrid_polar_then_row_centered": (
    eqv.scale_by_hybrid(
      0, order="polar_then_row", center=True, beta=0.0, polar=EXACT_NS["newton_schulz"]
    ),
    lambda x: center(row_norm(polar(center(x)))),
    True,
    False,
  ),
  "polar": (eqv.scale_by_polar(0, 1, beta=0.0, **EXACT_NS), polar, False, True),
}
# One jitted update per rule, shared by every test that uses it.
STEP = {
  name: jax.jit(lambda g, tx=tx: tx.update(g, tx.init(g))[0]) for name, (tx, *_) in RULES.items()
}


@pytest.mark.parametrize("name", RULES)
def test_rule_matches_definition(name):
  _, reference, *_ = RULES[name]
  g = rand(0, (U, F), np.float32)
  close(STEP[name](g), reference(g.astype(np.float64)), rtol=2e-4)


@pytest.mark.parametrize("name", RULES)
def test_rule_equivariance(name):
  _, _, centred, _ = RULES[name]
  g = rand(1, (U, F), np.float32)
  out = np.asarray(STEP[name](g), np.float64)
  if name == "polar":  # orthogonal on both sides
    a, b = orthogonal(2, U), orthogonal(3, F)
    close(STEP[name]((a @ g @ b).astype(np.float32)), a @ out @ b)
  else:  # unit permutations x orthogonal maps of the features
    perm, q = np.random.default_rng(2).permutation(U), orthogonal(3, F)
    close(STEP[name]((g[perm] @ q).astype(np.float32)), out[perm] @ q)
  if centred:  # a shared shift of every unit vector changes nothing
    close(STEP[name](g + 3.0 * rand(4, (1, F), np.float32)), out, rtol=1e-3)


@pytest.mark.parametrize("name", RULES)
def test_zero_gradients(name):
  *_, zero_rows_stay = RULES[name]
  zero = np.asarray(STEP[name](np.zeros((U, F), np.float32)))
  assert np.all(zero == 0.0)
  g = rand(5, (U, F), np.float32)
  g[[2, 7]] = 0.0
  out = np.asarray(STEP[name](g))
  assert np.all(np.isfinite(out))
  if zero_rows_stay:
    assert np.all(out[[2, 7]] == 0.0)


@pytest.mark.parametrize(
  "name", ["row_norm_centered", "left_spectral", "hybrid_row_then_polar", "polar"]
)
def test_bfloat16_in_bfloat16_out(name):
  tx = RULES[name][0]
  g = rand(6, (U, F), np.float32)
  state = tx.init(jnp.asarray(g, jnp.bfloat16))
  chex.assert_trees_all_equal_dtypes(state.mu, jnp.zeros((), jnp.bfloat16))
  out = STEP[name](jnp.asarray(g, jnp.bfloat16))
  assert out.dtype == jnp.bfloat16
  close(out, STEP[name](jnp.asarray(g, jnp.bfloat16).astype(jnp.float32)), rtol=3e-2)


def test_unit_axis_and_momentum():
  """A (d, V) LM-head layout (units on axis 1) and two EMA steps."""
  tx = eqv.scale_by_row_norm(1, center=True, beta=0.9)
  g1, g2 = rand(7, (F, U), np.float32), rand(8, (F, U), np.float32)
  state = tx.init(g1)
  _, state = tx.update(g1, state)
  out, state = tx.update(g2, state)
  mu = 0.9 * (0.1 * g1) + 0.1 * g2
  close(state.mu, mu)
  close(out, center(row_norm(center(mu.T))).T)


def test_polar_nesterov_and_width_scale():
  tx = eqv.scale_by_polar(beta=0.9, **EXACT_NS)
  g1, g2 = rand(9, (4, 10), np.float32), rand(10, (4, 10), np.float32)
  _, state = tx.update(g1, tx.init(g1))
  out, _ = tx.update(g2, state)
  mu = 0.9 * (0.1 * g1) + 0.1 * g2
  close(out, np.sqrt(10 / 4) * polar(0.9 * mu + 0.1 * g2), rtol=1e-3)


# ------------------------------------------------------ heads, stacks, pairs


def test_polar_per_head_layouts():
  d, heads, hd = 8, 2, 4
  g = rand(11, (d, heads * hd), np.float32)
  per_head = np.concatenate([polar(g[:, h * hd : (h + 1) * hd]) for h in range(heads)], axis=1)
  for tx in (
    eqv.scale_by_polar(heads=eqv.Heads(num=heads), beta=0.0, **EXACT_NS),
    eqv.scale_by_polar(heads=eqv.Heads(dim=hd), beta=0.0, **EXACT_NS),
  ):
    close(tx.update(g, tx.init(g))[0], per_head, rtol=1e-3)
  # The same kernel as a (d, H, hd) DenseGeneral: heads as a batch axis.
  tx = eqv.scale_by_polar(0, 2, 1, beta=0.0, **EXACT_NS)
  g3 = g.reshape(d, heads, hd)
  close(tx.update(g3, tx.init(g3))[0], per_head.reshape(d, heads, hd), rtol=1e-3)
  # An output kernel (H*hd, d): heads split the rows; scale sqrt(d / hd).
  tx = eqv.scale_by_polar(heads=eqv.Heads(num=heads, axis=-2), beta=0.0, **EXACT_NS)
  go = g.T
  expected = np.concatenate([polar(go[h * hd : (h + 1) * hd]) for h in range(heads)], axis=0)
  close(tx.update(go, tx.init(go))[0], np.sqrt(d / hd) * expected, rtol=1e-3)


def test_heads_name_their_count_or_their_size_exactly_once():
  """A Heads record gives num or dim, not both or neither; a bare int in its place (the
  former num_heads=) is a TypeError naming the record."""
  for bad in (eqv.Heads(), eqv.Heads(num=2, dim=4)):
    with pytest.raises(ValueError, match=r"Heads\(num=...\) or Heads\(dim=...\)"):
      eqv.scale_by_polar(heads=bad)
  with pytest.raises(TypeError, match="saggs_jax.equivariant.Heads"):
    eqv.scale_by_polar(heads=2)  # type: ignore[arg-type]


def test_batch_axes_are_independent_copies():
  """Stacked layers of experts (L, E, in, out) and stacked LM heads (L, d, V)."""
  g = rand(12, (2, 3, 4, 6), np.float32)
  tx = eqv.scale_by_polar(batch_axes=(0, 1), beta=0.0, **EXACT_NS)
  out = np.asarray(tx.update(g, tx.init(g))[0])
  for layer in range(2):
    for e in range(3):
      close(out[layer, e], np.sqrt(6 / 4) * polar(g[layer, e]), rtol=1e-3)
  h = rand(13, (2, F, U), np.float32)
  tx = eqv.scale_by_right_spectral(eqv.UnitDimensionNumbers(-1, batch_axis=0), beta=0.0)
  out = np.asarray(tx.update(h, tx.init(h))[0])
  for layer in range(2):
    close(out[layer], right_spectral(h[layer].T).T, rtol=2e-4)


@pytest.mark.parametrize(
  "tx",
  [
    eqv.scale_by_polar(heads=eqv.Heads(num=2), beta=0.0, **EXACT_NS),
    eqv.scale_by_hybrid(1, beta=0.0, polar=EXACT_NS["newton_schulz"]),
    eqv.scale_by_right_spectral(1, beta=0.0),
  ],
)
def test_same_sized_leaves_share_one_batched_call(tx):
  """Leaves whose matrices have one size run as one batch: the result is
  each leaf's own update."""
  tree = {
    f"layer_{i}": rand(40 + i, shape, np.float32)
    for i, shape in enumerate([(6, 8), (6, 8), (6, 8), (4, 8), (8, 6)])
  }
  out = tx.update(tree, tx.init(tree))[0]
  for name, g in tree.items():
    close(out[name], tx.update(g, tx.init(g))[0], rtol=1e-3)


SWIGLU = {
  "layers_0": {
    "mlp": {
      "gate_proj": {"kernel": rand(14, (F, U), np.float32)},
      "up_proj": {"kernel": rand(15, (F, U), np.float32)},
    }
  },
  "layers_1": {
    "mlp": {
      "gate_proj": {"kernel": rand(16, (F, U), np.float32)},
      "up_proj": {"kernel": rand(17, (F, U), np.float32)},
    }
  },
}
JOINT = ("gate_proj/kernel", "up_proj/kernel")


@pytest.mark.parametrize(
  "make, reference",
  [
    (eqv.scale_by_row_norm, row_norm),
    (eqv.scale_by_right_spectral, right_spectral),
  ],
)
def test_swiglu_gate_up_share_neurons(make, reference):
  """Units are hidden neurons; a neuron's vector is [gate column, up column]."""
  tx = make(-1, joint=JOINT, beta=0.0)
  out = tx.update(SWIGLU, tx.init(SWIGLU))[0]
  for layer in ("layers_0", "layers_1"):
    gate, up = (SWIGLU[layer]["mlp"][k]["kernel"] for k in ("gate_proj", "up_proj"))
    expected = reference(np.concatenate([gate.T, up.T], axis=1).astype(np.float64))
    close(out[layer]["mlp"]["gate_proj"]["kernel"], expected[:, :F].T)
    close(out[layer]["mlp"]["up_proj"]["kernel"], expected[:, F:].T)


def test_joint_errors_name_the_path():
  lonely = {"layers_0": {"mlp": {"gate_proj": {"kernel": np.zeros((F, U), np.float32)}}}}
  with pytest.raises(ValueError, match="layers_0/mlp/gate_proj/kernel"):
    eqv.scale_by_row_norm(-1, joint=JOINT).init(lonely)
  mismatched = {
    "mlp": {"gate_proj": {"kernel": np.zeros((F, U))}, "up_proj": {"kernel": np.zeros((F, U + 1))}}
  }
  with pytest.raises(ValueError, match="mlp/up_proj/kernel"):
    eqv.scale_by_row_norm(-1, joint=JOINT).init(mismatched)


@pytest.mark.parametrize(
  "name, kwargs, shape",
  [
    ("scale_by_row_norm", dict(unit_axis=0), (4,)),
    ("scale_by_right_spectral", dict(unit_axis=0), (4,)),
    ("scale_by_left_spectral", dict(unit_axis=0), (2, 3, 4)),
    ("scale_by_hybrid", dict(unit_axis=1), (2, 3, 4)),
    ("scale_by_polar", {}, (2, 3, 4)),
    ("scale_by_polar", dict(heads=eqv.Heads(num=3)), (4, 8)),
  ],
)
def test_wrong_rank_or_layout_names_the_rule_and_path(name, kwargs, shape):
  """The error names the rule the user called, and the parameter."""
  with pytest.raises(ValueError, match=f"^{name}: parameter 'block/w' of shape"):
    getattr(eqv, name)(**kwargs).init({"block": {"w": np.zeros(shape)}})


# ------------------------------------------------------ Newton-Schulz numerics


# ------------------------------------------------------------ routing, stack


# --------------------------------------------- Gram Newton-Schulz, inverse root


def test_polar_rule_with_gram_newton_schulz():
  g = rand(31, (8, 3 * 16), np.float32)  # three (8, 16) heads
  tx, gram_tx = (
    eqv.scale_by_polar(
      heads=eqv.Heads(num=3), beta=0.0, newton_schulz=EXACT_NS["newton_schulz"]._replace(gram=flag)
    )
    for flag in (False, True)
  )
  close(gram_tx.update(g, gram_tx.init(g))[0], tx.update(g, tx.init(g))[0], rtol=1e-4)
