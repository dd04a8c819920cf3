"""saggs_jax._src.equivariant.stack: the one stack builder and its presets.

The rules themselves are checked against NumPy in test_rules.py and against the reference
implementation's golden data in test_equivariant_reference.py; here: routing by path
(layerwise), the optimizer's weight decay, the stack's update against NumPy, what a preset
fills in, and the builder's errors."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from equivariant_oracles import (
  EXACT_NS,
  FF,
  HD,
  KV,
  D,
  F,
  H,
  U,
  V,
  center,
  close,
  left_spectral,
  llama_grads,
  nuclear,
  polar,
  rand,
  row_norm,
)
from saggs_jax import equivariant as eqv
from saggs_jax._src.equivariant import stack
from saggs_jax._src.paths import path_str

WIDTH, HIDDEN, VOCAB = 8, 16, 32


def _params():
  keys = iter(jax.random.split(jax.random.key(0), 8))
  normal = lambda shape: jax.random.normal(next(keys), shape)  # noqa: E731
  return {
    "embed": {"embedding": normal((VOCAB, WIDTH))},
    "layer": {
      "q_proj": {"kernel": normal((WIDTH, WIDTH))},
      "gate_proj": {"kernel": normal((WIDTH, HIDDEN))},
      "up_proj": {"kernel": normal((WIDTH, HIDDEN))},
      "down_proj": {"kernel": normal((HIDDEN, WIDTH))},
    },
    "lm_head": {"kernel": normal((WIDTH, VOCAB))},
  }


PARAMS = _params()
GRADS = jax.tree.map(lambda x: jnp.roll(x, 1, axis=0), PARAMS)
NS = eqv.NewtonSchulz(steps=10, dtype=jnp.float32)


def update(tx):
  return jax.tree.map(np.asarray, tx.update(GRADS, tx.init(PARAMS), PARAMS)[0])


def test_none_fields_take_the_presets_rules():
  """``RoleRules()`` under a preset is that preset's rules spelled out, bit for bit."""
  for preset, spelled in stack.PRESETS.items():
    kw = dict(preset=preset, decoder=eqv.Decoder(num_heads=2), newton_schulz=NS, learning_rate=0.1)
    implicit = update(eqv.symmetry_compatible(**kw))
    explicit = update(eqv.symmetry_compatible(**kw, rules=spelled.rules))
    jax.tree.map(np.testing.assert_array_equal, implicit, explicit)
  assert stack.PRESETS["reference"].rules.mlp == "polar"
  assert stack.PRESETS["default"].rules == eqv.RoleRules(*["row_norm"] * 3, "column", "row_norm")


def test_a_given_rule_overrides_the_preset():
  polar = update(eqv.symmetry_compatible(0.1, rules=eqv.RoleRules(mlp="polar"), newton_schulz=NS))
  rows = update(eqv.symmetry_compatible(0.1, newton_schulz=NS))
  gate = polar["layer"]["gate_proj"]["kernel"]
  assert not np.allclose(gate, rows["layer"]["gate_proj"]["kernel"])
  s = np.linalg.svd(gate.astype(np.float64) / 0.1, compute_uv=False)  # polar: orthogonal
  np.testing.assert_allclose(s / s.max(), 1.0, atol=2e-2)


def test_reference_preset_needs_no_learning_rate_and_uses_its_tables():
  tx = eqv.symmetry_compatible(
    preset="reference", decoder=eqv.Decoder(num_heads=2), newton_schulz=NS
  )
  base = update(tx)
  scaled = update(
    eqv.symmetry_compatible(
      preset="reference",
      decoder=eqv.Decoder(num_heads=2),
      newton_schulz=NS,
      learning_rates={r: 2 * v for r, v in stack.REFERENCE_LEARNING_RATES.items()},
    )
  )
  # weight decay is applied after the rate (optax.add_decayed_weights then scale): all of
  # an update doubles with the rate
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, 2 * a, rtol=1e-6), base, scaled)


