"""The optimizer update's cost against AdamW's from XLA's cost analysis of the compiled
update (deterministic: no timing), on the model and optimizers bench/bench_saggs.py times on
a CPU (``--size cpu``): its every=1 update, hard and soft, on ordinary weights (each
``lax.cond`` traced as its second branch, the norms' scale-safe pass skipped: see
``bench/common.py``'s ``skipping``) reads at most 1.10x AdamW's bytes and runs at most 1.55x
its flops, and as compiled (XLA charging that pass, one more read of every declared leaf)
at most 1.16x AdamW's bytes.

The flops bound is what guards the norms' time on a CPU: a reduction whose combiner
divides (the scale-safe pass run on every leaf, as ``_one_pass_stats`` did before it read
a plain sum of squares first) is emitted by XLA:CPU as a scalar loop, about 3x AdamW's update
time, at the same bytes (1.074x) and 1.92x its flops.
"""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import bench_saggs  # noqa: E402
import common  # noqa: E402
import saggs_jax as saggs  # noqa: E402

BYTES, FLOPS, COMPILED_BYTES = 1.10, 1.55, 1.16  # the fixed code: 1.074, 1.485, 1.150


@pytest.fixture(scope="module")
def model():
  config, _, params, _ = common.setup("cpu")
  pairs = saggs.presets.llama(num_kv_heads=config.num_kv_heads)
  return bench_saggs.variants(pairs), params, common.fake_grads(params)


@pytest.mark.parametrize("name", ["saggs every=1", "soft every=1"])
def test_every_1_update_costs_within_bounds_of_adamw(model, name):
  txs, params, grads = model
  cost = lambda tx: common.update_cost(common.make_opt_step, tx, params, grads)  # noqa: E731
  bytes_a, flops_a = cost(txs["adamw"])
  compiled_bytes, _ = cost(txs[name])
  with common.skipping():
    bytes_s, flops_s = cost(txs[name])
  ratios = (bytes_s / bytes_a, flops_s / flops_a, compiled_bytes / bytes_a)
  assert ratios[0] <= BYTES and ratios[1] <= FLOPS and ratios[2] <= COMPILED_BYTES, ratios
