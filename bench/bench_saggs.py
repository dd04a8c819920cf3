"""Cost of SAGGS against plain AdamW: optimizer update alone, and the full train step.

Every variant is compiled first, then timed in alternating rounds in one
process (each round starting one variant later), so drift in machine load
hits all of them alike. Each round times ``--steps`` consecutive steps (a
multiple of 100, so every=100 balances exactly once per round); ratios to
AdamW are medians of per-round ratios, with quartiles. A second AdamW
("control") shows the noise floor of the run. Variants: hard and soft SAGGS at
every=1 and every=100. Before timing, it prints XLA's cost analysis of each
compiled update ("bytes accessed", deterministic and machine-independent) as a
ratio to AdamW's. Sizes and timing helpers live in ``bench/common.py``. The first line
printed names the commit, the CPU (or GPU) and the JAX version the figures belong to.

``--part anatomy`` times where the update's cost comes from, against three
floors: AdamW plus the norm pass alone (each declared leaf's per-index sums of
squares, which each leaf's update then waits for: the least that balancing
on current norms before the step can cost), every=1 compiled with the norms'
``lax.cond`` (the scale-safe pass that ordinary weights skip) replaced by its
skipping branch, and every=100 compiled with its ``lax.cond`` replaced by the
skipping branch alone (ones behind an optimization barrier, so the transport
still multiplies by them). Between the last two, every=100 whose balancing branch is
emptied (ones that wait for one entry of a declared weight): the cond's own cost, apart from
the code its branch holds, which XLA:CPU pays for on the updates that skip it too.

  python bench/bench_saggs.py                  # CPU-sized model
  python bench/bench_saggs.py --size gpt2      # GPT-2-small-sized (GPU)
"""

from __future__ import annotations

import argparse
from unittest import mock

import jax
import jax.numpy as jnp
import optax

import common
import saggs_jax as saggs
from harness import lm
from saggs_jax._src import paths, transform
from saggs_jax._src.plan import resolve


def adamw():
  return optax.adamw(3e-4, weight_decay=0.1)


def variants(pairs):
  return {
    "adamw": adamw(),
    "adamw (control)": adamw(),  # the same optimizer again: the noise floor of this run
    "saggs every=1": saggs.chain(adamw(), saggs.saggs(pairs, every=1)),
    "saggs every=100": saggs.chain(adamw(), saggs.saggs(pairs, every=100)),
    "soft every=1": saggs.chain(adamw(), saggs.soft(pairs, strength=0.5, every=1)),
    "soft every=100": saggs.chain(adamw(), saggs.soft(pairs, strength=0.5, every=100)),
  }


def with_norm_pass(inner, pairs):
  """``inner`` whose update of each declared leaf is multiplied by ``1 + 0 * s``, ``s``
  the sum of the logs of that leaf's per-index squared norms (the reduction SAGGS
  runs per group), so XLA keeps the pass and each leaf's update waits for its own
  norms."""

  def update(grads, state, params):
    leaves = dict(paths.leaves_with_paths(params))
    slots = resolve(pairs, params).slots
    # The log keeps XLA from merging the per-index sums into one full reduction.
    waits = {
      p: 1
      + 0 * jnp.log(jnp.sum(jnp.square(leaves[p]), axis=s[0].reduce_axes(leaves[p].ndim))).sum()
      for p, s in slots.items()
    }
    updates, state = inner.update(grads, state, params)
    wait = lambda key_path, u: u * waits.get(paths.path_str(key_path), 1)  # noqa: E731
    return jax.tree_util.tree_map_with_path(wait, updates), state

  return optax.GradientTransformation(inner.init, update)


def anatomy_variants(pairs, params, grads):
  """The ``--part anatomy`` variants, and their ``steps_fn``: the last three compiled here,
  every ``lax.cond`` as its second branch (at every=1 the norms' own, the scale-safe pass
  skipped) or the balancing branch emptied."""
  base = variants(pairs)
  no_cond = saggs.chain(adamw(), saggs.saggs(pairs, every=100))
  unchecked = saggs.chain(adamw(), saggs.saggs(pairs, every=1))
  empty = saggs.chain(adamw(), saggs.saggs(pairs, every=100))
  txs = {
    "adamw": base["adamw"],
    "adamw (control)": base["adamw (control)"],
    "adamw + the norm pass alone": with_norm_pass(adamw(), pairs),
    "saggs every=1": base["saggs every=1"],
    "saggs every=1 without the norms' cond": unchecked,
    "saggs every=100": base["saggs every=100"],
    "saggs every=100, its branch emptied": empty,
    "saggs every=100 without its cond": no_cond,
  }

  # Compiled first: skipping clears JAX's caches, which would make the others compile again
  # inside their first timed round.
  with common.skipping(opaque=True):
    skipped = {
      id(tx): common.make_opt_step(tx).lower(params, tx.init(params), grads).compile()
      for tx in (no_cond, unchecked)
    }

  def ones(plan, params, strength, axis_name=None):  # waits for one entry, computes nothing
    del strength, axis_name
    leaves = dict(paths.leaves_with_paths(params))
    one = 1 + 0 * leaves[next(iter(plan.slots))].ravel()[0].astype(jnp.float32)
    return {i.key: jnp.full(i.factor_shape, one) for i in plan.instances}, jnp.float32(0)

  with mock.patch.object(transform, "compute_factors", ones):
    skipped[id(empty)] = (
      common.make_opt_step(empty).lower(params, empty.init(params), grads).compile()
    )

  def steps_fn(tx):
    return skipped.get(id(tx)) or common.make_opt_step(tx)

  return txs, steps_fn


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=sorted(common.SIZES), default=common.default_size())
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument(
    "--part",
    choices=("both", "update", "step", "anatomy"),
    default="both",
    help="time the optimizer update, the full train step, both, or where the"
    " update's cost comes from",
  )
  args = parser.parse_args()
  config, graphdef, params, batch = common.setup(args.size)
  pairs = saggs.presets.llama(num_kv_heads=config.num_kv_heads)
  if args.part == "anatomy":
    grads = common.fake_grads(params)
    txs, steps_fn = anatomy_variants(pairs, params, grads)
    common.bench("optimizer update", steps_fn, txs, params, grads, args.rounds, args.steps)
    return
  txs = variants(pairs)

  if args.part != "step":
    common.bytes_accessed(common.make_opt_step, txs, params, common.fake_grads(params))
    common.bench(
      "optimizer update",
      common.make_opt_step,
      txs,
      params,
      common.fake_grads(params),
      args.rounds,
      args.steps,
    )
  if args.part != "update":
    common.bench(
      "full train step",
      lambda tx: lm.make_train_step(graphdef, tx),
      txs,
      params,
      common.random_tokens(batch, config.seq_len),
      args.rounds,
      args.steps,
    )


if __name__ == "__main__":
  main()