def test_builder_errors_name_the_argument():
  with pytest.raises(ValueError, match=r"preset must be one of \['default', 'reference'\]"):
    eqv.symmetry_compatible(0.1, preset="paper")  # pyright: ignore[reportArgumentType]
  with pytest.raises(TypeError, match=r"preset='default'\) needs a learning_rate"):
    eqv.symmetry_compatible()
  with pytest.raises(TypeError, match="rules must be a RoleRules"):
    eqv.symmetry_compatible(0.1, rules={"mlp": "polar"})  # pyright: ignore[reportArgumentType]
  with pytest.raises(TypeError, match="decoder must be a saggs_jax.equivariant.Decoder"):
    eqv.symmetry_compatible(0.1, decoder={"num_heads": 2})  # pyright: ignore[reportArgumentType]


def test_presets_and_tables_are_read_only():
  for table in (stack.PRESETS, eqv.REFERENCE, eqv.REFERENCE["scale_by_polar"], eqv.ROLE_PATTERNS):
    with pytest.raises(TypeError):
      table["query"] = ()  # pyright: ignore[reportIndexIssue]


def linen_params():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, ids):
      x = nn.Embed(U, 8, name="embed")(ids)
      part = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
      x = nn.Dense(8, name="q_proj", kernel_init=part)(x)
      return nn.LayerNorm(name="norm")(x)

  return Block().init(jax.random.key(0), jnp.zeros((1, 3), jnp.int32))


def nnx_state():
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(U, 8, rngs=rngs)
      self.q_proj = nnx.Linear(8, 8, rngs=rngs)
      self.norm = nnx.LayerNorm(8, rngs=rngs)

  return nnx.split(Block(nnx.Rngs(0)), nnx.Param)[1]


ROUTED = eqv.layerwise(
  {
    "embed/embedding": eqv.scale_by_row_norm(0, beta=0.0),
    ("q_proj/kernel",): eqv.scale_by_polar(heads=eqv.Heads(num=2), beta=0.0, **EXACT_NS),
  },
  default=optax.sgd(1.0),
)


ROUTED_STEP = jax.jit(lambda g: ROUTED.update(g, ROUTED.init(g))[0])


@pytest.mark.parametrize("make", [linen_params, nnx_state])
def test_layerwise_routes_flax_trees(make):
  grads = jax.tree.map(lambda x: x + 0.1, make())  # nonzero biases
  out = ROUTED_STEP(grads)
  chex.assert_trees_all_equal_structs(out, grads)
  flat = {path_str(k): v for k, v in jax.tree_util.tree_flatten_with_path(out)[0]}
  g = {path_str(k): v for k, v in jax.tree_util.tree_flatten_with_path(grads)[0]}
  emb = next(k for k in flat if k.endswith("embed/embedding"))
  q = next(k for k in flat if k.endswith("q_proj/kernel"))
  bias = next(k for k in flat if k.endswith("q_proj/bias"))
  close(flat[emb], row_norm(np.asarray(g[emb], np.float64)))
  wq = np.asarray(g[q], np.float64)
  close(flat[q], np.concatenate([polar(wq[:, :4]), polar(wq[:, 4:])], axis=1), rtol=1e-3)
  close(flat[bias], -np.asarray(g[bias]))  # default: sgd(1.0)


def test_layerwise_errors_name_the_path():
  params = {"params": {"q_proj": {"kernel": np.zeros((4, 4)), "bias": np.zeros(4)}}}
  double = eqv.layerwise({"q_proj/kernel": optax.sgd(1.0), "q_proj/*": optax.sgd(1.0)})
  with pytest.raises(ValueError, match="'params/q_proj/kernel' is matched by several"):
    double.init(params)
  wrong_rank = eqv.layerwise({"q_proj/*": eqv.scale_by_polar()})
  with pytest.raises(ValueError, match="params/q_proj/bias"):
    wrong_rank.init(params)
  no_default = eqv.layerwise([("q_proj/kernel", optax.sgd(1.0))])
  with pytest.raises(ValueError, match="params/q_proj/bias"):
    no_default.init(params)


def test_optimizer_decoupled_weight_decay_and_schedule():
  lr = optax.linear_schedule(0.1, 0.05, transition_steps=1)
  tx = eqv.optimizer(eqv.scale_by_row_norm(0, beta=0.0), lr, weight_decay=0.5)
  w = rand(21, (U, F), np.float32)
  g = rand(22, (U, F), np.float32)
  state = tx.init(w)
  for step_lr in (0.1, 0.05):
    u, state = tx.update(g, state, w)
    close(optax.apply_updates(w, u), w * (1 - step_lr * 0.5) - step_lr * row_norm(g))


