"""Gram Newton-Schulz against plain Newton-Schulz in ``scale_by_polar``.

For an ``m x n`` block (``m <= n``) the plain iteration costs about
``5 (2 m^2 n + m^3)`` flops, the Gram one about ``2 m^2 n + 5 * 4 m^3`` (see
``newton_schulz(gram=True)``): it should win once ``n`` is a few times ``m``.
Each shape is a stack of 4 blocks (heads, experts) updated by
``scale_by_polar`` (5 Polar-Express steps); the two variants run in
alternating rounds (``bench/common.py``) and the table gives the median time
per update and the median per-round ratio gram / plain. On the CPU machine it
was written on, Gram took 0.4-0.6x the time of plain at ``n = 8m`` and more
at ``n = m`` (the figures once quoted in ``newton_schulz``'s docstring).

  python bench/bench_gram_newton_schulz.py                  # CPU, ~2 min
  python bench/bench_gram_newton_schulz.py --dtype float32
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import common
from saggs_jax import equivariant as eqv


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--dtype", default="bfloat16", help="ns_dtype of both variants")
  parser.add_argument("--m", type=int, default=128, help="short side of every block")
  parser.add_argument("--ratios", default="1,2,4,8,16", help="n / m of the blocks")
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--steps", type=int, default=5)
  args = parser.parse_args()
  dtype = jnp.dtype(args.dtype)
  print(f"backend {jax.default_backend()}, ns_dtype {dtype.name}, blocks 4 x {args.m} x n")
  for ratio in map(int, args.ratios.split(",")):
    shape = (4, args.m, ratio * args.m)
    params = {"w": jnp.zeros(shape, jnp.float32)}
    grads = {"w": jax.random.normal(jax.random.key(0), shape)}
    txs = {
      name: eqv.scale_by_polar(
        batch_axes=0, newton_schulz=eqv.NewtonSchulz(dtype=dtype, gram=name == "gram")
      )
      for name in ("plain", "gram")
    }
    common.bench(
      f"n = {ratio} m {shape}",
      common.make_opt_step,
      txs,
      params,
      grads,
      args.rounds,
      args.steps,
      bases=("plain",),
    )


if __name__ == "__main__":
  main()
