"""How far two equivalent states end apart under a clipped AdamW, by SAGGS variant.

Two training states that compute one function, S and S' (the parameters of S' moved along
the symmetry orbit by factors c per group, Adam's moments by c**-1 and c**-2, all in NumPy,
outside the library), are trained on the same batches, each on the gradients at its own
parameters, by ``saggs.chain(optax.chain(optax.clip_by_global_norm(tau), optax.adamw(...)),
stage)``. The table gives the largest difference of their canonical parameters (each
balanced by ``saggs.canonicalize``, so that the orbit point does not count) after the steps,
relative to the largest parameter, with tau small enough that the clip fires on most steps,
and with tau = inf (no clip) beside it: what is left there is the optimizer's own
non-equivariance between balancings (Adam's step is the same at every orbit point), which
the clip adds to. Both stage states start 5 updates into a balancing period, as
checkpoints taken mid-run would.

Usage: python bench/bench_clip_drift.py [--steps 50]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

# The repository's saggs_jax, not an installed one: a script's own folder is on sys.path.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import saggs_jax as saggs  # noqa: E402

D, HEADS, HD, F, B, T = 16, 4, 4, 32, 4, 8
PAIRS = [
  saggs.Pair("q", "k", axes=(1, 1), groups=HEADS),
  saggs.Pair("up", "down", axes=(1, 0)),
]
STAGES = {
  "hard, every=1": lambda: saggs.saggs(PAIRS, every=1),
  "hard, every=10": lambda: saggs.saggs(PAIRS, every=10),
  "soft 0.5, every=1": lambda: saggs.soft(PAIRS, strength=0.5, every=1),
  "soft 0.5, every=10": lambda: saggs.soft(PAIRS, strength=0.5, every=10),
}
START = 5  # the stages' update count at the start: mid-period for every=10


def forward(p, x):
  """One attention layer (Q/K per head) and a ReLU MLP (up/down per channel)."""
  q, k = ((x @ p[n]).reshape(B, T, HEADS, HD) for n in ("q", "k"))
  att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / HD**0.5, axis=-1)
  v = (x @ p["v"]).reshape(B, T, HEADS, HD)
  h = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(B, T, D)
  return h + jax.nn.relu(h @ p["up"]) @ p["down"]


def loss(p, batch):
  x, y = batch
  return jnp.mean((forward(p, x) - y) ** 2)


def batches(n, seed=1):
  rng = np.random.default_rng(seed)
  return [
    (
      jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32),
      jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32),
    )
    for _ in range(n)
  ]


def initial(seed=0):
  rng = np.random.default_rng(seed)
  w = lambda *s: jnp.asarray(rng.standard_normal(s) / s[0] ** 0.5, jnp.float32)  # noqa: E731
  return {"q": w(D, HEADS * HD), "k": w(D, HEADS * HD), "v": w(D, HEADS * HD),
          "up": w(D, F), "down": w(F, D)}  # fmt: skip


def multipliers(seed=2):
  """Per leaf, what the orbit move multiplies it by (broadcast like it), in NumPy."""
  rng = np.random.default_rng(seed)
  head = np.repeat(np.exp(rng.uniform(-1, 1, HEADS)), HD)
  channel = np.exp(rng.uniform(-1, 1, F))
  return {"q": head, "k": 1 / head, "v": np.ones(1), "up": channel, "down": 1 / channel[:, None]}


def moved(params, adamw_state, m):
  """S' from S: parameters times m, Adam's mu times m**-1 and nu times m**-2, by hand."""
  p = {n: jnp.asarray(np.asarray(x, np.float64) * m[n], jnp.float32) for n, x in params.items()}

  def moment(tree, k):
    return {
      n: jnp.asarray(np.asarray(x, np.float64) * m[n] ** -k, jnp.float32) for n, x in tree.items()
    }

  def leaf(s):
    if isinstance(s, optax.ScaleByAdamState):
      return s._replace(mu=moment(s.mu, 1), nu=moment(s.nu, 2))
    return s

  return p, jax.tree.map(leaf, adamw_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))


def canonical(params):
  return saggs.canonicalize(params, None, PAIRS)[0]


def drift(stage, tau, start, data):
  """The relative difference of the canonical parameters of S and S' after ``data``, and the
  fraction of steps whose gradient norm was over ``tau``."""
  inner = optax.chain(optax.clip_by_global_norm(tau), optax.adamw(3e-3, weight_decay=0.1))
  tx = saggs.chain(inner, stage)

  @jax.jit
  def step(p, s, batch):
    g = jax.grad(loss)(p, batch)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, optax.tree.norm(g)

  ends, fired = [], []
  for p, inner_state in start:
    s = (inner_state, tx.init(p)[-1]._replace(step=jnp.int32(START)))
    for batch in data:
      p, s, norm = step(p, s, batch)
      fired.append(float(norm) > tau)
    ends.append(canonical(p))
  a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(e)]) for e in ends)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(a))), float(np.mean(fired))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=50)
  args = parser.parse_args()
  data = batches(args.steps + 10)
  warm, data = data[:10], data[10:]
  # S: ten steps of plain AdamW from the initial parameters (nonzero moments).
  params, adamw = initial(), optax.adamw(3e-3, weight_decay=0.1)
  state = adamw.init(params)
  for batch in warm:
    u, state = adamw.update(jax.grad(loss)(params, batch), state, params)
    params = optax.apply_updates(params, u)
  inner_state = (optax.EmptyState(), state)  # the clip's state, then AdamW's
  start = [(params, inner_state), moved(params, inner_state, multipliers())]
  # tau: a third of the first gradient norm, so the clip fires on most steps.
  tau = float(optax.tree.norm(jax.grad(loss)(params, data[0]))) / 3
  print(f"{args.steps} updates from two equivalent states; clip tau = {tau:.3g};"
        f" jax {jax.__version__}, optax {optax.__version__}")  # fmt: skip
  print("| stage | clip fired | clipped: max difference | no clip: max difference |")
  print("|---|---|---|---|")
  for name, make in STAGES.items():
    clipped, fired = drift(make(), tau, start, data)
    free, _ = drift(make(), float("inf"), start, data)
    print(f"| {name} | {fired:.0%} of steps | {clipped:.1e} | {free:.1e} |")


if __name__ == "__main__":
  main()
