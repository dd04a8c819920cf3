"""Float64 NumPy definitions of the equivariant rules' directions (Lau and Su 2026), written
from the paper's formulas, and the gradients of a tiny LLaMA-style decoder, for the tests of
the rules, the Newton-Schulz iterations and the stack (test_rules.py, test_linalg.py,
test_stack.py, test_equivariant_reference.py)."""

import jax.numpy as jnp
import numpy as np

from saggs_jax import equivariant as eqv

U, F = 12, 5  # units x features of the test matrices (U > F + 1: P(G) keeps full rank)


EPS_SPECTRAL = 1e-6


EXACT_NS = dict(newton_schulz=eqv.NewtonSchulz("polar_express", steps=10, dtype=jnp.float32))


def center(x):
  return x - x.mean(axis=0, keepdims=True)


def row_norm(x, eps=1e-8):
  return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), eps)


def polar(x):
  u, s, vt = np.linalg.svd(x, full_matrices=False)
  keep = s > 1e-9 * s.max()
  return u[:, keep] @ vt[keep]


def nuclear(x):
  return np.linalg.svd(x, compute_uv=False).sum()


def right_spectral(x, eps=EPS_SPECTRAL):
  e = eps * np.sum(x**2)
  lam, q = np.linalg.eigh(x.T @ x)
  lam = np.maximum(lam, 0)
  nu = np.sum(lam / np.sqrt(lam + e))
  return nu * x @ (q / np.sqrt(lam + e)) @ q.T


def left_spectral(x, eps=EPS_SPECTRAL):
  e = eps * np.sum(x**2)
  lam, q = np.linalg.eigh(x @ x.T)
  lam = np.maximum(lam, 0)
  nu = np.sum(lam / np.sqrt(lam + e))
  return nu * (q / np.sqrt(lam + e)) @ q.T @ x


def rand(key, shape, dtype=np.float64):
  return np.random.default_rng(key).normal(size=shape).astype(dtype)


def orthogonal(key, n):
  q, r = np.linalg.qr(rand(key, (n, n)))
  return q * np.sign(np.diag(r))


def close(actual, expected, rtol=1e-4):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.abs(expected).max())


H, KV, HD, D, FF, V, E = 2, 1, 4, 8, 6, 10, 3


def llama_grads(key, layers=None):
  """Gradients of a tiny LLaMA-style decoder with one MoE block, Flax layouts."""
  lead = () if layers is None else (layers,)
  shapes = {
    "embed/embedding": (V, D),
    "lm_head/kernel": (D, V),
    "norm/scale": (D,),
    "layers/attn/q_proj/kernel": lead + (D, H * HD),
    "layers/attn/k_proj/kernel": lead + (D, KV * HD),
    "layers/attn/v_proj/kernel": lead + (D, KV * HD),
    "layers/attn/o_proj/kernel": lead + (H * HD, D),
    "layers/mlp/gate_proj/kernel": lead + (D, FF),
    "layers/mlp/up_proj/kernel": lead + (D, FF),
    "layers/mlp/down_proj/kernel": lead + (FF, D),
    "layers/moe/router/kernel": lead + (D, E),
    "layers/moe/experts/w_in": lead + (E, D, FF),
    "layers/attn_norm/scale": lead + (D,),
  }
  tree = {}
  for i, (path, shape) in enumerate(shapes.items()):
    *parents, leaf = path.split("/")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = rand(key + i, shape, np.float32)
  return tree
