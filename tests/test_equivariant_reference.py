"""The rules under ``eqv.REFERENCE`` against golden vectors of Lau & Su's
reference code (timlautk/equivariant_optimizers at a773b3f): every case of
``tests/data/equivariant_reference.npz`` (see ``tests/data/pack_reference.py``),
three scenarios, three steps each.

The arrays are in torch layout ``(out, in)``; each case is mapped to the rules
through their axis arguments. Per step the update is recovered from the
parameters, ``u_k = (p_{k-1} (1 - lr wd) - p_k) / lr``, and compared with the
library's (``eqv.optimizer`` fed the reference's ``p_{k-1}``):

* ``fp32`` (the reference's bfloat16 casts redirected to float32; our
  Newton-Schulz in float32): relative Frobenius error <= 1e-4, <= 1e-2 for the
  tensors flagged ``right_gram_rank_deficient`` (its damped iterative inverse
  square root amplifies float32 rounding there);
* ``default`` (as shipped, bfloat16 Polar Express; ours in bfloat16, Muon
  cases only): cosine >= 0.99.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from saggs_jax import equivariant as eqv

DATA = np.load(pathlib.Path(__file__).parent / "data" / "equivariant_reference.npz")
CASES = json.loads(str(DATA["__info__"]))["cases"]
SCENARIOS = ("zero", "init_wd", "init_wd_lr05")


def meta(case):
  return json.loads(str(DATA[f"{case}/meta"]))


# BatchedExpertMuonPolarExpress layouts of an (E, a, b) tensor: (output, reduction, heads).
EXPERT_MUON = {
  "row": (1, 2, {}),  # factor sqrt(max(1, a/b))
  "col": (2, 1, {}),  # factor sqrt(max(1, b/a))
  "gpt_oss_gate_up_pair": (1, 2, dict(heads=eqv.Heads(num=2, axis=2, interleaved=True))),
  "olmoe_gate_up_pair": (1, 2, dict(heads=eqv.Heads(num=2, axis=1))),
}
# Unit layouts of RowNormM / HybridPolarGradM (2-D orientation, 3-D expert layout).
UNITS_2D = {"row": dict(unit_axis=0), "col": dict(unit_axis=1)}
UNITS_3D = {
  "row": dict(unit_axis=eqv.UnitDimensionNumbers(1, batch_axis=0)),
  "col": dict(unit_axis=eqv.UnitDimensionNumbers(2, batch_axis=0)),
  "gpt_oss_gate_up_pair": dict(
    unit_axis=eqv.UnitDimensionNumbers(2, batch_axis=0, fused=2, interleaved=True)
  ),
  "olmoe_gate_up_pair": dict(unit_axis=eqv.UnitDimensionNumbers(1, batch_axis=0, fused=2)),
}


def rule(opt, name, ns_dtype, settings=eqv.REFERENCE, shared_nuclear_norm=True):
  """The library rule that computes what reference class ``opt`` computes on
  tensor ``name`` (with ``settings`` per rule; ``shared_nuclear_norm``: one
  factor for the experts of a tensor)."""
  cls, kw = opt["class"], opt["kwargs"]
  if cls == "MuonHeadsPolarExpress":
    # The shape factor is sqrt(max(1, out/in)) of each block: out is the output axis.
    cfg = (kw["head_configs"] or {}).get(name)
    axes = (1, 0, ())
    heads = (
      {}
      if cfg is None
      else dict(heads=eqv.Heads(num=cfg["num_heads"], axis=0 if cfg["layout"] == "qkv" else 1))
    )
  if cls == "BatchedExpertMuonPolarExpress":
    out, red, heads = EXPERT_MUON[kw["expert_layout"]]
    axes = (red, out, 0)
  if "Muon" in cls:
    return eqv.scale_by_polar(
      *axes,
      beta=kw["momentum"],
      nesterov=kw["nesterov"],
      **heads,
      **with_ns_dtype(settings["scale_by_polar"], ns_dtype),
    )
  if cls in ("RightPolarGradM", "LeftPolarGradM"):
    make = eqv.scale_by_right_spectral if cls == "RightPolarGradM" else eqv.scale_by_left_spectral
    return make(
      0, center=kw["center_rows"], beta=kw["beta"], alpha=kw["alpha"], **settings[make.__name__]
    )
  expert = cls.startswith("BatchedExpert")
  units = UNITS_3D[kw["expert_layout"]] if expert else UNITS_2D[kw["orientation"]]
  common = dict(center=kw.get("center_rows", False), beta=kw["beta"], **units)
  if cls.endswith("RowNormM"):
    return eqv.scale_by_row_norm(**common, **settings["scale_by_row_norm"])
  return eqv.scale_by_hybrid(
    **common,
    order=kw["order"],
    alpha=kw["alpha"],
    nuclear_norm_axes=0 if expert and shared_nuclear_norm else (),
    **with_polar(settings["scale_by_hybrid"], ns_dtype, "left" if kw["left"] else "right"),
  )


def with_ns_dtype(settings, dtype):
  """``settings`` with the Newton-Schulz iterations in ``dtype``."""
  return {
    **settings,
    "newton_schulz": settings.get("newton_schulz", eqv.NewtonSchulz())._replace(dtype=dtype),
  }


def with_polar(settings, dtype, gram):
  """The hybrid's ``settings`` with its polar factor's Newton-Schulz iterations in ``dtype``,
  or its inverse square root of Gram matrix ``gram``."""
  polar = settings.get("polar", eqv.NewtonSchulz())
  if isinstance(polar, eqv.InverseSqrt):
    return {**settings, "polar": polar._replace(gram=gram)}
  return {**settings, "polar": polar._replace(dtype=dtype)}


def optimizer(case, ns_dtype, **kw):
  """The case's optimizers with the scenario's lr and weight decay as state."""
  groups = [
    (tuple(o["tensors"]), rule(o, o["tensors"][0], ns_dtype, **kw))
    for o in meta(case)["optimizers"]
  ]
  make = lambda learning_rate, weight_decay: eqv.layerwise(  # noqa: E731
    [(names, eqv.optimizer(r, learning_rate, weight_decay)) for names, r in groups]
  )
  return optax.inject_hyperparams(make)(learning_rate=1.0, weight_decay=0.0)


def runs(case, mode, scenarios=SCENARIOS, ns_dtype=None, **kw):
  """Yields (scenario, tensor, step, library update, reference update); ``kw``
  go to :func:`rule`."""
  m = meta(case)
  names = [t["name"] for t in m["tensors"]]
  tx = optimizer(case, ns_dtype or (jnp.float32 if mode == "fp32" else jnp.bfloat16), **kw)
  step = jax.jit(tx.update)
  grads = {n: DATA[f"{case}/{n}/grads"] for n in names}
  for s in scenarios:
    lr, wd = m["scenarios"][s]["lr"], m["scenarios"][s]["weight_decay"]
    start = {
      n: (np.zeros_like(grads[n][0]) if s == "zero" else DATA[f"{case}/{n}/init"]) for n in names
    }
    ref = {
      n: np.concatenate([start[n][None], DATA[f"{case}/{s}/{mode}/{n}/params"]]) for n in names
    }
    state = tx.init(start)
    state.hyperparams.update(learning_rate=jnp.asarray(lr), weight_decay=jnp.asarray(wd))
    for k in range(3):
      p = {n: ref[n][k] for n in names}
      updates, state = step({n: grads[n][k] for n in names}, state, p)
      for n in names:
        prev = ref[n][k].astype(np.float64)
        ours = -np.asarray(updates[n], np.float64) / lr - wd * prev
        theirs = (prev * (1 - lr * wd) - ref[n][k + 1]) / lr
        yield s, n, k + 1, ours, theirs


def deficient(case):
  return {t["name"] for t in meta(case)["tensors"] if t.get("right_gram_rank_deficient")}


@pytest.mark.parametrize("case", CASES)
def test_fp32_matches_reference(case):
  worst = {}
  for s, n, k, ours, theirs in runs(case, "fp32"):
    rel = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
    worst[n] = max(worst.get(n, 0.0), rel)
    assert rel <= (1e-2 if n in deficient(case) else 1e-4), (s, n, k, rel)
  print(case, {n: f"{r:.1e}" for n, r in worst.items()})


MUON_CASES = [
  c for c in CASES if f"{c}/zero/default/{meta(c)['tensors'][0]['name']}/params" in DATA
]


def test_default_mode_is_stored_for_muon_cases_only():
  assert MUON_CASES == [c for c in CASES if c.startswith("muon_")], MUON_CASES


@pytest.mark.parametrize("case", MUON_CASES)
def test_default_bfloat16_matches_reference(case):
  worst = 1.0
  for s, n, k, ours, theirs in runs(case, "default"):
    cos = np.sum(ours * theirs) / (np.linalg.norm(ours) * np.linalg.norm(theirs))
    worst = min(worst, cos)
    assert cos >= 0.99, (s, n, k, cos)
  print(case, f"min cosine {worst:.4f}")


# ------------------------------------------------------------ the stack preset

from equivariant_oracles import KV, H, center, llama_grads, polar, row_norm  # noqa: E402

# Path -> role as the reference scripts route a LLaMA-style decoder with MoE.
ROLE_OF = {
  "embed/embedding": "embedding",
  "lm_head/kernel": "lm_head",
  "norm/scale": "adamw",
  "layers/attn/q_proj/kernel": "query",
  "layers/attn/k_proj/kernel": "key_value",
  "layers/attn/v_proj/kernel": "key_value",
  "layers/attn/o_proj/kernel": "output",
  "layers/mlp/gate_proj/kernel": "gate_up",
  "layers/mlp/up_proj/kernel": "gate_up",
  "layers/mlp/down_proj/kernel": "down",
  "layers/moe/router/kernel": "router",
  "layers/moe/experts/w_in": "experts",
  "layers/attn_norm/scale": "adamw",
}
# train_qwen3.py's defaults (lr_muon, lr_embed, lr_lm_head, lr for AdamW,
# wd_muon, weight_decay) and train_olmoe.py's lr_router.
SCRIPT_RATES = {
  "query": 2e-2,
  "key_value": 2e-2,
  "output": 2e-2,
  "gate_up": 2e-2,
  "down": 2e-2,
  "experts": 2e-2,
  "embedding": 0.5,
  "lm_head": 5e-3,
  "router": 7.5e-4,
  "adamw": 5e-2,
}
SCRIPT_DECAYS = {
  **dict.fromkeys(SCRIPT_RATES, 1e-3),
  "embedding": 0.0,
  "lm_head": 0.0,
  "router": 0.0,
}


def flat(tree):
  return {
    jax.tree_util.keystr(k, simple=True, separator="/"): np.asarray(v, np.float64)
    for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def stack_update(grads, params, tie_embeddings=False, **kw):
  tx = eqv.symmetry_compatible(
    preset="reference",
    decoder=eqv.Decoder(num_heads=H, num_kv_heads=KV, tie_embeddings=tie_embeddings),
    newton_schulz=eqv.NewtonSchulz("polar_express", steps=10, dtype=jnp.float32),
    **kw,
  )  # polar ~ exact
  return flat(jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, params))


def check_rules(g, out):
  """The scripts' rule per role (one step, lr 1): dense SwiGLU gate, up and
  down each polar (Flax (in, out): factor sqrt(max(1, out/in))), experts
  polar with factor sqrt(max(1, in/out)), row-norm embedding, centred
  row-norm LM head and router."""
  width = lambda w: np.sqrt(max(1.0, w.shape[1] / w.shape[0]))  # noqa: E731
  for name in ("gate_proj", "up_proj", "down_proj"):
    w = g[f"layers/mlp/{name}/kernel"]
    np.testing.assert_allclose(out[f"layers/mlp/{name}/kernel"], -width(w) * polar(w), atol=2e-3)
  experts = g["layers/moe/experts/w_in"]
  np.testing.assert_allclose(
    out["layers/moe/experts/w_in"], -np.stack([width(w.T) * polar(w) for w in experts]), atol=2e-3
  )
  np.testing.assert_allclose(out["embed/embedding"], -row_norm(g["embed/embedding"]), atol=1e-5)
  for path in ("lm_head/kernel", "layers/moe/router/kernel"):
    np.testing.assert_allclose(out[path], -center(row_norm(center(g[path].T))).T, atol=1e-5)


def test_reference_preset_routes_every_role_to_its_rate():
  """Distinct rates per role: each parameter's update, against the same step
  at rate 1, is scaled by its own role's rate (params zero: no weight decay)."""
  g = llama_grads(600)
  zeros = jax.tree.map(np.zeros_like, g)
  distinct = {r: 2.0**-i for i, r in enumerate(SCRIPT_RATES)}
  ones = stack_update(g, zeros, learning_rates=dict.fromkeys(SCRIPT_RATES, 1.0))
  check_rules(flat(g), ones)
  for rates, expected in ((distinct, distinct), ({}, SCRIPT_RATES)):
    out = stack_update(g, zeros, learning_rates=rates)
    assert set(out) == set(ROLE_OF)
    for path, role in ROLE_OF.items():
      np.testing.assert_allclose(
        out[path], expected[role] * ones[path], rtol=1e-5, atol=1e-9, err_msg=path
      )


