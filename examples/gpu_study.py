r"""Kim (2026)'s imbalance experiment at GPT-2-small size, on one GPU.

``study.py``'s ``imbalance`` experiment (the same runner, JSONL and table):
every ``presets.llama`` pair rescaled by 8 and 1/8 at initialisation, then
AdamW, AdamW + hard SAGGS and AdamW + soft SAGGS, two seeds, on the LLaMA-style
byte LM of ``saggs_jax.testing.lm`` at the size of ``bench/common.py``'s ``gpt2`` entry
(d_model 768, 12 layers, 12 heads of 64, SwiGLU 2048: 85M parameters, GPT-2
small's non-embedding count; Kim reports 101M) on the whole embedded corpus
(the standard library's source, about 12 MB).

Sizing. A step trains on 16 x 1024 bytes: 6 x 85M x 16,384 = 8.4 TFLOP for
the weights plus 12 x layers x seq_len x d_model x 16,384 = 1.9 TFLOP for the
attention (forward and backward), about 10 TFLOP. The 6 runs of 500 steps are
3e16 FLOP: 2.5 minutes at 200 TFLOP/s (TF32 at 40% of an H200's peak), 10
minutes at 50 TFLOP/s (plain float32); compilation (3 optimizers) and the
evaluations (8 batches every 100 steps, under 2% of the steps' work) add about
a minute.

``--tiny`` runs the same pipeline on a model of about 10k parameters for
20 steps (well under a minute on a CPU); the tests use it. Any flag of
``study.py`` overrides these defaults. From the repository root::

  python examples/gpu_study.py                 # on the GPU machine, ~12 minutes on one H200
  python examples/gpu_study.py --tiny          # CPU, seconds
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import jax

import study

GPU = dict(d_model=768, num_layers=12, num_heads=12, num_kv_heads=12, head_dim=64,
           mlp_hidden=2048, seq_len=1024, batch_size=16, steps=500, lr=1e-3, warmup=50,
           eval_every=100, eval_batches=8, seeds=2, corpus_bytes=100_000_000,
           experiments="imbalance", out="runs/gpu_study")
TINY = dict(GPU, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
            mlp_hidden=32, seq_len=16, batch_size=4, steps=20, warmup=0, lr=3e-3,
            eval_every=10, eval_batches=2, corpus_bytes=200_000, out="runs/gpu_study_tiny")


def main(argv: Sequence[str] | None = None) -> None:
  parser = study.build_parser(__doc__)
  parser.add_argument("--tiny", action="store_true",
                      help="a model of about 10k parameters, 20 steps: a CPU check")
  tiny = parser.parse_known_args(argv)[0].tiny
  parser.set_defaults(**(TINY if tiny else GPU))  # flags given still win
  print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind})", file=sys.stderr)
  study.main(argv, parser)


if __name__ == "__main__":
  main()
