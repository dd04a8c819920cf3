"""saggs_jax._src.norms: the group statistics against NumPy at every scale, off and on a mesh, and
the layout of an instance's factors on a leaf's statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import saggs_jax as saggs
from saggs_jax._src import norms
from saggs_jax._src.numerics import log_dtype_max
from saggs_jax._src.plan import Slot, resolve

# Groups of q (4 KV groups of 4 columns) and of up (one per column): ordinary, squares that
# overflow (1e25) or underflow (1e-25, 1e-37) float32, 1e20 beside 1e-20 in one group, a
# zero group, and float32's largest entries (a norm past the dtype's range).
SCALES = np.array([1.0, 1e25, 1e-25, 1e-37, 1e20, 0.0, 3e38, 1.0])


def extreme_params(per_group: bool):
  """With ``per_group`` the scales differ between the groups of a leaf, and up holds an inf
  and a NaN (columns 7 and 0); else q is all 1e25 and up all 1e-25 (column 5 zero): the
  scale-safe recompute on a mesh divides a copy by its largest group maximum, so groups
  of one leaf over ~1e19 apart would underflow there."""
  rng = np.random.default_rng(0)
  entries = lambda *shape: rng.choice([-1.0, 1.0], shape) * rng.uniform(0.5, 1.0, shape)  # noqa: E731
  q_scale = np.repeat(SCALES[:4], 4) if per_group else np.full(16, 1e25)
  q = entries(8, 16) * q_scale
  if per_group:
    q[:, 12:] *= np.array([1e20, 1e-20, 1.0, 1.0])
  up = entries(8, 8) * (SCALES if per_group else np.where(np.arange(8) == 5, 0.0, 1e-25))
  if per_group:
    up[2, 7], up[5, 0] = np.inf, np.nan
  params = {
    "q": q.astype(np.float32),
    "k": entries(8, 8).astype(np.float32),
    "up": up.astype(np.float32),
    "down": entries(8, 8).astype(np.float32),
  }
  pairs = [saggs.Pair("q", "k", axes=(1, 1), groups=4), saggs.Pair("up", "down", axes=(1, 0))]
  return params, pairs


def numpy_stats(x, groups):
  """(log sum x**2, log max |x|) per group of the columns, in float64; +inf where a group
  holds a non-finite entry."""
  x = np.asarray(x, np.float64).reshape(x.shape[0], groups, -1)
  finite = np.all(np.isfinite(x), axis=(0, 2))
  with np.errstate(divide="ignore", invalid="ignore"):
    log_sq = np.log(np.sum(x**2, axis=(0, 2)))
    log_max = np.log(np.max(np.abs(x), axis=(0, 2)))
  return np.where(finite, log_sq, np.inf), np.where(finite, log_max, np.nan)


def leaf_stats_where(where: str, plan, params):
  """``norms.leaf_stats`` run eagerly, under jit, or under jit on a one-device mesh."""
  fn = lambda p: norms.leaf_stats(plan, p)  # noqa: E731
  if where == "eager":
    return fn(params)
  if where == "jit":
    return jax.jit(fn)(params)
  with jax.set_mesh(jax.make_mesh((1,), ("x",))):
    return jax.jit(fn)(params)


def check_stats(stats, params, nonfinite):
  limit = log_dtype_max(jnp.float32)
  for name, groups in (("q", 4), ("up", 8)):
    log_sq, bound = (np.asarray(v) for v in stats[name, None])
    want_sq, want_max = numpy_stats(params[name], groups)
    finite = np.isfinite(want_sq)
    np.testing.assert_allclose(log_sq[finite], want_sq[finite], rtol=0, atol=2e-5, err_msg=name)
    np.testing.assert_array_equal(log_sq[~finite], want_sq[~finite], err_msg=name)
    # The norm bounds the largest entry while it fits float32, the largest entry beyond.
    fits = want_sq <= 2 * limit
    np.testing.assert_allclose(bound[fits], 0.5 * want_sq[fits], rtol=0, atol=2e-5)
    past = ~fits & finite
    np.testing.assert_allclose(bound[past], want_max[past], rtol=0, atol=2e-5)
    assert name != "up" or past.any() == nonfinite  # the 3e38 column is past the range
    if name == "up":  # a non-finite entry reaches its own group only; the zero group is -inf
      np.testing.assert_array_equal(
        np.isposinf(log_sq), np.isin(np.arange(8), [0, 7] if nonfinite else [])
      )
      assert log_sq[5] == -np.inf


@pytest.mark.parametrize("where", ["eager", "jit", "jit on a mesh"])
def test_group_norms_against_numpy_at_every_scale(where):
  """Off a mesh one scaled sum of squares per group; on a mesh the float32 pass and the
  scale-safe recompute of the groups it over- or underflowed."""
  params, pairs = extreme_params(per_group=where != "jit on a mesh")
  params = jax.tree.map(jnp.asarray, params)
  plan = resolve(pairs, params)
  stats = leaf_stats_where(where, plan, params)
  check_stats(stats, params, nonfinite=where != "jit on a mesh")


def test_stacked_axes_and_along_slot_lay_each_instance_on_its_own_axis():
  """A leaf in a per-layer instance of 3 groups (slot 0) and in one of every layer and expert
  together, its whole tensor per copy (slot 1): its statistics are (layers, experts, 3, 1),
  and each instance's log-factors go along its own axis, broadcast over the rest."""
  slots = [Slot("qk", 1, 2, 3, (0,)), Slot("moe", -1, None, 1, (0, 1))]
  assert norms.stacked_axes(slots) == (0, 1)
  per_layer = jnp.arange(6.0).reshape(2, 3)  # 2 layers x 3 groups
  assert norms.along_slot(per_layer, 0, slots).shape == (2, 1, 3, 1)
  every_copy = jnp.arange(10.0).reshape(2, 5)  # layers x experts, whole tensors
  laid = norms.along_slot(every_copy, 1, slots)
  assert laid.shape == (2, 5, 1, 1)
  np.testing.assert_array_equal(laid[:, :, 0, 0], every_copy)