def unit_rule(kind, x, centred=False):
  """A unit rule on (units, features) in numpy: row-norm, hybrid (row then
  polar, scaled by the nuclear norm; centred: re-centred before the polar
  step too) or left spectral."""
  p = center if centred else (lambda y: y)
  if kind == "row_norm":
    return p(row_norm(p(x)))
  if kind == "hybrid":
    r = p(row_norm(p(x)))
    return p(nuclear(r) * polar(r))
  assert kind == "left_spectral", kind
  return p(left_spectral(p(x)))


def expected_llama_directions(
  g, embedding="row_norm", lm_head="row_norm", mlp="row_norm", down="column", router="row_norm"
):
  """Lau and Su's stack by hand (beta=0): each role's direction, by path."""
  L = g["layers"]
  gu = np.concatenate([L["mlp"]["gate_proj"]["kernel"].T, L["mlp"]["up_proj"]["kernel"].T], axis=1)
  neurons = unit_rule(mlp, gu)
  per_head = lambda w, n, axis: np.concatenate(  # noqa: E731
    [polar(b) for b in np.split(w, n, axis=axis)], axis=axis
  )
  w_down = L["mlp"]["down_proj"]["kernel"]
  return {
    "embed/embedding": unit_rule(embedding, g["embed"]["embedding"]),
    "lm_head/kernel": unit_rule(lm_head, g["lm_head"]["kernel"].T, centred=True).T,
    "layers/attn/q_proj/kernel": per_head(L["attn"]["q_proj"]["kernel"], H, 1),
    "layers/attn/k_proj/kernel": per_head(L["attn"]["k_proj"]["kernel"], KV, 1),
    "layers/attn/v_proj/kernel": per_head(L["attn"]["v_proj"]["kernel"], KV, 1),
    "layers/attn/o_proj/kernel": np.sqrt(D / HD) * per_head(L["attn"]["o_proj"]["kernel"], H, 0),
    "layers/mlp/gate_proj/kernel": neurons[:, :D].T,
    "layers/mlp/up_proj/kernel": neurons[:, D:].T,
    "layers/mlp/down_proj/kernel": (
      unit_rule(mlp, w_down) if down == "column" else np.sqrt(D / FF) * polar(w_down)
    ),
    "layers/moe/router/kernel": unit_rule(router, L["moe"]["router"]["kernel"].T, centred=True).T,
    "layers/moe/experts/w_in": np.stack(
      [polar(w) for w in L["moe"]["experts"]["w_in"]]
    ),  # fan_out < fan_in: scale 1
  }


# Distinct rates and decays, one per-role override: each must reach its leaves.
LR, ADAMW_LR, WD, ADAMW_WD, OUTPUT_LR = 0.3, 0.05, 0.1, 0.2, 0.7


ADAMW_PATHS = ("norm/scale", "layers/attn_norm/scale")


@functools.cache
def stack_step(stacked, **variants):
  tx = eqv.symmetry_compatible(
    LR,
    weight_decay=WD,
    learning_rates={"output": OUTPUT_LR, "adamw": ADAMW_LR},
    weight_decays={"adamw": ADAMW_WD},
    decoder=eqv.Decoder(num_heads=H, num_kv_heads=KV, stacked=stacked, **decoder_of(variants)),
    beta=0.0,
    **EXACT_NS,
    **rules_and_rest(variants),
  )
  return jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])


def rules_and_rest(variants):
  """``symmetry_compatible``'s keywords for ``variants``: the role rules as a RoleRules (the
  Decoder's fields are :func:`decoder_of`'s)."""
  rules = {k: v for k, v in variants.items() if k in eqv.RoleRules._fields}
  known = eqv.RoleRules._fields + eqv.Decoder._fields
  rest = {k: v for k, v in variants.items() if k not in known}
  return dict(rules=eqv.RoleRules(**rules), **rest)


def decoder_of(variants):
  return {k: v for k, v in variants.items() if k in eqv.Decoder._fields}


