"""The roles of a zoo model and the stack they route, against the paper's formulas in NumPy.

``check_roles``: ``discover(...).roles`` names exactly the leaves each role has in the
architecture (written per model). ``check_stack_rules``: ``symmetry_compatible(patterns=
found.roles)`` builds, and its first update of every such leaf is the rule Lau and Su assign
to the role, computed here from the gradient alone (one step from a zero momentum: every rule
is scale-invariant, so the EMA's ``1 - β`` drops out):

==========  =====================================================================
embedding   R(G): each vocabulary row to unit norm
lm_head     P(R(P(G))) over the vocabulary columns, P(X) = X - mean over units
query,      polar per head of ``head_dim`` (SVD: U Vᵀ), times √max(1, out/in)
key_value,
output
gate_up     per hidden neuron j, [gate[:, j]; up[:, j]] to unit norm (jointly)
down        each hidden neuron's row of the (F, d) kernel to unit norm
router      P(R(P(G))) over the experts' columns of the (d, E) kernel
experts     polar per expert of the (E, in, out) stack, times √max(1, out/in)
==========  =====================================================================
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np

import saggs_jax as saggs
from zoo_oracle import Zoo, found, leaves, match, path_str

ROW = 1e-4  # relative error of the row rules (float32)
# a polar update against the SVD's: Polar Express's 5 steps leave the singular values within a
# few percent of 1 (float32), as tests/test_equivariant_reference.py allows Muon in bfloat16
POLAR_COSINE, POLAR_NORM = 0.99, 0.1


def _paths(values, patterns):
  return sorted(p for p in values if any(match(q, p) is not None for q in patterns))


def check_roles(zoo: Zoo, roles: dict):
  """``found.roles`` covers each role of ``roles`` (role -> patterns of the architecture's leaves)
  with exactly those leaves, and names no other role."""
  values = leaves(zoo.params)
  got = found(zoo).roles
  wrong = []
  for role in sorted(set(roles) | set(got)):
    want, have = _paths(values, roles.get(role, ())), _paths(values, got.get(role, ()))
    if want != have:
      wrong.append(f"{role}: expected {want}, found.roles gives {list(got.get(role, ()))} = {have}")
  assert not wrong, f"{zoo.name}: roles differ:\n  " + "\n  ".join(wrong)


def _unit(x, axis):
  return x / np.linalg.norm(x, axis=axis, keepdims=True)


def _centered(x, unit_axis):
  """P(R(P(x))): units along ``unit_axis`` (each a vector over the other axis of a matrix)."""
  other = 1 - unit_axis
  p = lambda y: y - y.mean(axis=unit_axis, keepdims=True)
  return p(_unit(p(x), other))


def _polar(x):
  u, _, vt = np.linalg.svd(x, full_matrices=False)
  return u @ vt * np.sqrt(max(1.0, x.shape[-1] / x.shape[-2]))


def _heads(x, head_dim, axis):
  """polar per head: ``axis`` (of a 2-D Flax kernel) split into heads of ``head_dim``."""
  blocks = np.split(x, x.shape[axis] // head_dim, axis=axis)
  return np.concatenate([_polar(b) for b in blocks], axis=axis)


def reference(role, g, head_dim, partner=None):
  """The paper's update for a leaf of ``role`` with gradient ``g`` (float64; ``partner``: the
  other of a gate/up pair)."""
  if role == "embedding":
    return _unit(g, 1)
  if role in ("lm_head", "router"):
    return _centered(g, 1)
  if role in ("query", "key_value"):
    return _heads(g, head_dim, 1)
  if role == "output":
    return _heads(g, head_dim, 0)
  if role == "gate_up":
    return g / np.sqrt(np.sum(g**2, 0) + np.sum(partner**2, 0))
  if role == "down":
    return _unit(g, 1)
  if role == "experts":
    return np.stack([_polar(e) for e in g])
  raise ValueError(role)


def check_stack_rules(zoo: Zoo, roles: dict, head_dim: int):
  """Every leaf of every role in ``roles``: the stack's first update against :func:`reference`."""
  tx = saggs.equivariant.symmetry_compatible(
    1.0,
    patterns=found(zoo).roles,
    decoder=saggs.equivariant.Decoder(head_dim=head_dim),
    newton_schulz=saggs.equivariant.NewtonSchulz(dtype=jnp.float32),
  )
  grads = jax.tree_util.tree_map_with_path(
    lambda kp, x: jax.random.normal(
      jax.random.key(zlib.crc32(path_str(kp).encode())), x.shape, x.dtype
    ),
    zoo.params,
  )
  updates, _ = jax.jit(tx.update)(grads, tx.init(zoo.params), zoo.params)
  got, g = leaves(jax.tree.map(lambda u: -u, updates)), leaves(grads)
  bad = []
  for role, patterns in roles.items():
    for path in _paths(g, patterns):
      partner = None
      if role == "gate_up":  # the other projection (another pattern) of the same layer
        mine = [q for q in patterns if match(q, path) is not None]
        others = _paths(g, [q for q in patterns if q not in mine])
        partner = g[min(others, key=lambda p: _distance(p, path))]
      want = reference(role, g[path], head_dim, partner)
      if role in ("query", "key_value", "output", "experts"):
        cos = np.sum(want * got[path]) / np.linalg.norm(want) / np.linalg.norm(got[path])
        scale = np.linalg.norm(got[path]) / np.linalg.norm(want)
        if cos < POLAR_COSINE or abs(scale - 1) > POLAR_NORM:
          bad.append(f"{role} {path}: cosine {cos:.4f}, norm ratio {scale:.3f}")
      else:
        err = np.linalg.norm(got[path] - want) / np.linalg.norm(want)
        if err > ROW:
          bad.append(f"{role} {path}: relative error {err:.2e}")
  assert not bad, f"{zoo.name}: the stack's updates differ from the paper's:\n  " + "\n  ".join(bad)


def _distance(a, b):
  """How far two paths are apart: segments that differ (the gate/up partner differs in one)."""
  sa, sb = a.split("/"), b.split("/")
  return sum(x != y for x, y in zip(sa, sb)) + abs(len(sa) - len(sb))
