"""saggs_jax._src.discovery.roles: the roles read off a LLaMA whose names are Meta's, not Hugging
Face's, and the stack they route (equivariant.symmetry_compatible(patterns=...))."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import discover_models
from saggs_jax import equivariant as eqv
from saggs_jax.discovery import discover

RNG = np.random.default_rng(0)

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
    q = discover_models.rope((h @ a["wq"]).reshape(b, t, HEADS, HEAD_DIM))
    k, v = (
      jnp.repeat((h @ a[n]).reshape(b, t, KV, HEAD_DIM), HEADS // KV, axis=2) for n in ("wk", "wv")
    )
    logits = jnp.where(
      mask, jnp.einsum("bqhd,bkhd->bhqk", q, discover_models.rope(k)) / np.sqrt(HEAD_DIM), -1e9
    )
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


STACK = dict(decoder=eqv.Decoder(HEADS, KV, HEAD_DIM), learning_rates={"adamw": 3e-3}, beta=0.0)


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


def normal(*shape, scale=None):
  return jnp.asarray(RNG.standard_normal(shape) / (scale or np.sqrt(shape[0])), jnp.float32)
