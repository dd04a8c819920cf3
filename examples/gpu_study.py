r"""Kim (2026)'s imbalance experiment at GPT-2-small size, on one GPU.

``harness.study``'s ``imbalance`` experiment (the same runner, JSONL, tables and
verdicts): every ``presets.llama`` pair rescaled by 8 and 1/8 at
initialisation, then AdamW, AdamW + hard SAGGS and AdamW + soft SAGGS, on 4
seeds (200-203), on the LLaMA-style byte LM of
``harness.lm`` at the size of
``bench/common.py``'s ``gpt2`` entry (d_model 768, 12 layers, 12 heads of 64,
SwiGLU 2048: 85M parameters, GPT-2 small's non-embedding count; Kim reports
101M) on the whole embedded corpus (the standard library's source, about
12 MB).

Scale caveat. A run trains on 300 steps of 16 x 1024 bytes: 4.9M training
bytes for 85M parameters, under 0.1 byte per parameter (compute-optimal
training uses about 20 tokens per parameter). The runs measure early
training, not converged models.

Numerics. Matrix products run at ``jax_default_matmul_precision =
"tensorfloat32"`` (``--matmul-precision``): float32 storage, TF32 tensor-core
products (10-bit mantissa). Every arm runs at the same precision, so the
paired differences compare like with like; the precision enters the run key.

Sizing. A step is 6 x 85M x 16,384 = 8.4 TFLOP for the weights plus 12 x
layers x seq_len x d_model x 16,384 = 1.9 TFLOP for the attention (forward and
backward): 10.3 TFLOP. The 12 runs of 300 steps, with their evaluations (8
forward batches every 100 steps, 4% more), are 3.8e16 FLOP. Assuming 150
TFLOP/s (30% of an H200's 495 TFLOP/s dense TF32 peak) that is 4.3 minutes;
compiling the 3 optimizers' steps adds under a minute. Plain float32 (about 50
TFLOP/s at best) would take 13 minutes. ``bench/gpu_checks.sh`` runs this
study last, under a 330 s timeout, after checks whose timeouts sum to 390 s:
12 minutes in all at most. None of this has been measured: no GPU was
available when it was written.

Install JAX for CUDA first (``pip install -U "jax[cuda12]"``, then the
project's requirements); without a GPU backend the script stops rather than
run for hours on a CPU. At the end it prints one JSON line (also written to
``<out>/summary.json``): backend, device, precision, sizes, wall time and every
verdict. ``--tiny`` runs the same pipeline on a model of about 10k parameters
for 20 steps (under a minute on a CPU); the tests use it. Any flag of
``examples/study.py`` overrides these defaults. From the repository root::

  python examples/gpu_study.py                 # on the GPU machine, ~5 minutes on one H200
  python examples/gpu_study.py --tiny          # CPU, seconds
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence

import jax

import common  # noqa: F401  (the repository root on sys.path, for harness)
from harness import study

GPU = {
  "d_model": 768,
  "num_layers": 12,
  "num_heads": 12,
  "num_kv_heads": 12,
  "head_dim": 64,
  "mlp_hidden": 2048,
  "seq_len": 1024,
  "batch_size": 16,
  "steps": 300,
  "lr": 1e-3,
  "warmup": 30,
  "eval_every": 100,
  "eval_batches": 8,
  "seeds": 4,
  "corpus_bytes": 100_000_000,
  "experiments": "imbalance",
  "out": "runs/gpu_study",
}
TINY = {
  **GPU,
  **study.lm.SMOKE_MODEL,
  "batch_size": 4,
  "steps": 20,
  "warmup": 0,
  "lr": 3e-3,
  "eval_every": 10,
  "eval_batches": 2,
  "corpus_bytes": 200_000,
  "out": "runs/gpu_study_tiny",
}
NO_GPU = (
  "gpu_study.py needs a GPU, but JAX's backend is {backend!r}. Install JAX for CUDA "
  '(pip install -U "jax[cuda12]") on a machine with an NVIDIA GPU, or run --tiny '
  "for the CPU-sized check."
)


def main(argv: Sequence[str] | None = None) -> None:
  start = time.perf_counter()
  parser = study.build_parser(__doc__)
  parser.add_argument(
    "--tiny", action="store_true", help="a model of about 10k parameters, 20 steps: a CPU check"
  )
  parser.add_argument(
    "--matmul-precision",
    default="tensorfloat32",
    choices=("float32", "tensorfloat32", "bfloat16"),
    help="jax_default_matmul_precision (default %(default)s)",
  )
  known = parser.parse_known_args(argv)[0]
  if not known.tiny and jax.default_backend() != "gpu":
    sys.exit(NO_GPU.format(backend=jax.default_backend()))
  jax.config.update("jax_default_matmul_precision", known.matmul_precision)
  parser.set_defaults(**(TINY if known.tiny else GPU))  # flags given still win
  args = study.parse_args(parser, argv)
  device = jax.devices()[0]
  print(
    f"backend: {jax.default_backend()} ({device.device_kind}), matmul precision "
    f"{known.matmul_precision}",
    file=sys.stderr,
  )
  verdicts = study.main(argv, parser)
  config = study.lm.config_from_flags(args)
  _, params = study.lm.init_model(config, seed=0)
  result = {
    "backend": jax.default_backend(),
    "device": device.device_kind,
    "matmul_precision": known.matmul_precision,
    "jax": jax.__version__,
    "params": study.lm.num_params(params),
    "steps": args.steps,
    "seeds": args.seeds,
    "train_bytes_per_run": args.steps * args.batch_size * config.seq_len,
    "wall_s": round(time.perf_counter() - start, 1),
    "verdicts": verdicts,
  }
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
  print(json.dumps(result))


if __name__ == "__main__":
  main()
