"""``saggs.discover`` on the layouts it got wrong on third-party models (issue 44), each a tiny
plain-JAX model of ``discover_shapes``: BLOOM's fused QKV interleaved per head, a discarded
product with the embedding beside an untied head, GPT-J's partial rotary embedding, and
DeepSeek's latent attention.

The oracle is the model's logits after random factors applied here in NumPy to the columns
the symmetry names (side a by ``c``, side b by ``1/c``), exact to float32 rounding.
"""

import functools

import jax
import numpy as np
import pytest

import discover_shapes as ds
import saggs_jax as saggs
from saggs_jax.discovery import discover

RTOL = 1e-5  # float32 logits, full-precision matmuls


def logits_change(forward, params, moved) -> float:
  """The largest change of the logits when ``params`` become ``moved``, relative to their size."""
  with jax.default_matmul_precision("highest"):
    y0 = np.asarray(forward(params, ds.tokens()))
    y1 = np.asarray(forward(jax.tree.map(np.asarray, moved), ds.tokens()))
  return float(np.max(np.abs(y1 - y0)) / np.max(np.abs(y0)))


def scaled(x, columns, factors, axis):
  """``x`` with its ``columns`` along ``axis`` multiplied by ``factors`` (one per column)."""
  x = np.array(x, np.float64)
  shape = [1] * x.ndim
  shape[axis] = len(columns)
  index = (slice(None),) * axis + (columns,)
  x[index] = x[index] * np.reshape(factors, shape)
  return x


