r"""Finding the example LM's symmetries with ``saggs.discover``, then training with them.

``discover`` reads the model's jaxpr and returns every exact rescaling
symmetry it can confirm numerically: on ``harness.lm``'s LLaMA, the Q/K and V/O
pairs per KV head and SwiGLU up/down per channel that ``saggs.presets.llama``
declares by hand, plus what no two-tensor preset can express: each RMSNorm
gain against the input rows of every linear that reads it (q, k and v; gate
and up; the LM head). It also says what it rejected and why (the SwiGLU gate:
SiLU is not homogeneous).

This script prints that report, then trains the model three times from the
same imbalanced start (``q_proj`` scaled by ``--imbalance``, ``k_proj`` by its
inverse: the same function) on the same batches: AdamW, AdamW + SAGGS with the
preset, AdamW + SAGGS with the discovered pairs. It prints a results table and
writes ``loss.png`` to ``--out``. The defaults take a few minutes on two CPU
cores. Run from the repository root::

  python examples/discover.py
"""

import argparse
import time

import jax.numpy as jnp
import numpy as np
import optax

import common  # noqa: F401  (the repository root on sys.path, for harness)
import saggs_jax as saggs
from harness import lm
from saggs_jax.discovery import discover


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  lm.add_training_flags(parser, out="runs/discover")
  lm.add_model_flags(parser)
  lm.smoke_defaults(parser, steps=4, batch_size=4, eval_every=2)
  return parser.parse_args()


def main():
  args = parse_args()
  config = lm.config_from_flags(args)
  graphdef, params = lm.init_model(config, seed=args.seed)

  def forward(params, tokens):
    return lm.forward(graphdef, params, tokens)

  start = time.perf_counter()
  found = discover(forward, params, jnp.zeros((2, 16), jnp.int32) + jnp.arange(16))
  print(f"discover took {time.perf_counter() - start:.1f} s\n\n{found.report()}\n")
  print(f"As a declaration to paste:\n{found!r}\n")

  corpus = lm.load_corpus()
  preset = saggs.presets.llama(num_kv_heads=config.num_kv_heads)
  adamw = optax.adamw(args.lr, weight_decay=args.weight_decay)
  imbalanced = lm.induce_qk_imbalance(params, args.imbalance)  # same function as params
  runs = {
    "AdamW": adamw,
    "AdamW + SAGGS (preset)": saggs.chain(adamw, saggs.saggs(preset, every=args.every)),
    "AdamW + SAGGS (discovered)": saggs.chain(adamw, saggs.saggs(found, every=args.every)),
  }
  histories = {}
  for label, tx in runs.items():
    _, _, histories[label] = lm.train(
      graphdef,
      imbalanced,
      tx,
      corpus,
      steps=args.steps,
      batch_size=args.batch_size,
      seq_len=config.seq_len,
      seed=args.seed,
      eval_every=args.eval_every,
      desc=label,
    )

  print()
  lm.results_table(
    [
      [
        label,
        float(h["eval_loss"][0]),
        float(h["eval_loss"][-1]),
        float(np.exp(h["eval_loss"][-1])),
      ]
      for label, h in histories.items()
    ],
    ["run", "val loss @0", "val loss", "val ppl"],
    floatfmt=".2f",  # one seed; the third decimal moves with the CPU model
  )
  png = args.out / "loss.png"
  lm.plot_curves(histories, png, title="Byte-level LM: discovered pairs against the preset")
  print(f"\nSaved {png}")


if __name__ == "__main__":
  main()
