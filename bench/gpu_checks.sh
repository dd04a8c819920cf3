#!/usr/bin/env bash
# The GPU checks in one go (12 minutes at most: the timeouts sum to 720 s): the
# jit-heavy tests on the GPU, the benchmarks at GPT-2-small size, then
# examples/gpu_study.py (its docstring sizes it). Run from the repository
# root on a machine with a GPU and jax[cuda], flax, optax, chex,
# orbax-checkpoint and hypothesis:
#   bash bench/gpu_checks.sh [output_dir]
set -uo pipefail
out=${1:-runs/gpu}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import jax; print(jax.__version__, jax.devices())" 2>&1 | tee "$out/env.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_transform.py tests/test_models.py \
  tests/test_trajectory.py tests/test_equivariant.py 2>&1 | tail -n 25 | tee "$out/tests.txt"
timeout 90 python3 bench/bench_saggs.py --size gpt2 --rounds 3 2>&1 | tee "$out/bench_saggs.txt"
timeout 80 python3 bench/bench_equivariant.py --size gpt2 --rounds 3 2>&1 | tee "$out/bench_equivariant.txt"
timeout 40 python3 bench/bench_gram_newton_schulz.py --m 512 --rounds 3 2>&1 | tee "$out/bench_gram.txt"
# collective counts are a property of the compiled HLO: measured on 8 host CPU devices
JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \
  timeout 30 python3 bench/bench_comms.py 2>&1 | tee "$out/bench_comms.txt"
timeout 330 python3 examples/gpu_study.py --out "$out/study" 2>"$out/study.log" | tee "$out/study.txt"
