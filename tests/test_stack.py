"""saggs_jax.equivariant.stack: the one stack builder and its presets.

The rules themselves are checked against NumPy in test_equivariant.py and against the
reference implementation's golden data in test_equivariant_reference.py; here: what a preset
fills in, and the builder's errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from saggs_jax import equivariant as eqv

D, F, V = 8, 16, 32


def _params():
  keys = iter(jax.random.split(jax.random.key(0), 8))
  normal = lambda shape: jax.random.normal(next(keys), shape)  # noqa: E731
  return {
    "embed": {"embedding": normal((V, D))},
    "layer": {
      "q_proj": {"kernel": normal((D, D))},
      "gate_proj": {"kernel": normal((D, F))},
      "up_proj": {"kernel": normal((D, F))},
      "down_proj": {"kernel": normal((F, D))},
    },
    "lm_head": {"kernel": normal((D, V))},
  }


PARAMS = _params()
GRADS = jax.tree.map(lambda x: jnp.roll(x, 1, axis=0), PARAMS)
NS = eqv.NewtonSchulz(steps=10, dtype=jnp.float32)


def update(tx):
  return jax.tree.map(np.asarray, tx.update(GRADS, tx.init(PARAMS), PARAMS)[0])


def test_none_fields_take_the_presets_rules():
  """``RoleRules()`` under a preset is that preset's rules spelled out, bit for bit."""
  for preset, spelled in eqv.PRESETS.items():
    kw = dict(preset=preset, num_heads=2, newton_schulz=NS, learning_rate=0.1)
    implicit = update(eqv.symmetry_compatible(**kw))
    explicit = update(eqv.symmetry_compatible(**kw, rules=spelled.rules))
    jax.tree.map(np.testing.assert_array_equal, implicit, explicit)
  assert eqv.PRESETS["reference"].rules.mlp == "polar"
  assert eqv.PRESETS["default"].rules == eqv.RoleRules(*["row_norm"] * 3, "column", "row_norm")


def test_a_given_rule_overrides_the_preset():
  polar = update(eqv.symmetry_compatible(0.1, rules=eqv.RoleRules(mlp="polar"), newton_schulz=NS))
  rows = update(eqv.symmetry_compatible(0.1, newton_schulz=NS))
  gate = polar["layer"]["gate_proj"]["kernel"]
  assert not np.allclose(gate, rows["layer"]["gate_proj"]["kernel"])
  s = np.linalg.svd(gate.astype(np.float64) / 0.1, compute_uv=False)  # polar: orthogonal
  np.testing.assert_allclose(s / s.max(), 1.0, atol=2e-2)


def test_reference_preset_needs_no_learning_rate_and_uses_its_tables():
  tx = eqv.symmetry_compatible(preset="reference", num_heads=2, newton_schulz=NS)
  base = update(tx)
  scaled = update(
    eqv.symmetry_compatible(
      preset="reference",
      num_heads=2,
      newton_schulz=NS,
      learning_rates={r: 2 * v for r, v in eqv.REFERENCE_LEARNING_RATES.items()},
    )
  )
  # weight decay is applied after the rate (optax.add_decayed_weights then scale): all of
  # an update doubles with the rate
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, 2 * a, rtol=1e-6), base, scaled)


def test_builder_errors_name_the_argument():
  with pytest.raises(ValueError, match=r"preset must be one of \['default', 'reference'\]"):
    eqv.symmetry_compatible(0.1, preset="paper")  # pyright: ignore[reportArgumentType]
  with pytest.raises(TypeError, match=r"preset='default'\) needs a learning_rate"):
    eqv.symmetry_compatible()
  with pytest.raises(TypeError, match="rules must be a RoleRules"):
    eqv.symmetry_compatible(0.1, rules={"mlp": "polar"})  # pyright: ignore[reportArgumentType]


def test_presets_and_tables_are_read_only():
  for table in (eqv.PRESETS, eqv.REFERENCE, eqv.REFERENCE["scale_by_polar"], eqv.ROLE_PATTERNS):
    with pytest.raises(TypeError):
      table["query"] = ()  # pyright: ignore[reportIndexIssue]
