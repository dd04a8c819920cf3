"""``saggs.discover`` at its edges: activations that are (and are not) positively homogeneous,
dropout, ``lax.cond``, a weight read twice, biases that cannot follow, the numeric check's
tolerance and grouping, and Equinox modules.

Every model here is a few lines on a params dict; each expected result is written by hand and
checked by an orbit move done in NumPy (a found symmetry leaves the output put, a rejected one
moves it).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import discover_models
import saggs_jax as saggs
from saggs_jax.discovery import discover

D, F, T = 8, 16, 4
RNG = np.random.default_rng(0)


def normal(*shape, scale=None):
  return jnp.asarray(RNG.standard_normal(shape) / (scale or np.sqrt(shape[0])), jnp.float32)


MLP = {"up": normal(D, F), "down": normal(F, D)}
X = jnp.asarray(np.random.default_rng(1).standard_normal((2, T, D)), jnp.float32)


def moved(params, moves, seed=0):
  """``params`` with leaf ``path`` times ``c_g ** sign`` along ``axis`` for every
  ``(path, name, axis, groups, sign)`` of ``moves``: one random ``c`` in [1/4, 4] per group
  and per name."""
  rng = np.random.default_rng(seed)
  factors = {}

  def move(key_path, x):
    path = saggs._src.paths.path_str(key_path)
    for name, axis, groups, sign in (m[1:] for m in moves if m[0] == path):
      c = factors.setdefault(name, np.exp(rng.uniform(-np.log(4), np.log(4), groups)))
      f = np.repeat(c**sign, x.shape[axis] // groups)  # contiguous groups
      shape = [1] * x.ndim
      shape[axis] = -1
      x = jnp.asarray(np.asarray(x, np.float64) * f.reshape(shape), x.dtype)
    return x

  return jax.tree_util.tree_map_with_path(move, params)


def deviation(forward, params, moves, *inputs):
  """Largest output change under :func:`moved`, relative to max |output|."""
  with jax.default_matmul_precision("highest"):
    y0 = np.asarray(forward(params, *inputs), np.float64)
    y1 = np.asarray(forward(moved(params, moves), *inputs), np.float64)
  return float(np.max(np.abs(y1 - y0)) / np.max(np.abs(y0)))


UP_DOWN = [("up", "c", 1, F, 1), ("down", "c", 0, F, -1)]
RELU_PAIR = saggs.Pair("up", "down", axes=(1, 0), name="ReLU MLP up/down (positive factors)")


def rejected(d):
  return {(r.a, r.b): r.reason for r in d.rejected}


# ---------------------------------------------------------------------------
# Positively homogeneous or not (issue 19, points 5 and 6).


def relu6_mlp(p, x):
  return jax.nn.relu6(x @ p["up"]) @ p["down"]


def leaky_mlp(p, x):
  return jax.nn.leaky_relu(x @ p["up"]) @ p["down"]


def dropout_mlp(p, x, key):
  h = jax.nn.relu(x @ p["up"])
  return jnp.where(jax.random.bernoulli(key, 0.9, h.shape), h / 0.9, 0) @ p["down"]


def cond_mlp(p, x, flag, other=lambda h: 2 * h):
  return jax.lax.cond(flag, jax.nn.relu, other, x @ p["up"]) @ p["down"]


def test_relu6_is_no_symmetry():
  d = discover(relu6_mlp, MLP, 4 * X)
  assert list(d) == []
  assert rejected(d) == {("up", "down"): "not positively homogeneous: min between them"}
  assert deviation(relu6_mlp, MLP, UP_DOWN, 4 * X) > 0.1  # the clip at 6 sees the factor


@pytest.mark.parametrize(
  "forward, inputs",
  [
    (leaky_mlp, ()),
    (dropout_mlp, (jax.random.PRNGKey(3),)),
    (cond_mlp, (jnp.array(True),)),
    (cond_mlp, (jnp.array(False),)),
  ],
  ids=["leaky_relu", "dropout", "cond_relu", "cond_linear"],
)
def test_homogeneous_activations_are_found(forward, inputs):
  d = discover(forward, MLP, X, *inputs)
  assert list(d) == [RELU_PAIR] and d.rejected == ()
  assert deviation(forward, MLP, UP_DOWN, X, *inputs) < 1e-5


def test_a_cond_with_a_gelu_branch_is_rejected():
  def forward(p, x, flag):
    return cond_mlp(p, x, flag, jax.nn.gelu)

  d = discover(forward, MLP, X, jnp.array(False))
  assert list(d) == []
  assert rejected(d)[("up", "down")].startswith("not positively homogeneous:")
  assert deviation(forward, MLP, UP_DOWN, X, jnp.array(False)) > 1e-2


H, HD = 2, 4
ATTN = {
  "g": 1 + normal(D, scale=10),
  "wq": normal(D, H * HD),
  "wk": normal(D, H * HD),
  "wv": normal(D, H * HD),
  "wo": normal(H * HD, D),
}


def attention(p, x, k_from="wk", shift=None):
  h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["g"]
  q = h @ p["wq"] if shift is None else h @ p["wq"] + shift
  q, k, v = (y.reshape(*x.shape[:2], H, HD) for y in (q, h @ p[k_from], h @ p["wv"]))
  a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HD))
  return x + jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(x.shape[:2] + (H * HD,)) @ p["wo"]


QK = [("wq", "qk", 1, H * HD, 1), ("wk", "qk", 1, H * HD, -1)]
VO = [("wv", "vo", 1, H * HD, 1), ("wo", "vo", 0, H * HD, -1)]


def test_adding_zero_keeps_the_factor():
  def forward(p, x):
    return attention(p, x, shift=0.0)

  d = discover(forward, ATTN, X)
  assert saggs.Pair("wq", "wk", axes=(1, 1), name="attention Q/K") in d
  assert d.rejected == ()
  assert deviation(forward, ATTN, QK, X) < 1e-5


def test_q_and_k_from_one_weight():
  params = {k: v for k, v in ATTN.items() if k != "wk"}

  def forward(p, x):
    return attention(p, x, k_from="wq")

  d = discover(forward, params, X)
  assert set(d) == {
    saggs.Pair("g", ("wq", "wv"), axes=(0, 0), name="norm gain"),
    saggs.Pair("wv", "wo", axes=(1, 0), name="attention V/O"),
  }
  assert rejected(d) == {
    ("wq", "wq"): "both sides read the same weight, which cannot carry a"
    " factor and its inverse at once"
  }
  gain = {("g", "g", 0, D, 1), ("wq", "g", 0, D, -1), ("wv", "g", 0, D, -1)}
  assert deviation(forward, params, [*gain, *VO], X) < 1e-5
  assert deviation(forward, params, {("wq", "qk", 1, H * HD, 1)}, X) > 1e-2


# ---------------------------------------------------------------------------
# Guards of discover (issue 19, point 9) and its arguments (issue 20).


def mlp_plus(bias):
  def forward(p, x):
    return jax.nn.relu(x @ p["up"] + bias(p)) @ p["down"]

  return forward


CONSTANT = mlp_plus(lambda p: 0.003)


def test_an_added_constant_is_named():
  # Mutation checked: without the "an added constant" reason the pair goes to the numeric
  # check and is rejected there, with the other reason.
  d = discover(CONSTANT, MLP, X)
  assert list(d) == []
  assert rejected(d) == {("up", "down"): "not exact: an added constant between them"}


def test_the_numeric_check_is_tight(monkeypatch):
  # Blind the jaxpr reading to the constant: only the numeric check is left. The constant
  # moves the output by about 1e-3 of its scale, within a 100x looser tolerance.
  discover_models.blind_to_reasons(monkeypatch)
  d = discover(CONSTANT, MLP, X)
  assert list(d) == []
  assert rejected(d) == {
    ("up", "down"): "the jaxpr suggests it, but random factors change the output"
  }
  assert 1e-4 < deviation(CONSTANT, MLP, UP_DOWN, X) < 1e-2


@pytest.mark.parametrize(
  "shape, bias",
  [
    ((T,), lambda b: b[:, None]),  # along the tokens: no channel axis
    ((1,), lambda b: b),  # one value broadcast over the channels
  ],
  ids=["per_token", "broadcast"],
)
def test_a_bias_that_cannot_follow_breaks_the_pair(shape, bias):
  params = {**MLP, "b": normal(*shape, scale=2)}
  forward = mlp_plus(lambda p: bias(p["b"]))
  d = discover(forward, params, X)
  assert list(d) == []
  assert rejected(d) == {
    ("up", "down"): "not exact: an added parameter that does not follow it"
    " channel by channel between them"
  }
  assert deviation(forward, params, UP_DOWN, X) > 1e-3


HD6 = 6
ROPE = {
  "wq": normal(D, H * HD6),
  "wk": normal(D, H * HD6),
  "wv": normal(D, H * HD6),
  "wo": normal(H * HD6, D),
}


def rope_attention(p, x):
  q, k, v = ((x @ p[n]).reshape(*x.shape[:2], H, HD6) for n in ("wq", "wk", "wv"))
  a = jax.nn.softmax(
    jnp.einsum("bqhd,bkhd->bhqk", discover_models.rope(q), discover_models.rope(k)) / np.sqrt(HD6)
  )
  return jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(x.shape[:2] + (H * HD6,)) @ p["wo"]


def test_heads_are_contiguous_groups_with_an_odd_half_head():
  # head_dim 6: RoPE rotates channel i with i + 3 of the same head. Interleaved groups
  # (channel j in group j % 2) would split those pairs and leave only one group.
  d = discover(rope_attention, ROPE, X)
  assert set(d) == {
    saggs.Pair("wq", "wk", axes=(1, 1), groups=H, name="attention Q/K"),
    saggs.Pair("wv", "wo", axes=(1, 0), name="attention V/O"),
  }
  heads = {("wq", "qk", 1, H, 1), ("wk", "qk", 1, H, -1)}
  assert deviation(rope_attention, ROPE, heads, X) < 1e-5
  assert (
    deviation(rope_attention, ROPE, {("wq", "qk", 1, H * HD6, 1), ("wk", "qk", 1, H * HD6, -1)}, X)
    > 1e-2
  )


@pytest.mark.parametrize("rtol", [-1.0, float("nan")])
def test_a_negative_rtol_is_an_error(rtol):
  with pytest.raises(ValueError, match="rtol must be a non-negative number"):
    discover(leaky_mlp, MLP, X, rtol=rtol)


# ---------------------------------------------------------------------------
# Equinox modules (issue 19, point 7): flags and functions are static.


class EqxBlock(eqx.Module):
  attn: eqx.nn.MultiheadAttention
  up: eqx.nn.Linear
  down: eqx.nn.Linear
  dropout: eqx.nn.Dropout
  activation: object

  def __init__(self, key):
    k1, k2, k3 = jax.random.split(key, 3)
    self.attn = eqx.nn.MultiheadAttention(H, D, key=k1)
    self.up, self.down = eqx.nn.Linear(D, F, key=k2), eqx.nn.Linear(F, D, key=k3)
    self.dropout = eqx.nn.Dropout(0.1, inference=True)
    self.activation = jax.nn.relu

  def __call__(self, x):
    x = x + self.attn(x, x, x)
    return x + jax.vmap(lambda t: self.down(self.dropout(self.activation(self.up(t)))))(x)


def eqx_forward(m, x):
  return jax.vmap(m)(x)


def test_an_equinox_module():
  """Dropout's flag, the activation function and head counts are static; the (out, in)
  Linear's bias (out,) is a follower of its weight's leading axis."""
  block = EqxBlock(jax.random.PRNGKey(0))
  d = discover(eqx_forward, block, X)
  assert set(d) == {
    saggs.Pair("query_proj/weight", "key_proj/weight", axes=(0, 0), name="attention Q/K"),
    saggs.Pair("value_proj/weight", "output_proj/weight", axes=(0, 1), name="attention V/O"),
    saggs.Pair(
      "up/weight",
      "down/weight",
      axes=(0, 1),
      follow_a="up/bias",
      name="ReLU MLP up/down (positive factors)",
    ),
  }
  assert rejected(d) == {
    # the residual adds the model's input, which no factor scales
    ("attn/output_proj/weight", "up/weight"): "not exact: an added constant between them"
  }
  n = H * (D // H)
  moves = {
    ("attn/query_proj/weight", "qk", 0, n, 1),
    ("attn/key_proj/weight", "qk", 0, n, -1),
    ("attn/value_proj/weight", "vo", 0, n, 1),
    ("attn/output_proj/weight", "vo", 1, n, -1),
    ("up/weight", "c", 0, F, 1),
    ("up/bias", "c", 0, F, 1),
    ("down/weight", "c", 1, F, -1),
  }
  assert deviation(eqx_forward, block, moves, X) < 1e-5
  assert deviation(eqx_forward, block, {("up/weight", "c", 0, F, 1)}, X) > 1e-2


def test_a_follower_a_pair_cannot_declare_is_rejected_with_its_reason():
  """An (out, in) kernel's bias stored (1, out): two axes, so a Pair would move it along the
  kernel's trailing axes (its size-1 axis 0), not along the channel it follows (axis 1).
  The pair is rejected, saying so, instead of declared wrongly; it is exact all the same."""
  params = {"up": normal(F, D, scale=np.sqrt(D)), "b": normal(1, F), "down": normal(D, F)}
  forward = lambda p, x: jax.nn.relu(x @ p["up"].T + p["b"]) @ p["down"].T  # noqa: E731
  d = discover(forward, params, X)
  assert list(d) == []
  assert rejected(d) == {
    ("up", "down"): "its bias 'b' follows axis 0 of 'up' along another"
    " axis than a Pair's follower: a bias vector's own,"
    " or its kernel's trailing axes"
  }
  moves = {("up", "c", 0, F, 1), ("b", "c", 1, F, 1), ("down", "c", 1, F, -1)}
  assert deviation(forward, params, moves, X) < 1e-5


# ---------------------------------------------------------------------------
# Roles for equivariant.symmetry_compatible (issue 19, point 8).


class _FaultyJit:
  """``jax`` as discover's confirmation sees it, on a backend whose jitted tangent comes back
  with garbage (as XLA:CPU's YNNPACK fusion of a reduction with the last dot once did: 8.6e33
  for a direction that is exactly zero)."""

  def __getattr__(self, name):
    return getattr(jax, name)

  @staticmethod
  def jit(fn):
    jitted = jax.jit(fn)
    return lambda *args: [x + 8.6e33 for x in jitted(*args)]


def test_a_backend_that_fails_the_zero_direction_control_refutes_nothing(monkeypatch):
  """The first-order check is also run on a zero direction, whose tangent must be exactly 0:
  when it is not, discover says so, naming the backend, and judges on the finite count alone
  instead of refuting an exact pair."""
  from saggs_jax._src.discovery import confirmation

  monkeypatch.setattr(confirmation, "jax", _FaultyJit())
  with pytest.warns(RuntimeWarning, match=r"zero direction is not zero on the cpu backend"):
    d = discover(leaky_mlp, MLP, X)
  assert list(d) == [RELU_PAIR] and d.rejected == ()