def test_reference_preset_tied_embedding_is_routed_as_the_lm_head():
  """With tie_embeddings the embedding (V, d) is the LM head: centred row-norm over the
  vocabulary rows, at the LM head's rate (the scripts' 5e-3, or an lm_head override), not
  the embedding's 0.5; an explicit embedding rate still wins."""
  g = {"embed": llama_grads(800)["embed"]}
  zeros = jax.tree.map(np.zeros_like, g)
  direction = center(row_norm(center(flat(g)["embed/embedding"])))
  for rates, rate in (
    ({}, SCRIPT_RATES["lm_head"]),
    ({"lm_head": 0.25}, 0.25),
    ({"lm_head": 0.25, "embedding": 0.125}, 0.125),
  ):
    out = stack_update(g, zeros, tie_embeddings=True, learning_rates=rates)
    np.testing.assert_allclose(out["embed/embedding"], -rate * direction, rtol=1e-5, atol=1e-9)


def test_reference_preset_weight_decay_per_role():
  """Zero gradients: the update is -lr * wd * p with the scripts' lr and wd per role."""
  params = llama_grads(700)
  out = stack_update(jax.tree.map(np.zeros_like, params), params)
  p = flat(params)
  for path, role in ROLE_OF.items():
    np.testing.assert_allclose(
      out[path],
      -SCRIPT_RATES[role] * SCRIPT_DECAYS[role] * p[path],
      rtol=1e-5,
      atol=1e-12,
      err_msg=path,
    )


