"""saggs_jax._src.equivariant.settings: the settings groups of the rules.

Their defaults are the rules' former keyword defaults: a rule built with the group's default
and one built with each field spelled out compute the same update, bit for bit, and a field
changed in the group changes it."""

import jax
import jax.numpy as jnp
import numpy as np

from saggs_jax import equivariant as eqv

G = jax.random.normal(jax.random.key(0), (6, 4))


def one_step(tx):
  return np.asarray(tx.update(G, tx.init(G))[0])


def test_newton_schulz_defaults():
  assert eqv.NewtonSchulz() == ("polar_express", 5, jnp.bfloat16, False)
  spelled = eqv.NewtonSchulz(coeffs="polar_express", steps=5, dtype=jnp.bfloat16, gram=False)
  np.testing.assert_array_equal(
    one_step(eqv.scale_by_polar()), one_step(eqv.scale_by_polar(newton_schulz=spelled))
  )
  f32 = one_step(eqv.scale_by_polar(newton_schulz=eqv.NewtonSchulz(dtype=jnp.float32)))
  assert not np.array_equal(f32, one_step(eqv.scale_by_polar()))


def test_inverse_sqrt_defaults():
  assert eqv.InverseSqrt() == ("eigh", 5, "smaller", True)
  spelled = eqv.InverseSqrt(method="eigh", steps=5, gram="smaller", relative_eps=True)
  np.testing.assert_array_equal(
    one_step(eqv.scale_by_right_spectral(0)),
    one_step(eqv.scale_by_right_spectral(0, inverse_sqrt=spelled)),
  )
  iterative = eqv.InverseSqrt("polar_express_1.05", steps=5)
  assert not np.array_equal(
    one_step(eqv.scale_by_right_spectral(0, inverse_sqrt=iterative)),
    one_step(eqv.scale_by_right_spectral(0)),
  )
  absolute = eqv.InverseSqrt(relative_eps=False)  # eps=0.1 itself, not 0.1 ||X||_F^2
  assert not np.array_equal(
    one_step(eqv.scale_by_right_spectral(0, eps=0.1, inverse_sqrt=absolute)),
    one_step(eqv.scale_by_right_spectral(0, eps=0.1)),
  )
