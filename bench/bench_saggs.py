"""Cost of SAGGS against plain AdamW: optimizer update alone, and the full train step.

Every variant is compiled first, then timed in alternating rounds in one
process (each round starting one variant later), so drift in machine load
hits all of them alike. Each round times ``--steps`` consecutive steps (a
multiple of 100, so every=100 balances exactly once per round); ratios to
AdamW are medians of per-round ratios, with quartiles. A second AdamW
("control") shows the noise floor of the run. Variants: hard and soft SAGGS at
every=1 and every=100. Before timing, it prints XLA's cost analysis of each
compiled update ("bytes accessed", deterministic and machine-independent) as a
ratio to AdamW's. Sizes and timing helpers live in ``bench/common.py``.

``--part skip`` times what an update that every=100 skips costs, and why:
the update as compiled, and the same update compiled with its ``lax.cond``
replaced by the skipping branch alone (ones behind an optimization barrier,
so the transport still multiplies by them).

  python bench/bench_saggs.py                  # CPU-sized model
  python bench/bench_saggs.py --size gpt2      # GPT-2-small-sized (GPU)
"""

from __future__ import annotations

import argparse

import optax

import common
from common import lm

import saggs_jax as saggs


def variants(pairs):
  adamw = lambda: optax.adamw(3e-4, weight_decay=0.1)  # noqa: E731
  return {
      "adamw": adamw(),
      "adamw (control)": adamw(),  # the same optimizer again: the noise floor of this run
      "saggs every=1": saggs.chain(adamw(), saggs.saggs(pairs, every=1)),
      "saggs every=100": saggs.chain(adamw(), saggs.saggs(pairs, every=100)),
      "soft every=1": saggs.chain(adamw(), saggs.soft(pairs, strength=0.5, every=1)),
      "soft every=100": saggs.chain(adamw(), saggs.soft(pairs, strength=0.5, every=100)),
  }


def skip_variants(pairs, params, grads):
  """AdamW, a control, hard SAGGS every=100, and the same without its cond; and the
  ``steps_fn`` that compiles the last one with ``lax.cond`` as its skipping branch."""
  adamw = lambda: optax.adamw(3e-4, weight_decay=0.1)  # noqa: E731
  no_cond = saggs.chain(adamw(), saggs.saggs(pairs, every=100))
  txs = {"adamw": adamw(), "adamw (control)": adamw(),
         "saggs every=100": saggs.chain(adamw(), saggs.saggs(pairs, every=100)),
         "saggs every=100 without its cond": no_cond}

  def steps_fn(tx):
    if tx is not no_cond:
      return common.make_opt_step(tx)
    with common.skipping(opaque=True):
      return common.make_opt_step(tx).lower(params, tx.init(params), grads).compile()
  return txs, steps_fn


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=sorted(common.SIZES), default=common.default_size())
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--part", choices=("both", "update", "step", "skip"), default="both",
                      help="time the optimizer update, the full train step, both, or the cost"
                      " of a skipped update with and without its cond")
  args = parser.parse_args()
  config, graphdef, params, batch = common.setup(args.size)
  pairs = saggs.presets.llama(num_kv_heads=config.num_kv_heads)
  if args.part == "skip":
    grads = common.fake_grads(params)
    txs, steps_fn = skip_variants(pairs, params, grads)
    common.bench("optimizer update", steps_fn, txs, params, grads, args.rounds, args.steps)
    return
  txs = variants(pairs)

  if args.part != "step":
    common.bytes_accessed(common.make_opt_step, txs, params, common.fake_grads(params))
    common.bench("optimizer update", common.make_opt_step, txs, params, common.fake_grads(params),
                 args.rounds, args.steps)
  if args.part != "update":
    common.bench("full train step", lambda tx: lm.make_train_step(graphdef, tx), txs, params,
                 common.random_tokens(batch, config.seq_len), args.rounds, args.steps)


if __name__ == "__main__":
  main()