def test_polar_summed_momentum_state():
  """``ema=False`` keeps torch's SGD buffer ``b <- beta b + g``; the golden
  vectors cannot tell it from the EMA (the polar factor ignores the scale)."""
  tx = eqv.scale_by_polar(beta=0.9, ema=False, newton_schulz=eqv.NewtonSchulz(dtype=jnp.float32))
  g1, g2 = (np.random.default_rng(k).normal(size=(4, 6)).astype(np.float32) for k in (1, 2))
  _, state = tx.update(g1, tx.init(g1))
  _, state = tx.update(g2, state)
  np.testing.assert_allclose(state.mu, 0.9 * g1 + g2, rtol=1e-6)


# ------------------------------------------------ Muon's normaliser near its eps

# The Polar Express coefficients Lau & Su's Muon ships (the Polar Express authors' set
# for Muon), as published; they assume the normaliser 1.02 ||X||_F + 1e-6.
MUON_POLAR_EXPRESS = (
  (8.156554524902461, -22.48329292557795, 15.878769915207462),
  (4.042929935166739, -2.808917465908714, 0.5000178451051316),
  (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
  (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
  (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def muon_polar_express(x):
  """The reference's five Newton-Schulz steps in float64: X / (1.02 ||X||_F + 1e-6), then
  X <- a X + (b A + c A^2) X with A = X X^T."""
  x = np.asarray(x, np.float64)
  x = x / (1.02 * np.linalg.norm(x) + 1e-6)
  for a, b, c in MUON_POLAR_EXPRESS:
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x


@pytest.mark.parametrize("norm", [1e-6, 3e-6])
def test_reference_polar_normaliser_adds_its_eps(norm):
  """The golden gradients' norms are far above 1e-6, where adding eps or flooring the
  norm at eps agree; a momentum of norm ~1e-6 tells them apart (Muon's summed momentum
  with Nesterov: the first step orthogonalises (1 + beta) G)."""
  g = np.random.default_rng(21).standard_normal((4, 6))
  g *= norm / (1.95 * np.linalg.norm(g))
  tx = eqv.scale_by_polar(beta=0.95, **with_ns_dtype(eqv.REFERENCE["scale_by_polar"], jnp.float32))
  out, _ = tx.update(jnp.asarray(g, jnp.float32), tx.init(jnp.zeros((4, 6), jnp.float32)))
  expected = np.sqrt(6 / 4) * muon_polar_express(1.95 * g)
  np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
