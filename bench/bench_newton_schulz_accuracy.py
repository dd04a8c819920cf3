"""How close Newton-Schulz comes to the polar factor, per coefficient set and rounding.

The figures once quoted in ``newton_schulz``'s docstring, measured here:

* bands: the smallest and largest singular value of ``newton_schulz(X)`` for
  each coefficient set of ``NS_COEFFS`` at 5 and 6 steps, on ``--count``
  ``16 x 32`` inputs of condition number ``--cond`` (log-spaced singular
  values), matmuls in bfloat16. Polar Express should land closer to 1 than the
  quintic, which never converges (about [0.68, 1.2]).
* rounding: the largest ``|σ - 1|`` of three ways to run the same 8 steps in
  bfloat16: the library's (the factor ``a I + b G + c G²`` and the iterate
  held in float32, only matmul operands rounded), the same with the iterate
  rounded to bfloat16 every step, and the expanded form
  ``a X + (b G + c G²) X`` computed in bfloat16.

  python bench/bench_newton_schulz_accuracy.py      # CPU, seconds
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from saggs_jax._src.equivariant import linalg


def inputs(count: int, cond: float, shape=(16, 32)) -> jax.Array:
  """Random matrices with singular values log-spaced in [1 / cond, 1]."""
  m, n = shape
  rng = np.random.default_rng(0)
  sigma = np.logspace(-np.log10(cond), 0, m)
  out = []
  for _ in range(count):
    u, _ = np.linalg.qr(rng.normal(size=(m, m)))
    v, _ = np.linalg.qr(rng.normal(size=(n, m)))
    out.append((u * sigma) @ v.T)
  return jnp.asarray(np.stack(out), jnp.float32)


def band(y: jax.Array) -> tuple[float, float]:
  s = np.linalg.svd(np.asarray(y, np.float64), compute_uv=False)
  return float(s.min()), float(s.max())


def variant(x: jax.Array, coeffs, steps: int, how: str) -> jax.Array:
  """The library's steps, or a rounding it avoids (``how``: "iterate_bf16", "expanded")."""
  triples, headroom = linalg._schedule(coeffs, steps)
  y = x / (headroom * jnp.linalg.norm(x, axis=(-2, -1), keepdims=True))
  bf = jnp.bfloat16
  for a, b, c in triples:
    if how == "expanded":
      yb = y.astype(bf)
      g = yb @ yb.mT
      y = (a * yb + (b * g + c * g @ g) @ yb).astype(jnp.float32)
    else:
      g = jnp.matmul(y.astype(bf), y.mT.astype(bf), preferred_element_type=jnp.float32)
      gg = jnp.matmul(g.astype(bf), g.astype(bf), preferred_element_type=jnp.float32)
      p = a * jnp.eye(y.shape[-2]) + b * g + c * gg
      y = jnp.matmul(p.astype(bf), y.astype(bf), preferred_element_type=jnp.float32)
      if how == "iterate_bf16":
        y = y.astype(bf).astype(jnp.float32)
  return y


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--cond", type=float, default=1e3)
  parser.add_argument("--count", type=int, default=16)
  args = parser.parse_args()
  x = inputs(args.count, args.cond)
  print(f"bands: {args.count} inputs 16 x 32, condition number {args.cond:g}, bfloat16 matmuls")
  for name in linalg.NS_COEFFS:
    for steps in (5, 6):
      lo, hi = band(linalg.newton_schulz(x, name, steps, jnp.bfloat16))
      print(f"  {name:<22} {steps} steps  [{lo:.2f}, {hi:.2f}]")
  print("rounding: largest |sigma - 1|, polar_express, 8 steps (converged in exact arithmetic)")
  library = linalg.newton_schulz(x, "polar_express", 8, jnp.bfloat16)
  assert np.allclose(library, variant(x, "polar_express", 8, "library"), atol=1e-5)
  for how in ("library", "iterate_bf16", "expanded"):
    lo, hi = band(variant(x, "polar_express", 8, how))
    print(f"  {how:<14} {max(1 - lo, hi - 1):.3g}")


if __name__ == "__main__":
  main()