def flat_paths(tree):
  return {
    path_str(k): np.asarray(v, np.float64) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def check_llama_update(out, g, p, **variants):
  """u = -lr (direction + wd p) per role; AdamW's first step on the rest:
  -lr (g / (|g| + eps) + wd p) = -lr (sign(g) + wd p)."""
  directions = expected_llama_directions(jax.tree.map(np.float64, g), **variants)
  out, g, p = flat_paths(out), flat_paths(g), flat_paths(p)
  assert set(directions) | set(ADAMW_PATHS) == set(out)
  for path, direction in directions.items():
    lr = OUTPUT_LR if path == "layers/attn/o_proj/kernel" else LR
    close(out[path], -lr * (direction + WD * p[path]), rtol=1e-3)
  for path in ADAMW_PATHS:
    close(out[path], -ADAMW_LR * (np.sign(g[path]) + ADAMW_WD * p[path]), rtol=1e-5)


def test_symmetry_compatible_stack():
  g, p = llama_grads(100), llama_grads(600)
  out = stack_step(False)(g, p)
  check_llama_update(out, g, p)
  # The stacked-layers layout gives every layer the update of the unstacked one.
  gs, ps = [g, llama_grads(200)], [p, llama_grads(700)]
  stack = lambda trees: {
    **trees[0],
    "layers": jax.tree.map(  # noqa: E731
      lambda *x: np.stack(x), *[t["layers"] for t in trees]
    ),
  }
  stacked = stack_step(True)(stack(gs), stack(ps))
  for i, single in enumerate([out, stack_step(False)(gs[1], ps[1])]):
    chex.assert_trees_all_close(
      jax.tree.map(lambda x, i=i: x[i], stacked["layers"]), single["layers"], rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize(
  "variants",
  [
    dict(
      embedding="hybrid",
      lm_head="hybrid",
      mlp="hybrid",
      down="polar",
      router="left_spectral",
      head_dim=HD,
    ),
    dict(mlp="hybrid"),  # a column-aware hybrid down
  ],
)
def test_symmetry_compatible_variants(variants):
  """Each option builds the rule it names, checked against numpy."""
  g, p = llama_grads(400), llama_grads(800)
  check_llama_update(
    stack_step(False, **variants)(g, p),
    g,
    p,
    **{k: v for k, v in variants.items() if k != "head_dim"},
  )


def test_symmetry_compatible_tied_and_errors():
  tied = eqv.symmetry_compatible(1.0, decoder=eqv.Decoder(tie_embeddings=True), beta=0.0)
  g = {"embed": {"embedding": rand(300, (V, D), np.float32)}}
  out = tied.update(g, tied.init(g), g)[0]["embed"]["embedding"]
  close(-out, center(row_norm(center(g["embed"]["embedding"]))))
  with pytest.raises(ValueError, match=r"Unknown roles \['bogus'\]"):
    eqv.symmetry_compatible(1.0, patterns={"bogus": "x"})
  with pytest.raises(ValueError, match="down must be 'column' or 'polar', got 'rows'"):
    eqv.symmetry_compatible(1.0, rules=eqv.RoleRules(down="rows"))  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize(
  "variants",
  [
    {},
    dict(embedding="hybrid", lm_head="hybrid", mlp="hybrid", down="polar", router="left_spectral"),
  ],
)
def test_stack_defaults_on_zero_gradients(variants):
  """The default Newton-Schulz (bfloat16 Polar Express, 5 steps): zero
  gradients give a zero update, never a NaN, from a fresh state and after
  steps with gradients whose squares underflow float32."""
  decoder = eqv.Decoder(num_heads=H, num_kv_heads=KV)
  tx = eqv.symmetry_compatible(0.1, decoder=decoder, **rules_and_rest(variants))
  zeros = jax.tree.map(np.zeros_like, llama_grads(500))
  tiny = jax.tree.map(lambda x: 1e-30 * x, llama_grads(500))
  step = jax.jit(lambda g, state: tx.update(g, state, zeros))
  out, state = step(zeros, tx.init(zeros))
  assert all(np.all(np.asarray(x) == 0.0) for x in jax.tree.leaves(out))
  for grads in (tiny, zeros):
    out, state = step(grads, state)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(out))


# --- partial routing ---------------------------------------------------------------------------


def test_partial_routing_keeps_the_named_matrices_on_adamw_on_purpose():
  """One role routed, the other matrix kept on AdamW by name: polar on "1", AdamW's first step
  (sign(g)) on "0", both against NumPy; without the "adamw" entry, "0" is named and refused."""
  g = {"0": rand(31, (D, D), np.float32), "1": rand(32, (D, D), np.float32)}
  tx = eqv.symmetry_compatible(
    0.1,
    learning_rates={"adamw": 0.01},
    beta=0.0,
    **EXACT_NS,
    patterns={"query": "1", "adamw": "0"},
  )
  out = tx.update(g, tx.init(g), g)[0]
  close(-np.asarray(out["1"]) / 0.1, polar(np.float64(g["1"])), rtol=1e-4)
  close(-np.asarray(out["0"]) / 0.01, np.sign(g["0"]), rtol=1e-4)
  with pytest.raises(ValueError, match=r"and \['0'\] fall to AdamW\. Pass .*\{'adamw'"):
    eqv.symmetry_compatible(0.1, patterns={"query": "1"}).init(g)
  with pytest.raises(ValueError, match=r"role 'adamw' matches no parameter \(patterns \['2'\]\)"):
    eqv.symmetry_compatible(0.1, patterns={"query": "*", "adamw": "2"}).init(g)


def test_a_matrix_that_matches_no_role_is_named_and_biases_stay_on_adamw():
  """A fused qkv_proj matches no LLaMA pattern: named, not silently on AdamW. Stacked expert
  biases (experts, width), as gpt-oss has, are biases: AdamW, no complaint."""
  attention = {f"{n}_proj": {"kernel": jnp.ones((8, 8))} for n in ("k", "v", "o")}
  params = {
    **PARAMS,
    "layer": {**PARAMS["layer"], **attention, "qkv_proj": {"kernel": jnp.ones((8, 24))}},
  }
  with pytest.raises(ValueError, match=r"the matrices \['layer/qkv_proj/kernel'\] match no role"):
    eqv.symmetry_compatible(0.1, decoder=eqv.Decoder(num_heads=2)).init(params)
  tx = eqv.symmetry_compatible(
    0.1, decoder=eqv.Decoder(num_heads=2), patterns={"adamw": "layer/qkv_proj/kernel"}
  )
  tx.init(params)
  biased = {**PARAMS, "experts": {"gate_up_proj_bias": jnp.ones((4, 16)), "bias": jnp.ones((4, 8))}}
  eqv.symmetry_compatible(0.1, decoder=eqv.Decoder(num_heads=2)).init(biased)


def test_the_stack_inside_nnx_optimizer_through_orbax(tmp_path):
  """init and update inside nnx.Optimizer (optax.multi_transform's state in OptVariables), then
  the state saved with saggs.checkpoint and restored into a fresh optimizer: the next updates
  of both are equal."""
  import orbax.checkpoint as ocp

  import saggs_jax as saggs

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
      self.q_proj = nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs)
      self.norm = nnx.RMSNorm(WIDTH, rngs=rngs)
      self.lm_head = nnx.Linear(WIDTH, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
      h = self.embed(tokens)
      return self.lm_head(self.norm(h + self.q_proj(h)))

  def tx():
    return eqv.symmetry_compatible(
      0.02, learning_rates={"adamw": 1e-2}, decoder=eqv.Decoder(num_heads=2)
    )

  @nnx.jit
  def step(model, optimizer, tokens):
    loss = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(tokens), tokens).mean()  # noqa: E731
    optimizer.update(model, nnx.grad(loss)(model))

  tokens = jnp.arange(16).reshape(2, 8) % VOCAB
  model = Block(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx(), wrt=nnx.Param)
  for _ in range(2):
    step(model, optimizer, tokens)
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    saggs.checkpoint.save(manager, 2, nnx.state(model, nnx.Param), optimizer.opt_state)
    other = Block(nnx.Rngs(1))
    other_optimizer = nnx.Optimizer(other, tx(), wrt=nnx.Param)
    params, opt_state, _ = saggs.checkpoint.restore(
      manager, nnx.state(other, nnx.Param), other_optimizer.opt_state
    )
  nnx.update(other, params)
  other_optimizer.opt_state = opt_state
  for _ in range(2):
    step(model, optimizer, tokens)
    step(other, other_optimizer, tokens)
  chex.assert_trees_all_equal(
    nnx.to_pure_dict(nnx.state(other, nnx.Param)), nnx.to_pure_dict(nnx.state(model, nnx.Param))
  )