def range_params(dtype, mixed: bool):
  """``a`` and ``b`` (8, 16), 4 groups of 4 columns each, in ``dtype``, from NumPy float64
  entries of random sign: with ``mixed``, ``a`` at 1e-38 (1.2e-38 to 2e-38: the smallest
  normal binade of float32 and bfloat16, whose squares underflow), at 3e38 (1.5e38 to 3e38,
  near both dtypes' largest finite value: the squares and the norm overflow), 1e-38 rows
  between 3e38 ones, and 1e-38 rows between ordinary ones (0.5 to 1), and ``b`` ordinary;
  else (on a mesh, whose recompute scales a leaf by its largest group maximum) ``a`` all
  at 1e-38 and ``b`` all at 3e38. (XLA:CPU flushes subnormal inputs to zero, so the
  smallest entries are normal.)"""
  rng = np.random.default_rng(1)
  sign = lambda: rng.choice([-1.0, 1.0], (8, 16))  # noqa: E731
  tiny, huge, one = (sign() * rng.uniform(lo, 2 * lo, (8, 16)) for lo in (1.2e-38, 1.5e38, 0.5))
  tiny = np.minimum(np.abs(tiny), 2e-38) * np.sign(tiny)
  if not mixed:
    return {"a": jnp.asarray(tiny, dtype), "b": jnp.asarray(huge, dtype)}
  rows = np.arange(8)[:, None] % 2 == 0
  a = np.concatenate(
    [
      tiny[:, :4],
      huge[:, 4:8],
      np.where(rows, tiny, huge)[:, 8:12],
      np.where(rows, tiny, one)[:, 12:],
    ],
    axis=1,
  )
  return {"a": jnp.asarray(a, dtype), "b": jnp.asarray(one, dtype)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("where", ["eager", "jit", "jit on a mesh"])
def test_groups_at_the_ends_of_the_range_against_numpy_float64(dtype, where):
  """Groups at 1e-38, at 3e38 and both mixed (see :func:`range_params`), in float32 and
  bfloat16: the log squared norms are NumPy's in float64 from the same entries, and the
  bound is half of it while the norm fits the dtype, the largest entry past it."""
  params = range_params(dtype, mixed=where != "jit on a mesh")
  plan = resolve([saggs.Pair("a", "b", axes=(1, 1), groups=4)], params)
  stats = leaf_stats_where(where, plan, params)
  limit = log_dtype_max(dtype)
  for name in ("a", "b"):
    log_sq, bound = (np.asarray(v) for v in stats[name, None])
    assert log_sq.dtype == bound.dtype == np.float32
    want_sq, want_max = numpy_stats(np.asarray(params[name], np.float64), 4)
    np.testing.assert_allclose(log_sq, want_sq, rtol=0, atol=2e-5, err_msg=name)
    want_bound = np.where(want_sq <= 2 * limit, 0.5 * want_sq, want_max)
    np.testing.assert_allclose(bound, want_bound, rtol=0, atol=2e-5, err_msg=name)
  # The cases are what they say: normal entries whose squares underflow, or overflow.
  x = np.abs(np.asarray(params["a"] if where != "jit on a mesh" else params["b"], np.float64))
  small = np.abs(np.asarray(params["a"], np.float64))[:, :4]
  assert np.all((small >= np.finfo(np.float32).tiny) & (small < 2.1e-38))
  assert np.all(np.asarray(params["a"][:, :4], np.float32) ** 2 == 0)
  big = x[:, 4:8] if where != "jit on a mesh" else x
  with np.errstate(over="ignore"):
    assert np.isinf(np.sum(big.astype(np.float32) ** 2)) and np.all(big < 3.1e38)


def test_an_untrusted_leaf_leaves_the_others_plain_sums_as_they_are():
  """One cond reads every ordinary leaf again when any sum over- or underflowed; the pieces
  whose sums were trusted keep them: their statistics, under jit, are those of the same
  pieces beside ordinary leaves to the bit, and equal NumPy's float64 ones."""
  params, pairs = extreme_params(per_group=False)  # q's squares overflow, up's underflow
  plan = resolve(pairs, params)
  ordinary = {**params, "q": params["k"].repeat(2, axis=1), "up": params["down"]}
  stats = jax.jit(lambda p: norms.leaf_stats(plan, p))
  beside_extremes, beside_ordinary = stats(params), stats(ordinary)
  for path, groups in (("k", 4), ("down", 8)):
    key = (path, None)
    for a, b in zip(beside_extremes[key], beside_ordinary[key]):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    log_sq, _ = numpy_stats(params[path] if path == "k" else params[path].T, groups)
    np.testing.assert_allclose(np.asarray(beside_extremes[key][0]), log_sq, rtol=1e-6)
