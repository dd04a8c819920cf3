"""``saggs.discover`` at its edges: activations that are (and are not) positively homogeneous,
dropout, ``lax.cond``, a weight read twice, biases that cannot follow, the numeric check's
tolerance and grouping, Equinox modules, and the roles it hands to
``equivariant.symmetry_compatible``.

Every model here is a few lines on a params dict; each expected result is written by hand and
checked by an orbit move done in NumPy (a found symmetry leaves the output put, a rejected one
moves it).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import discover_models
import saggs_jax as saggs
from saggs_jax import equivariant as eqv
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
    path = saggs.paths.path_str(key_path)
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


def rope(x):
  """Rotate-half RoPE on (batch, tokens, heads, head_dim)."""
  half = x.shape[-1] // 2
  angle = np.arange(x.shape[1])[:, None] / 100.0 ** (np.arange(half) / half)
  cos, sin = (jnp.asarray(f(angle)[None, :, None, :], jnp.float32) for f in (np.cos, np.sin))
  a, b = x[..., :half], x[..., half:]
  return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


HD6 = 6
ROPE = {
  "wq": normal(D, H * HD6),
  "wk": normal(D, H * HD6),
  "wv": normal(D, H * HD6),
  "wo": normal(H * HD6, D),
}


def rope_attention(p, x):
  q, k, v = ((x @ p[n]).reshape(*x.shape[:2], H, HD6) for n in ("wq", "wk", "wv"))
  a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", rope(q), rope(k)) / np.sqrt(HD6))
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

LAYERS, HEADS, KV, HEAD_DIM, V = 2, 4, 2, 8, 32
DM, FM = 32, 64


def meta_init(seed=0):
  """A LLaMA with Meta's names: tok_embeddings, layers/i/attention/w{q,k,v,o},
  feed_forward/w1 (gate), w3 (up), w2 (down), attention_norm, ffn_norm, norm, output."""
  r = np.random.default_rng(seed)

  def w(*shape):
    return jnp.asarray(r.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)

  def gain():
    return jnp.asarray(1 + 0.1 * r.standard_normal(DM), jnp.float32)

  layer = lambda: {  # noqa: E731
    "attention": {
      "wq": w(DM, HEADS * HEAD_DIM),
      "wk": w(DM, KV * HEAD_DIM),
      "wv": w(DM, KV * HEAD_DIM),
      "wo": w(HEADS * HEAD_DIM, DM),
    },
    "feed_forward": {"w1": w(DM, FM), "w2": w(FM, DM), "w3": w(DM, FM)},
    "attention_norm": {"weight": gain()},
    "ffn_norm": {"weight": gain()},
  }
  return {
    "tok_embeddings": {"weight": w(V, DM)},
    "layers": [layer() for _ in range(LAYERS)],
    "norm": {"weight": gain()},
    "output": {"weight": w(DM, V)},
  }


def meta_forward(p, tokens):
  def norm(x, g):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g

  x = p["tok_embeddings"]["weight"][tokens]
  b, t = tokens.shape
  mask = jnp.tril(jnp.ones((t, t), bool))
  for layer in p["layers"]:
    a, f = layer["attention"], layer["feed_forward"]
    h = norm(x, layer["attention_norm"]["weight"])
    q = rope((h @ a["wq"]).reshape(b, t, HEADS, HEAD_DIM))
    k, v = (
      jnp.repeat((h @ a[n]).reshape(b, t, KV, HEAD_DIM), HEADS // KV, axis=2) for n in ("wk", "wv")
    )
    logits = jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", q, rope(k)) / np.sqrt(HEAD_DIM), -1e9)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v)
    x = x + out.reshape(b, t, HEADS * HEAD_DIM) @ a["wo"]
    h = norm(x, layer["ffn_norm"]["weight"])
    x = x + (jax.nn.silu(h @ f["w1"]) * (h @ f["w3"])) @ f["w2"]
  return norm(x, p["norm"]["weight"]) @ p["output"]["weight"]


META_ROLES = {
  "embedding": ("tok_embeddings/weight",),
  "lm_head": ("output/weight",),
  "query": ("wq",),
  "key_value": ("wk", "wv"),
  "output": ("wo",),
  "gate_up": ("w1", "w3"),
  "down": ("w2",),
}
STACK = dict(
  adamw_learning_rate=3e-3, num_heads=HEADS, num_kv_heads=KV, head_dim=HEAD_DIM, beta=0.0
)


def per_rule(tx, params):
  """How many parameters each rule of a ``symmetry_compatible`` stack holds, by role."""
  names = list(eqv.ROLE_PATTERNS) + ["default"]
  state = tx.init(params).inner_states
  return {
    names[int(k[5:])] if k.startswith("rule_") else k: len(
      jax.tree.leaves(optax.tree_utils.tree_get(state[k], "mu"))
    )
    for k in state
  }


def test_a_given_role_claims_its_leaves_from_the_default_patterns():
  """gpt-oss's HF names: ``experts/down_proj/kernel`` (E, F, d) is an expert, though the default
  ``down`` pattern ``down_proj/kernel`` matches it too (the dense MLP roles match nothing)."""
  experts = {n: {"kernel": jnp.ones((3, 4, 4))} for n in ("gate_proj", "up_proj", "down_proj")}
  params = {"mlp": {"experts": experts, "router": {"kernel": jnp.ones((4, 3))}}}
  patterns = {
    "experts": ("gate_proj/kernel", "up_proj/kernel", "down_proj/kernel"),
    "router": ("router/kernel",),
  }
  tx = eqv.symmetry_compatible(0.02, patterns=patterns, **STACK)
  assert {r: n for r, n in per_rule(tx, params).items() if n} == {"experts": 3, "router": 1}


def test_roles_route_a_meta_named_llama():
  params = meta_init()
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, V, (2, 8)), jnp.int32)
  d = discover(meta_forward, params, tokens)
  assert d.roles == META_ROLES
  found = eqv.symmetry_compatible(0.02, patterns=d.roles, **STACK)
  assert per_rule(found, params) == {
    "embedding": 1,
    "lm_head": 1,
    "query": 2,
    "key_value": 4,
    "output": 2,
    "gate_up": 4,
    "down": 2,
    "router": 0,
    "experts": 0,
    "default": 5,
  }
  by_hand = eqv.symmetry_compatible(
    0.02,
    patterns={
      "embedding": "tok_embeddings/weight",
      "lm_head": "output/weight",
      "query": "attention/wq",
      "key_value": ("attention/wk", "attention/wv"),
      "output": "attention/wo",
      "gate_up": ("feed_forward/w1", "feed_forward/w3"),
      "down": "feed_forward/w2",
    },
    **STACK,
  )
  grads = jax.tree.map(lambda x: normal(*x.shape), params)
  updates = jax.jit(lambda g, p: [tx.update(g, tx.init(p), p)[0] for tx in (found, by_hand)])(
    grads, params
  )
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), *updates)


def test_a_role_that_matches_nothing_is_an_error():
  params = meta_init()
  with pytest.raises(
    ValueError,
    match=r"role 'query' matches no parameter \(patterns "
    r"\['q_proj/kernel'\]\).*fall to AdamW",
  ):
    eqv.symmetry_compatible(0.02, **STACK).init(params)
  with pytest.raises(
    ValueError,
    match=r"role 'router' matches no parameter \(patterns "
    r"\['gate'\]\)",
  ):
    eqv.symmetry_compatible(0.02, patterns={**META_ROLES, "router": "gate"}, **STACK).init(params)
