"""``saggs.discover`` on real layouts: what it finds, what it rejects and why, and that what it
finds is exact, checked by an orbit move written here in NumPy.

Models (``discover_models``, ``models``): the example nnx LLaMA per layer and scanned, Flax
Linen and NNX attention, GPT-2 (GELU), a GeGLU MLP, a LLaMA with QK-norm, a MoE block with stacked ReLU
experts and a router, a tied embedding/LM head, a LayerNorm between two linears.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import discover_models as dm
import models
import saggs_jax as saggs
from saggs_jax.discovery import Discovery, Rejected, discover

QKN = models.Config(qk_norm=True)

MODELS = {  # name -> () -> (forward, params, *inputs)
  "lm": lambda: (*dm.nnx_lm(scanned=False), dm.lm_tokens()),
  "lm_scanned": lambda: (*dm.nnx_lm(scanned=True), dm.lm_tokens()),
  "linen_mha": dm.linen_mha,
  "nnx_mha": dm.nnx_mha,
  "gpt2": lambda: (dm.gpt2_forward, dm.gpt2_init(), dm.tokens()),
  "qk_norm": lambda: (
    functools.partial(models.llama_forward, c=QKN),
    models.llama_init(0, QKN),
    models.tokens(c=QKN),
  ),
  "geglu": lambda: (dm.geglu_forward, dm.geglu_init(), dm.inputs()),
  "moe": lambda: (dm.moe_forward, dm.moe_init(), dm.inputs()),
  "tied": lambda: (dm.tied_forward, dm.tied_init(), dm.tokens()),
  "norm_between": lambda: (dm.norm_between_forward, dm.norm_between_init(), dm.inputs()),
}


@functools.cache
def model(name):
  forward, params, *inputs = MODELS[name]()
  return jax.jit(forward), params, inputs


@functools.cache
def found(name) -> Discovery:
  forward, params, *inputs = MODELS[name]()
  return discover(forward, params, *inputs)


def llama_found(stacked: int, gate="gate_proj", up="up_proj", down="down_proj", **names):
  """The symmetries of a LLaMA layer with 2 KV heads, as declared by hand."""
  return {
    saggs.Pair(
      "q_proj/kernel", "k_proj/kernel", axes=(1, 1), groups=2, stacked=stacked, name="attention Q/K"
    ),
    saggs.Pair(
      "v_proj/kernel", "o_proj/kernel", axes=(1, 0), groups=2, stacked=stacked, name="attention V/O"
    ),
    saggs.Pair(
      f"{up}/kernel", f"{down}/kernel", axes=(1, 0), stacked=stacked, name="gated MLP up/down"
    ),
    saggs.Pair(
      "attn_norm/scale",
      ("attn/q_proj/kernel", "attn/k_proj/kernel", "attn/v_proj/kernel"),
      axes=(0, 0),
      stacked=stacked,
      name="norm gain",
    ),
    saggs.Pair(
      "mlp_norm/scale",
      (f"mlp/{gate}/kernel", f"mlp/{up}/kernel"),
      axes=(0, 0),
      stacked=stacked,
      name="norm gain",
    ),
    saggs.Pair("final_norm/scale", "lm_head/kernel", axes=(0, 0), name="norm gain"),
  }


# ---------------------------------------------------------------------------
# The oracle: an orbit move by hand.


def _side(patterns, axes):
  patterns = (patterns,) if isinstance(patterns, (str, saggs.Block)) else patterns
  axes = (axes,) * len(patterns) if isinstance(axes, int) else axes
  return list(zip(patterns, axes))


def _block_index(block, shape, stacked):
  """The index of ``block`` (a ``saggs.Block``) in a leaf of ``shape``, worked out here."""
  axis = stacked + block.axis % (len(shape) - stacked)
  names = block.parts if isinstance(block.parts, tuple) else range(block.parts)
  sizes = block.sizes or (shape[axis] // len(names),) * len(names)
  part = block.part if isinstance(block.part, int) else block.parts.index(block.part)
  start = sum(sizes[:part])
  return (slice(None),) * axis + (slice(start, start + sizes[part]),)


def orbit_move(params, pairs, seed=0, spread=1.5):
  """``params`` with every instance of ``pairs`` scaled by random per-group factors in
  ``[e^-spread, e^spread]``: side a by c, side b by 1/c, followers with their side. A
  ``saggs.Block`` member scales only its part of the leaf."""
  rng = np.random.default_rng(seed)
  values = {path: np.asarray(x, np.float64) for path, x in models.leaf_dict(params).items()}
  for pair in pairs:
    instances = {}
    for sign, side, followers in (
      (1, _side(pair.a, pair.axes[0]), pair.follow_a),
      (-1, _side(pair.b, pair.axes[1]), pair.follow_b),
    ):
      for k, (pattern, axis) in enumerate(side + [(f, None) for f in followers]):
        block = pattern if isinstance(pattern, saggs.Block) else None
        for path in values:
          caps = saggs._src.paths.match(block.pattern if block else pattern, path)
          if caps is not None:
            index = () if block is None else _block_index(block, values[path].shape, pair.stacked)
            instances.setdefault(caps, []).append((path, index, sign, axis, k))
    for members in instances.values():
      kernel = {sign: (path, index, axis) for path, index, sign, axis, k in members if k == 0}
      path0, index0, axis0 = kernel[1]
      shape0 = values[path0][index0].shape
      groups = pair.groups or shape0[pair.stacked + axis0]
      factors = np.exp(rng.uniform(-spread, spread, shape0[: pair.stacked] + (groups,)))
      for path, index, sign, axis, _ in members:
        x = values[path][index]
        if axis is None and x.ndim == pair.stacked + 1:  # a follower, a bias: along its axis
          axis = pair.stacked
        elif axis is None:  # a follower: its kernel's group axis, counted from the end
          kpath, _, kaxis = kernel[sign]
          axis = pair.stacked + kaxis - (values[kpath].ndim - x.ndim)
        else:
          axis = pair.stacked + axis
        f = np.repeat(factors**sign, x.shape[axis] // groups, axis=-1)
        values[path] = values[path].copy()
        values[path][index] = x * f.reshape(
          f.shape[:-1] + (1,) * (axis - pair.stacked) + (-1,) + (1,) * (x.ndim - axis - 1)
        )
  return jax.tree_util.tree_map_with_path(
    lambda kp, x: jnp.asarray(values[saggs._src.paths.path_str(kp)], x.dtype), params
  )


def deviation(name, pairs, seed=0):
  """Largest output change of model ``name`` under ``orbit_move``, relative to max |output|."""
  forward, params, inputs = model(name)
  with jax.default_matmul_precision("highest"):
    y0 = np.asarray(forward(params, *inputs))
    y1 = np.asarray(forward(orbit_move(params, pairs, seed), *inputs))
  return float(np.max(np.abs(y1 - y0)) / np.max(np.abs(y0)))


def rejected(name):
  return {(r.a, r.b): r.reason for r in found(name).rejected}


# ---------------------------------------------------------------------------
# The models.


@pytest.mark.parametrize("name, stacked", [("lm", 0), ("lm_scanned", 1)])
def test_example_llama(name, stacked):
  d = found(name)
  assert set(d) == llama_found(stacked)
  assert len(d) == 6
  # The attention and MLP pairs are the hand-written preset's, up to their names.
  unnamed = {p.__class__(**{**p.__dict__, "name": None}) for p in d}
  assert {
    p.__class__(**{**p.__dict__, "name": None}) for p in saggs.presets.llama(2, stacked=stacked)
  } <= unnamed
  assert rejected(name) == {
    ("gate_proj/kernel", "down_proj/kernel"): "not positively homogeneous: logistic between them"
  }
  assert deviation(name, d) < 1e-5


@pytest.mark.parametrize("name", ["linen_mha", "nnx_mha"])
def test_flax_attention_is_the_preset(name):
  assert list(found(name)) == saggs.presets.flax_mha()
  assert found(name).rejected == ()
  assert deviation(name, found(name)) < 1e-5


def test_gpt2_finds_attention_and_rejects_the_gelu_mlp():
  d = found("gpt2")
  assert set(d) == {
    saggs.Pair(
      "q/kernel",
      "k/kernel",
      axes=(1, 1),
      follow_a=("q/bias",),
      follow_b=("k/bias",),
      name="attention Q/K",
    ),
    saggs.Pair(
      "attn/v/kernel",
      "attn/proj/kernel",
      axes=(1, 0),
      follow_a=("attn/v/bias",),
      name="attention V/O",
    ),
    saggs.Pair(
      "ln_1/scale",
      ("attn/q/kernel", "attn/k/kernel", "attn/v/kernel"),
      axes=(0, 0),
      follow_a=("ln_1/bias",),
      name="norm gain",
    ),
    saggs.Pair(
      "ln_2/scale", "mlp/fc/kernel", axes=(0, 0), follow_a=("ln_2/bias",), name="norm gain"
    ),
    saggs.Pair(
      "ln_f/scale", "lm_head/kernel", axes=(0, 0), follow_a=("ln_f/bias",), name="norm gain"
    ),
  }
  assert rejected("gpt2") == {
    ("fc/kernel", "proj/kernel"): "not positively homogeneous: integer_pow, tanh between them"
  }
  assert deviation("gpt2", d) < 1e-5
  # The oracle does see a broken symmetry: the GELU MLP's up/down move changes the output.
  gelu = saggs.Pair("mlp/fc/kernel", "mlp/proj/kernel", axes=(1, 0), follow_a=("mlp/fc/bias",))
  assert deviation("gpt2", [gelu]) > 1e-2


def test_geglu_pairs_up_with_down_and_leaves_the_gate_out():
  assert list(found("geglu")) == [
    saggs.Pair("up/kernel", "down/kernel", axes=(1, 0), name="gated MLP up/down")
  ]
  assert rejected("geglu") == {
    ("gate/kernel", "down/kernel"): "not positively homogeneous: erfc between them"
  }
  assert deviation("geglu", found("geglu")) < 1e-5


def test_qk_norm_is_moot_and_its_gains_pair_per_kv_head():
  d = found("qk_norm")
  assert (
    saggs.Pair("q_norm/scale", "k_norm/scale", axes=(0, 0), groups=2, name="attention Q/K") in d
  )
  assert not any("q_proj/kernel" in (p.a, p.b) for p in d)
  reasons = rejected("qk_norm")
  assert reasons[("q_proj/kernel", "k_proj/kernel")].startswith("moot: each side is scale-inv")
  assert deviation("qk_norm", d) < 1e-5


def test_moe_experts_are_stacked_and_the_norm_gain_reaches_router_and_experts():
  d = found("moe")
  assert set(d) == {
    saggs.Pair("norm/scale", ("router/kernel", "experts/w_up"), axes=(0, (0, 1)), name="norm gain"),
    saggs.Pair("w_up", "w_down", axes=(1, 0), stacked=1, name="expert up/down (positive factors)"),
  }
  assert found("moe").rejected == ()
  assert deviation("moe", d) < 1e-5


def test_tied_embedding_is_rejected_with_its_reason():
  d = found("tied")
  assert set(d) == {
    saggs.Pair("mlp_norm/scale", "mlp/up/kernel", axes=(0, 0), name="norm gain"),
    saggs.Pair("up/kernel", "down/kernel", axes=(1, 0), name="ReLU MLP up/down (positive factors)"),
  }
  reason = rejected("tied")[("final_norm/scale", "embed/embedding")]
  assert reason.startswith("weight tying: 'embed/embedding' is also used elsewhere")
  assert deviation("tied", d) < 1e-5
  untied = saggs.Pair("final_norm/scale", "embed/embedding", axes=(0, 1))
  assert deviation("tied", [untied]) > 1e-2


def test_a_norm_between_two_linears_breaks_their_pair():
  d = found("norm_between")
  assert list(d) == [
    saggs.Pair(
      "norm/scale",
      "down/kernel",
      axes=(0, 0),
      follow_a=("norm/bias",),
      name="norm gain (positive factors)",
    )
  ]
  assert rejected("norm_between")[("up/kernel", "down/kernel")].startswith(
    "a normalization between them"
  )
  assert deviation("norm_between", d) < 1e-5
  assert (
    deviation(
      "norm_between", [saggs.Pair("up/kernel", "down/kernel", axes=(1, 0), follow_a=("up/bias",))]
    )
    > 1e-2
  )


def test_a_candidate_the_numbers_refute_is_rejected(monkeypatch):
  # Blind the jaxpr reading to what it passed through: up -> LayerNorm -> down then looks
  # exact, and only the numerical check stands between it and the result.
  dm.blind_to_reasons(monkeypatch)
  forward, params, x = MODELS["norm_between"]()
  d = discover(forward, params, x)
  assert not any(p.a == "up/kernel" for p in d)
  assert {(r.a, r.b): r.reason for r in d.rejected}[("up/kernel", "down/kernel")] == (
    "the jaxpr suggests it, but random factors change the output"
  )


# ---------------------------------------------------------------------------
# The result as a declaration.


def test_repr_rebuilds_the_discovery():
  d = found("qk_norm")
  namespace = {"Discovery": Discovery, "Pair": saggs.Pair, "Rejected": Rejected}
  assert eval(repr(d), namespace) == d  # pylint: disable=eval-used
  assert repr(d).startswith("Discovery(pairs=[\n    Pair(a='final_norm/scale', b='lm_head/kernel',")


def test_report_lists_found_and_rejected():
  assert found("norm_between").report() == "\n".join(
    [
      "Found 1 symmetry:",
      "  norm gain (positive factors): 'norm/scale' (axis 0) x c  against  'down/kernel' (axis 0)"
      " x 1/c; bias 'norm/bias'",
      "Rejected 1:",
      "  'up/kernel' against 'down/kernel': a normalization between them makes what follows side a"
      " invariant to its scale, so nothing compensates a factor on side b",
      "Confirmation: numerically, on the given parameters and example inputs (finite moves and"
      " first order).",
    ]
  )


@functools.partial(jax.jit, static_argnums=0)
def _hard_step(tx, params, state):
  updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), state, params)
  return optax.apply_updates(params, updates), state


@pytest.mark.parametrize("name", ["gpt2", "moe"])
def test_saggs_balances_what_discover_found_without_changing_the_function(name):
  """Overlapping discoveries (norm gains share q/k/v with Q/K and V/O, the MoE gain shares
  w_up with the stacked expert pair) are balanced jointly by hard steps, a few since one
  update moves a factor by at most ``step_limits`` (2**(10/n) in float32, n factors on an
  entry), each keeping the function."""
  forward, params, inputs = model(name)
  d = found(name)
  start = orbit_move(params, d, seed=3)  # far from balanced, same function
  tx = saggs.chain(optax.sgd(0.0), saggs.saggs(d))
  moved, state = start, tx.init(start)
  for _ in range(4):
    moved, state = _hard_step(tx, moved, state)
    models.assert_same_function(forward, start, moved, *inputs)
  worst = {
    name: max(float(jnp.max(jnp.abs(v))) for v in saggs.imbalance(p, d).values())
    for name, p in (("start", start), ("moved", moved))
  }
  assert worst["start"] > 0.5 and worst["moved"] < 1e-4, worst
  saggs.soft(d).stage.init(start)  # soft takes it too


def test_describe_and_check_symmetry_accept_a_discovery():
  forward, params, inputs = model("gpt2")
  d = found("gpt2")
  assert "norm gain" in saggs.describe(params, d)
  assert (
    "Rejected: 'fc/kernel' against 'proj/kernel': not positively homogeneous"
    in saggs.describe(params, d)
  )
  deviations = saggs.check_symmetry(forward, params, d, *inputs)
  assert max(deviations.values()) < 1e-4
