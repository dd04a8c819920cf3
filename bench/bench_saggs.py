"""Cost of SAGGS against plain AdamW: optimizer update alone, and the full train step.

Every variant is compiled first, then timed in alternating rounds in one
process (adamw, saggs/1, saggs/100, soft/1, adamw, ...), so drift in machine
load hits all of them alike. Each round times ``--steps`` consecutive steps
(a multiple of 100, so every=100 balances exactly once per round); the
median over rounds is reported as a ratio to AdamW.

  python bench/bench_saggs.py                  # CPU-sized model
  python bench/bench_saggs.py --size gpt2      # GPT-2-small-sized (GPU)
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import lm  # noqa: E402

import saggs_jax as saggs  # noqa: E402

SIZES = {
    # d_model, layers, heads, kv heads, head_dim, mlp hidden, seq, batch
    "cpu": dict(d_model=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                mlp_hidden=688, seq_len=64, batch=8),
    "gpt2": dict(d_model=768, num_layers=12, num_heads=12, num_kv_heads=12, head_dim=64,
                 mlp_hidden=2048, seq_len=1024, batch=16),
}


def variants(pairs):
  adamw = lambda: optax.adamw(3e-4, weight_decay=0.1)  # noqa: E731
  return {
      "adamw": adamw(),
      "saggs every=1": saggs.chain(adamw(), saggs.saggs(pairs, every=1)),
      "saggs every=100": saggs.chain(adamw(), saggs.saggs(pairs, every=100)),
      "soft every=1": saggs.chain(adamw(), saggs.soft(pairs, strength=0.5, every=1)),
  }


def make_opt_step(tx):
  def opt_step(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jnp.zeros(())
  return jax.jit(opt_step, donate_argnums=(0, 1))


def time_round(step, carry, arg, steps):
  params, opt_state = carry
  start = time.perf_counter()
  for _ in range(steps):
    params, opt_state, out = step(params, opt_state, arg)
  jax.block_until_ready((params, opt_state, out))
  return (params, opt_state), (time.perf_counter() - start) / steps


def bench(kind, steps_fn, txs, params, arg, rounds, steps):
  carries, steppers = {}, {}
  for name, tx in txs.items():
    steppers[name] = steps_fn(tx)
    state = (jax.tree.map(jnp.copy, params), lm.strong_types(tx.init(params)))
    carries[name], _ = time_round(steppers[name], state, arg, 2)  # compile + warm up
  times = {name: [] for name in txs}
  for _ in range(rounds):
    for name in txs:
      carries[name], t = time_round(steppers[name], carries[name], arg, steps)
      times[name].append(t)
  base = np.median(times["adamw"])
  print(f"\n{kind}: median of {rounds} alternating rounds x {steps} steps")
  for name, ts in times.items():
    med = np.median(ts)
    print(f"  {name:<16} {med * 1e3:9.3f} ms   ratio {med / base:.3f}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  default = "gpt2" if jax.default_backend() == "gpu" else "cpu"
  parser.add_argument("--size", choices=sorted(SIZES), default=default)
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--skip-train-step", action="store_true")
  args = parser.parse_args()
  size = dict(SIZES[args.size])
  batch = size.pop("batch")
  config = lm.ModelConfig(**size)
  graphdef, params = lm.init_model(config, seed=0)
  pairs = saggs.presets.llama(num_kv_heads=config.num_kv_heads)
  txs = variants(pairs)
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), size {args.size}:"
        f" {lm.num_params(params) / 1e6:.1f}M params, batch {batch}x{config.seq_len}")

  grads = jax.tree.map(lambda x: 1e-3 * jax.random.normal(jax.random.PRNGKey(1), x.shape, x.dtype),
                       params)
  bench("optimizer update", make_opt_step, txs, params, grads, args.rounds, args.steps)
  if not args.skip_train_step:
    tokens = jax.random.randint(jax.random.PRNGKey(2), (batch, config.seq_len + 1), 0, 256)
    bench("full train step", lambda tx: lm.make_train_step(graphdef, tx), txs, params, tokens,
          args.rounds, args.steps)


if __name__ == "__main__":
  main()
