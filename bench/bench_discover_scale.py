"""Time and peak memory of ``saggs.discover`` against depth and width, on the plain-JAX LLaMA
of ``tests/models.py`` (GQA with RoPE, SwiGLU), scanned or unrolled.

* ``--size tiny --layers N``: d_model 64, concrete parameters at init std 0.02 (every leaf),
  confirmed numerically on one sequence of 8 tokens;
* ``--size 1b`` / ``--size 7b``: LLaMA-3.2-1B / LLaMA-2-7B shapes as ``jax.ShapeDtypeStruct``
  leaves (no weights anywhere): traced and analysed only, ``confirmation == "none"``.

One configuration per process, so that its peak RSS is its own. Run:

  JAX_PLATFORMS=cpu /usr/bin/time -v python bench/bench_discover_scale.py --size 7b --scanned
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
import models  # noqa: E402  # pyright: ignore[reportMissingImports]  (the tests' plain-JAX LLaMA)
from saggs_jax.discovery import discover  # noqa: E402

SIZES = {
  "tiny": models.Config(
    vocab=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_hidden=172
  ),
  "1b": models.Config(
    vocab=128256,
    d_model=2048,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    mlp_hidden=8192,
  ),
  "7b": models.Config(
    vocab=32000,
    d_model=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    mlp_hidden=11008,
  ),
}


def llama_shapes(c: models.Config) -> dict:
  """``models.llama_init(c)``'s tree as ``jax.ShapeDtypeStruct`` leaves (float32)."""

  def s(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)

  d, q, kv = c.d_model, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  stack = (c.num_layers,) if c.stacked else ()

  def layer():
    return {
      "attn_norm": {"scale": s(*stack, d)},
      "attn": {
        "q_proj": {"kernel": s(*stack, d, q)},
        "k_proj": {"kernel": s(*stack, d, kv)},
        "v_proj": {"kernel": s(*stack, d, kv)},
        "o_proj": {"kernel": s(*stack, q, d)},
      },
      "mlp_norm": {"scale": s(*stack, d)},
      "mlp": {
        "gate_proj": {"kernel": s(*stack, d, c.mlp_hidden)},
        "up_proj": {"kernel": s(*stack, d, c.mlp_hidden)},
        "down_proj": {"kernel": s(*stack, c.mlp_hidden, d)},
      },
    }

  return {
    "embed": {"embedding": s(c.vocab, d)},
    "layers": layer() if c.stacked else {str(i): layer() for i in range(c.num_layers)},
    "final_norm": {"scale": s(d)},
    "lm_head": {"kernel": s(d, c.vocab)},
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
  parser.add_argument("--layers", type=int, default=None, help="override num_layers")
  parser.add_argument("--scanned", action="store_true", help="layers stacked, run by lax.scan")
  args = parser.parse_args(argv)

  c = dataclasses.replace(SIZES[args.size], stacked=args.scanned)
  if args.layers:
    c = dataclasses.replace(c, num_layers=args.layers)
  params = llama_shapes(c)
  if args.size == "tiny":  # concrete, every leaf N(0, 0.02^2)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: jnp.asarray(0.02 * rng.standard_normal(x.shape)), params)
  tokens = jnp.arange(8, dtype=jnp.int32)[None] % c.vocab  # one sequence of 8 tokens

  start = time.perf_counter()
  found = discover(lambda p, t: models.llama_forward(p, t, c), params, tokens)
  seconds = time.perf_counter() - start
  count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB on Linux
  print(found.report())
  print(
    f"discover: {seconds:.2f} s, peak RSS {peak:.2f} GiB; {args.size}, {c.num_layers} layers"
    f" {'scanned' if c.stacked else 'unrolled'}, {count / 1e6:.0f}M parameters,"
    f" confirmation {found.confirmation!r}"
  )


if __name__ == "__main__":
  main()
