"""Function invariance and balance on real model layouts.

* flax.linen ``MultiHeadDotProductAttention`` and flax.nnx ``MultiHeadAttention``
  with ``presets.flax_mha()`` (biases included), also inside
  ``train_state.TrainState`` and ``nnx.Optimizer``;
* a LLaMA-style model (GQA H=4 on KVH=2, RoPE, SwiGLU) written as a pure
  function of a params dict, per layer and scanned (``stacked=1``);
* ``check_symmetry`` on all of them, and its failures on QK-norm and GELU.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import models
import saggs_jax as saggs
from models import assert_balanced, assert_imbalanced, assert_same_function, leaf_dict, norms

C = models.CONFIG
MHA = tuple(saggs.presets.flax_mha())
LLAMA = tuple(models.llama_pairs())
LLAMA_STACKED = tuple(models.llama_pairs(models.STACKED))


def mha_head_norms(attn):
  """Per-head (||A_h||, ||B_h||) of Q/K and V/O kernels, computed with NumPy (followers excluded)."""
  k = {n: attn[n]["kernel"] for n in ("query", "key", "value", "out")}
  return {
    "qk": (norms(k["query"], (0, 2)), norms(k["key"], (0, 2))),
    "vo": (norms(k["value"], (0, 2)), norms(k["out"], (1, 2))),
  }


def _nnx_out(model, x):
  """``model(x)`` through the shared compiled forward pass (eagerly, every op compiles)."""
  return models.nnx_apply(nnx.state(model, nnx.Param), x)


def _zeros(p):
  return jax.tree.map(jnp.zeros_like, p)


# --- flax.linen MultiHeadDotProductAttention ---------------------------------------


def test_linen_mha_invariance_and_balance():
  x = models.mha_input()
  params = models.linen_init(seed=1)
  deviations = saggs.check_symmetry(models.linen_forward, params, MHA, x)
  assert len(deviations) == 2 and max(deviations.values()) < 1e-5

  moved = models.perturb(params, MHA, seed=1)
  assert_imbalanced(mha_head_norms(moved["params"]["attn"]))
  assert_same_function(models.linen_apply, params, moved, x)
  assert not np.allclose(
    moved["params"]["attn"]["query"]["bias"], params["params"]["attn"]["query"]["bias"]
  )

  hard = saggs.chain(optax.sgd(0.0), saggs.saggs(MHA))
  new, _, _ = models.step(hard, moved, hard.init(moved), _zeros(moved))
  assert_balanced(mha_head_norms(new["params"]["attn"]))
  assert_same_function(models.linen_apply, params, new, x)

  soft = saggs.chain(optax.sgd(0.0), saggs.soft(MHA, strength=0.5))
  new, _, _ = models.step(soft, moved, soft.init(moved), _zeros(moved))
  assert_same_function(models.linen_apply, params, new, x)
  before, after = saggs.imbalance(moved, MHA), saggs.imbalance(new, MHA)
  for k in before:
    np.testing.assert_allclose(after[k], 0.5 * before[k], atol=1e-5)


def test_linen_train_state_apply_gradients():
  x = models.mha_input()
  params = models.perturb(models.linen_init(seed=2), MHA, seed=2)["params"]
  apply = lambda variables, x: models.linen_model.apply(variables, x)
  state = train_state.TrainState.create(
    apply_fn=apply, params=params, tx=saggs.chain(optax.adam(0.0), saggs.saggs(MHA))
  )

  def loss(p):
    return jnp.mean(models.linen_model.apply({"params": p}, x) ** 2)

  @jax.jit
  def train_step(state):
    grads = jax.grad(loss)(state.params)
    return state.apply_gradients(grads=grads), grads

  new_state, grads = train_step(state)
  assert int(new_state.step) == 1
  assert_balanced(mha_head_norms(new_state.params["attn"]))
  assert_same_function(
    lambda p, x: models.linen_apply({"params": p}, x), params, new_state.params, x
  )
  # Adam's first moments are (1 - b1) g and (1 - b2) g**2 before balancing;
  # after it, mu * theta and nu * theta**2 are what they were.
  adam_state, saggs_state = new_state.opt_state
  mu, nu = leaf_dict(adam_state[0].mu), leaf_dict(adam_state[0].nu)
  g, p0, p1 = leaf_dict(grads), leaf_dict(params), leaf_dict(new_state.params)
  for path in g:
    np.testing.assert_allclose(
      mu[path] * p1[path], 0.1 * g[path] * p0[path], rtol=1e-5, atol=1e-7, err_msg=path
    )
    np.testing.assert_allclose(
      nu[path] * p1[path] ** 2,
      0.001 * g[path] ** 2 * p0[path] ** 2,
      rtol=1e-5,
      atol=1e-9,
      err_msg=path,
    )
  assert np.any(np.abs(np.log(saggs_state.factors["attn/query/kernel|attn/key/kernel"])) > 0.1)


# --- flax.nnx MultiHeadAttention ----------------------------------------------------


def test_nnx_mha_check_symmetry_and_reparameterize():
  x = models.mha_input()
  model = models.nnx_model(seed=3)
  state = nnx.state(model, nnx.Param)
  deviations = saggs.check_symmetry(models.nnx_forward, state, MHA, x)
  assert len(deviations) == 2 and max(deviations.values()) < 1e-5
  moved = models.perturb(state, MHA, seed=3)
  assert isinstance(moved, nnx.State)
  assert_imbalanced(mha_head_norms(nnx.to_pure_dict(moved)["attn"]))
  assert_same_function(models.nnx_apply, state, moved, x)


def test_nnx_optimizer_update_under_nnx_jit():
  x = models.mha_input()
  model = models.nnx_model(seed=4)
  pure0 = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  moved = models.perturb(nnx.state(model, nnx.Param), MHA, seed=4)
  nnx.update(model, moved)
  y0 = _nnx_out(model, x)
  p0 = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert_imbalanced(mha_head_norms(p0["attn"]))

  optimizer = nnx.Optimizer(
    model, saggs.chain(optax.adamw(0.0, weight_decay=0.1), saggs.saggs(MHA)), wrt=nnx.Param
  )

  @nnx.jit
  def train_step(model, optimizer, x):
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return grads

  grads = nnx.to_pure_dict(train_step(model, optimizer, x))
  p1 = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert_balanced(mha_head_norms(p1["attn"]))
  models.assert_same_output(_nnx_out(model, x), y0)
  del pure0
  # The optimizer state inside nnx.Optimizer was transported as well.
  adam_state, saggs_state = nnx.as_pure(optimizer.opt_state)
  assert int(saggs_state.step) == 1
  mu = leaf_dict(adam_state[0].mu)
  g, a, b = leaf_dict(grads), leaf_dict(p0), leaf_dict(p1)
  for path in g:
    np.testing.assert_allclose(
      mu[path] * b[path], 0.1 * g[path] * a[path], rtol=1e-5, atol=1e-7, err_msg=path
    )
  np.testing.assert_array_equal(mu["head/kernel"], 0.1 * g["head/kernel"])
  np.testing.assert_array_equal(b["attn/out/bias"], a["attn/out/bias"])
  # A second step reuses the compiled function and keeps the model balanced.
  train_step(model, optimizer, x)
  assert_balanced(mha_head_norms(nnx.to_pure_dict(nnx.state(model, nnx.Param))["attn"]))
  assert int(nnx.as_pure(optimizer.opt_state)[1].step) == 2


def test_nnx_optimizer_every_2_balances_on_updates_1_and_3():
  x = models.mha_input()
  model = models.nnx_model(seed=5)
  y0 = _nnx_out(model, x)
  tx = saggs.chain(optax.adamw(0.0, weight_decay=0.1), saggs.saggs(MHA, every=2))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x):
    optimizer.update(model, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))

  attn = lambda: nnx.to_pure_dict(nnx.state(model, nnx.Param))["attn"]  # noqa: E731
  for n, balances in ((1, True), (2, False), (3, True)):
    nnx.update(model, models.perturb(nnx.state(model, nnx.Param), MHA, seed=5 + n))
    train_step(model, optimizer, x)  # lr 0: only the balancing moves the weights
    if balances:
      assert_balanced(mha_head_norms(attn()))
    else:
      assert_imbalanced(mha_head_norms(attn()))
  models.assert_same_output(_nnx_out(model, x), y0)


# --- LLaMA-style: GQA, RoPE, SwiGLU ---------------------------------------------------


def llama_group_norms(layer):
  """Per-group norms of one layer (unstacked) with NumPy."""
  k = {n: np.asarray(v["kernel"]) for n, v in (*layer["attn"].items(), *layer["mlp"].items())}
  g, d = C.num_kv_heads, C.d_model
  per_head = lambda name: k[name].reshape(d, g, -1)  # (in, KV heads, rest of the block)
  return {
    "qk": (norms(per_head("q_proj"), (0, 2)), norms(per_head("k_proj"), (0, 2))),
    "vo": (norms(per_head("v_proj"), (0, 2)), norms(k["o_proj"].reshape(g, -1, d), (1, 2))),
    "ud": (norms(k["up_proj"], 0), norms(k["down_proj"], 1)),
  }


def test_llama_check_symmetry_passes():
  toks = models.tokens()
  dev = saggs.check_symmetry(models.llama_forward, models.llama_init(0), LLAMA, toks)
  assert len(dev) == 3 * C.num_layers and max(dev.values()) < 1e-5
  dev = saggs.check_symmetry(
    functools.partial(models.llama_forward, c=models.STACKED),
    models.llama_init(0, models.STACKED),
    LLAMA_STACKED,
    toks,
  )
  assert len(dev) == 3 and max(dev.values()) < 1e-5


@functools.partial(jax.jit, static_argnums=0)
def _llama_experiment(stacked, params, factors, grads):
  """Perturb, then one hard and one soft (strength 0.3) step with Adam at lr 0, in one program."""
  pairs = LLAMA_STACKED if stacked else LLAMA
  moved = models.reparam(params, None, pairs, factors)[0]
  out = {"moved": moved, "imb_moved": saggs.imbalance(moved, pairs)}
  for name, strength in (("hard", 1.0), ("soft", 0.3)):
    tx = saggs.chain(optax.adam(0.0), saggs.scale_by_saggs(pairs, strength=strength))
    new, _, state = models.step(tx, moved, tx.init(moved), grads)
    out[name] = {"params": new, "state": state, "imb": saggs.imbalance(new, pairs)}
  return out


def _with_outputs(out, params, toks, stacked):
  """Model outputs, from the one shared compiled forward pass."""
  apply = functools.partial(models.llama_apply, tokens=toks, c=models.STACKED if stacked else C)
  out["y"] = apply(params)
  out["y_moved"] = apply(out["moved"])
  for name in ("hard", "soft"):
    out[name]["y"] = apply(out[name]["params"])
  return out


def _layers_of(params, stacked):
  if stacked:
    return [jax.tree.map(lambda x, i=i: x[i], params["layers"]) for i in range(C.num_layers)]
  return [params["layers"][str(i)] for i in range(C.num_layers)]


def test_llama_hard_and_soft_keep_the_function_per_layer_and_scanned():
  """GQA + RoPE + SwiGLU, per-layer dict and scanned (stacked=1) layout of the same weights.

  Both layouts compute the same function; every step keeps it; hard equalises
  the group norms, soft shrinks the log-imbalance by 1 - strength; stacked
  factors have shape (layers, groups) and equal the per-layer factors; Adam's
  moments are transported identically in both layouts.
  """
  toks = models.tokens()
  params = models.llama_init(5)
  grads = jax.tree.map(lambda x: 0.1 * x, models.llama_init(6))
  factors = models.orbit_factors(params, LLAMA, seed=5)
  stacked_factors = {}
  for path, f in factors.items():  # layers/<i>/<rest> -> layers/<rest>, stacked over i
    i, rest = path.split("/", 2)[1:]
    stacked_factors.setdefault(f"layers/{rest}", [None] * C.num_layers)[int(i)] = f
  stacked_factors = {k: np.stack(v) for k, v in stacked_factors.items()}

  stacked_params = models.stack_layers(params)
  runs = {
    False: _with_outputs(_llama_experiment(False, params, factors, grads), params, toks, False),
    True: _with_outputs(
      _llama_experiment(True, stacked_params, stacked_factors, models.stack_layers(grads)),
      stacked_params,
      toks,
      True,
    ),
  }
  for stacked, out in runs.items():
    models.assert_same_output(out["y_moved"], out["y"])
    for layer in _layers_of(out["moved"], stacked):
      assert_imbalanced(llama_group_norms(layer))
    for name, strength in (("hard", 1.0), ("soft", 0.3)):
      models.assert_same_output(out[name]["y"], out["y"])
      for k, v in out[name]["imb"].items():
        np.testing.assert_allclose(v, (1 - strength) * out["imb_moved"][k], atol=1e-5, err_msg=k)
    for layer in _layers_of(out["hard"]["params"], stacked):
      assert_balanced(llama_group_norms(layer))
    expect = {"q_proj": C.num_kv_heads, "v_proj": C.num_kv_heads, "up_proj": C.mlp_hidden}
    for key, f in out["hard"]["state"][1].factors.items():
      n = next(v for k, v in expect.items() if k in key)
      assert f.shape == ((C.num_layers, n) if stacked else (n,)), key

  # The scanned run is the per-layer run, stacked.
  flat, scan = runs[False], runs[True]
  np.testing.assert_allclose(scan["y"], flat["y"], rtol=1e-5, atol=1e-6)
  for name in ("hard", "soft"):
    chex.assert_trees_all_close(
      scan[name]["params"], models.stack_layers(flat[name]["params"]), rtol=1e-5, atol=1e-6
    )
    for field in ("mu", "nu"):
      chex.assert_trees_all_close(
        getattr(scan[name]["state"][0][0], field),
        models.stack_layers(getattr(flat[name]["state"][0][0], field)),
        rtol=1e-5,
        atol=1e-9,
      )
    for key, f in scan[name]["state"][1].factors.items():
      a, b = key.split("|")
      per_layer = [
        flat[name]["state"][1].factors[
          a.replace("layers/", f"layers/{i}/") + "|" + b.replace("layers/", f"layers/{i}/")
        ]
        for i in range(C.num_layers)
      ]
      np.testing.assert_allclose(f, np.stack(per_layer), rtol=1e-5)


# --- check_symmetry catches non-symmetries --------------------------------------------


def test_check_symmetry_rejects_qk_norm():
  """With QK-norm over the whole projection, per-KV-head Q/K rescaling is not a symmetry."""
  config = models.Config(qk_norm=True)
  params, forward = models.llama_init(7, config), functools.partial(models.llama_forward, c=config)
  with pytest.raises(ValueError, match="attention Q/K is not a symmetry") as info:
    saggs.check_symmetry(forward, params, LLAMA, models.tokens())
  assert "layers/0/attn/q_proj/kernel" in str(info.value)
  # Without the Q/K pair the rest of the preset is still exact in that model.
  dev = saggs.check_symmetry(forward, params, LLAMA[1:], models.tokens())
  assert max(dev.values()) < 1e-5


def test_check_symmetry_rejects_gelu_mlp():
  params = models.gelu_mlp_init(8)
  pair = saggs.Pair("mlp/up/kernel", "mlp/down/kernel", axes=(1, 0), name="GELU up/down")
  x = jnp.asarray(np.random.default_rng(8).standard_normal((3, C.d_model)), jnp.float32)
  with pytest.raises(ValueError, match="GELU up/down is not a symmetry.*'mlp/up/kernel'"):
    saggs.check_symmetry(models.gelu_mlp_forward, params, [pair], x)
  # A factor of exactly 1 is trivially exact: the failure is the activation, not the check.
  saggs.check_symmetry(models.gelu_mlp_forward, params, [pair], x, low=1.0, high=1.0)
