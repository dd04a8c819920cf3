"""Wall time of ``saggs.discover`` on the example LLaMA at GPT-2-small size.

12 layers, d_model 768, 12 heads of 64 (``SIZES["gpt2"]``), numeric confirmation
included: the jaxpr is traced on abstract shapes and every candidate is checked
on a batch of ``--batch`` x ``--seq-len`` tokens. Compilation of the checked
forward pass is part of the time, as it is for a user. Run:

  JAX_PLATFORMS=cpu python bench/bench_discover.py
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp

import common
from harness import lm
from saggs_jax.discovery import discover


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="gpt2", choices=sorted(common.SIZES))
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--seq-len", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=1)
  args = parser.parse_args(argv)

  config, graphdef, params, _ = common.setup(args.size)
  tokens = jnp.zeros((args.batch, args.seq_len), jnp.int32) + jnp.arange(args.seq_len)

  def forward(params, tokens):
    return lm.forward(graphdef, params, tokens)

  times = []
  for _ in range(args.repeats):
    start = time.perf_counter()
    found = discover(forward, params, tokens)
    times.append(time.perf_counter() - start)
  print(found.report())
  print(
    f"discover: {min(times):.1f} s ({config.num_layers} layers, d_model {config.d_model},"
    f" {config.num_heads} heads; {jax.device_count()} {jax.default_backend()} device,"
    f" check batch {args.batch}x{args.seq_len})"
  )
  print(
    "command:",
    " ".join(
      [
        "JAX_PLATFORMS=cpu python bench/bench_discover.py",
        *(sys.argv[1:] if argv is None else argv),
      ]
    ),
  )


if __name__ == "__main__":
  main()