def per_group(rng, n, groups):
  """``n`` factors in [1/4, 4], one per contiguous group of ``n // groups``."""
  return np.repeat(np.exp(rng.uniform(-np.log(4), np.log(4), groups)), n // groups)


def copy(params):
  return jax.tree.map(lambda x: np.array(x, np.float64), params)


# ---------------------------------------------------------------------------
# BLOOM: q, k and v columns interleaved per head along the fused output axis.


@functools.cache
def bloom_found():
  return discover(ds.bloom_forward, ds.bloom_init(), ds.tokens())


def test_interleaved_qkv_pairs_are_exact_but_rejected_as_undeclarable():
  found = bloom_found()
  fused = [p for p in found if "qkv" in repr((p.a, p.b)) and "norm" not in p.name]
  assert not fused  # a Block is contiguous: declaring q|k|v blocks here would be false
  reasons = {(r.a, r.b): r.reason for r in found.rejected}
  assert len(reasons) == 2, found.report()
  for reason in reasons.values():
    assert "interleaves its blocks along axis 1" in reason and "every 12" in reason, reason
    assert "exact at 8 groups" in reason  # per channel: Q/K with no RoPE, and V/O
    assert "both scale with it" not in reason  # the false reason of a whole-leaf factor
  # the reason is true: both are exact per channel (columns of q against k, v against o)
  params, rng = ds.bloom_init(), np.random.default_rng(0)
  q, k, v = (ds.bloom_columns(part) for part in range(3))
  c = per_group(rng, len(q), len(q))
  moved = copy(params)
  for name in ("kernel", "bias"):
    axis = 1 if name == "kernel" else 0
    w = scaled(moved["attn"]["qkv"][name], q, c, axis)
    moved["attn"]["qkv"][name] = scaled(w, k, 1 / c, axis)
  assert logits_change(ds.bloom_forward, params, moved) < RTOL
  c = per_group(rng, len(v), len(v))
  moved = copy(params)
  moved["attn"]["qkv"]["kernel"] = scaled(moved["attn"]["qkv"]["kernel"], v, c, 1)
  moved["attn"]["qkv"]["bias"] = scaled(moved["attn"]["qkv"]["bias"], v, c, 0)
  moved["attn"]["o"]["kernel"] = scaled(moved["attn"]["o"]["kernel"], np.arange(len(v)), 1 / c, 0)
  assert logits_change(ds.bloom_forward, params, moved) < RTOL
  # and the contiguous blocks a Block would name are not a symmetry: the rejection matters
  thirds = np.arange(8), np.arange(8, 16)
  moved = copy(params)
  w = scaled(moved["attn"]["qkv"]["kernel"], thirds[0], c, 1)
  moved["attn"]["qkv"]["kernel"] = scaled(w, thirds[1], 1 / c, 1)
  assert logits_change(ds.bloom_forward, params, moved) > 1e-2


# ---------------------------------------------------------------------------
# A product with the embedding that never reaches the output.


def test_a_discarded_use_of_the_embedding_is_no_weight_tying():
  params = ds.dead_init()
  found = discover(ds.dead_forward, params, ds.tokens())
  assert not found.rejected, found.report()
  assert saggs.Pair("final_norm/scale", "head", axes=(0, 0), name="norm gain") in set(found)
  rng = np.random.default_rng(1)
  c = per_group(rng, ds.D, ds.D)
  moved = copy(params)
  moved["final_norm"]["scale"] = moved["final_norm"]["scale"] * c
  moved["head"] = moved["head"] / c[:, None]
  assert logits_change(ds.dead_forward, params, moved) < RTOL


# ---------------------------------------------------------------------------
# Partial rotary embedding: the first ``rotary`` dims of each head rotated, the rest passed.


def qk_change(rotary: int, groups: int, seed: int = 0) -> float:
  """The logits' change when q's columns take per-group factors and k's their inverses."""
  forward = functools.partial(ds.partial_rope_forward, rotary=rotary)
  params = ds.partial_rope_init()
  c = per_group(np.random.default_rng(seed), ds.PR_H * ds.PR_HD, groups)
  moved = copy(params)
  moved["attn"]["q"] = moved["attn"]["q"] * c
  moved["attn"]["k"] = moved["attn"]["k"] / c
  return logits_change(forward, params, moved)


@pytest.mark.parametrize(
  "rotary, groups",
  [
    (4, 4),  # head dims 8: rotated 0:4 and passed 4:8 apart, per head: 4 groups
    (6, 2),  # rotated 0:6, passed 6:8: no equal groups fall on both bounds; per head
  ],
)
def test_partial_rotary_qk_is_found_at_its_finest_equal_groups(rotary, groups):
  forward = functools.partial(ds.partial_rope_forward, rotary=rotary)
  found = discover(forward, ds.partial_rope_init(), ds.tokens())
  qk = [p for p in found if p.name == "attention Q/K"]
  assert qk == [saggs.Pair("q", "k", axes=(1, 1), groups=groups, name="attention Q/K")]
  assert qk_change(rotary, groups) < RTOL
  # nothing false: the next finer grouping (per rotated pair half, per channel) is no symmetry
  finer = 2 * groups if rotary == 4 else 4
  assert qk_change(rotary, finer) > 1e-3
  assert qk_change(rotary, ds.PR_H * ds.PR_HD) > 1e-3


# ---------------------------------------------------------------------------
# MLA: the non-rotary query dims of each head against the latent's non-rotary key dims.


def mla_change(query_dims: slice, seed: int = 0) -> float:
  """The logits' change when each head's ``query_dims`` take a factor and its non-rotary
  key columns of ``wkv_b`` the inverse."""
  params = ds.mla_init()
  c = per_group(np.random.default_rng(seed), ds.MLA_H, ds.MLA_H)[:, None]
  moved = copy(params)
  moved["attn"]["query"][:, :, query_dims] *= c
  moved["attn"]["wkv_b"][:, :, : ds.MLA_NOPE] /= c
  return logits_change(ds.mla_forward, params, moved)


def test_mla_pairs_each_heads_non_rotary_query_and_key_blocks():
  found = discover(ds.mla_forward, ds.mla_init(), ds.tokens())
  nope = saggs.Pair(
    saggs.Block("query", axis=2, parts=2, part=0),
    saggs.Block("wkv_b", axis=2, parts=2, part=0),
    axes=(1, 1),
    name="attention Q/K",
  )
  assert nope in set(found), found.report()
  assert not [r for r in found.rejected if "concatenation" in r.reason], found.report()
  assert mla_change(slice(0, ds.MLA_NOPE)) < RTOL
  assert mla_change(slice(None)) > 1e-3  # the rotary dims stay: the key's are shared
  # every pair found is exact (NumPy orbit move of test_discover, on the found patterns)
  from test_discover import orbit_move

  params = ds.mla_init()
  for seed in range(2):
    assert logits_change(ds.mla_forward, params, orbit_move(params, found, seed)) < RTOL
