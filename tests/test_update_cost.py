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

import models

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import bench_saggs  # noqa: E402
import common  # noqa: E402
import saggs_jax as saggs  # noqa: E402

BYTES, FLOPS, COMPILED_BYTES = 1.10, 1.55, 1.16  # the fixed code: 1.077, 1.486, 1.151


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


@pytest.mark.parametrize("name, most", [("saggs every=1", 1), ("saggs every=100", 2)])
def test_the_update_waits_on_at_most_one_predicate_per_cond_it_needs(model, name, most):
  """XLA:GPU runs a ``lax.cond`` by copying its predicate to the host and waiting for the
  stream (its ConditionalThunk): one host sync per cond per update. The norms' scale-safety
  check is one cond for all ordinary leaves (it was one per leaf, 24 here), and every=100 adds
  the schedule's: counted in the compiled program, branches included, with its while loops
  (each waits on its predicate the same way, once per iteration)."""
  txs, params, grads = model
  tx = txs[name]
  compiled = common.make_opt_step(tx).lower(params, tx.init(params), grads).compile()
  text = compiled.as_text()
  assert text.count(" conditional(") + text.count(" while(") == most


# The joint solve of overlapping pairs, on the decoder and pairs bench/bench_compile.py compiles
# (saggs.discover's default: three norm gains overlapping Q/K, V/O and up/down): XLA's compile
# time follows the size of the program, so the jaxpr's equations (nested ones counted) guard
# it without timing. Unrolled per piece and instance the solve had 2157 equations at 2 layers
# and 4091 at 4 (7.0x the non-overlapping pairs' closed form), and the every=1 update 3.6x
# the non-overlapping pairs' (the safe norm passes' frexp/ldexp, ~40 equations each, per
# leaf): on flat arrays the solve has 340 and 386, the closed form 204 (10.6x below the
# unrolled solve), the update 1.41x.
SOLVE_VS_CLOSED_FORM, SOLVE_PER_LAYERS, UPDATE_VS_NON_OVERLAPPING = 2.0, 1.25, 1.6


@pytest.fixture(scope="module")
def overlapping():
  import bench_compile

  out = {}
  for layers in (2, 4):
    graphdef, params = bench_compile.model(num_layers=layers)
    pairs = bench_compile.discovered(graphdef, params)
    out[layers] = params, pairs, bench_compile.without_norm_gains(pairs)
  return bench_compile, out


def test_joint_solve_is_one_program_whatever_the_number_of_pairs(overlapping):
  """The joint solve's equations: within 2x the closed form of the non-overlapping pairs,
  and at 4 layers within 1.25x of its own at 2 (both grow in proportion when the solve is
  unrolled per piece)."""
  bench_compile, models = overlapping
  params, pairs, plain = models[2]
  two = bench_compile.solve_eqns(pairs, params)
  assert saggs._src.plan.resolve(pairs, params).overlapping
  assert not saggs._src.plan.resolve(plain, params).overlapping
  assert two <= SOLVE_VS_CLOSED_FORM * bench_compile.solve_eqns(plain, params), two
  params4, pairs4, _ = models[4]
  four = bench_compile.solve_eqns(pairs4, params4)
  assert four <= SOLVE_PER_LAYERS * two, (two, four)


def test_overlapping_update_within_bound_of_non_overlapping(overlapping):
  """The whole every=1 update (norms, solve, transport) with the norm gains, against the same
  model's update with the non-overlapping pairs alone: at most 1.6x its equations."""
  import jax

  bench_compile, models = overlapping
  params, pairs, plain = models[2]

  def eqns(ps):
    tx = saggs.chain(bench_compile.adamw(), saggs.saggs(ps, every=1))
    jaxpr = jax.make_jaxpr(lambda p, s, g: tx.update(g, s, p))(params, tx.init(params), params)
    return bench_compile.count_eqns(jaxpr)

  ratio = eqns(pairs) / eqns(plain)
  assert ratio <= UPDATE_VS_NON_OVERLAPPING, ratio


@pytest.mark.parametrize("name", ["saggs every=100", "soft every=1"])
def test_a_restart_finds_the_update_in_jax_compilation_cache(model, name):
  """A run that keeps JAX's persistent compilation cache does not compile its train step again
  on a restart: the update holds no host callback (a ``jax.debug.callback`` or ``print``; JAX
  writes no program with one to the cache)."""
  txs, params, grads = model
  tx = txs[name]
  compile_update = lambda: common.make_opt_step(tx).lower(params, tx.init(params), grads).compile()  # noqa: E731
  compile_update()
  with models.as_after_a_restart() as events:
    compile_update()
  assert events["cache_hits"] == events["compile_requests_use_cache"] >= 1, events
