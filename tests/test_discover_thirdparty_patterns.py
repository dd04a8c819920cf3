"""``saggs.discover`` on the attention layouts of third-party models, each reproduced in plain JAX.

* multi-query attention (one KV head; transformers' Gemma-2B, LLaMA with
  ``num_key_value_heads=1``), the key expanded by ``jnp.repeat`` or ``jnp.broadcast_to``;
* interleaved RoPE (Meta LLaMA, GPT-J): ``x[..., ::2]``, ``x[..., 1::2]`` rotated and
  stacked back;
* a zero-initialised output projection (modded-nanogpt, muP, adaLN-Zero), on which every
  rescaling of Q/K "confirms" unless the check runs where the path is live.

What ``discover`` finds is compared with the symmetries written by hand, and checked by an
orbit move in NumPy (``test_discover.orbit_move``) on parameters whose every path is live.
"""

import functools
import importlib.util
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import models
import saggs_jax as saggs
from saggs_jax.discovery import Discovery, Rejected, discover
from test_discover import orbit_move

D, HD, F, V, T = 16, 4, 24, 16, 8  # width, head size, MLP hidden, vocabulary, tokens


def _rope_half(x):
  """Rotates pairs (i, i + hd/2) of x (batch, seq, heads, hd): the rotate-half form."""
  cos, sin = _angles(x)
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _rope_interleaved(x):
  """Rotates pairs (2i, 2i + 1): the Meta LLaMA / GPT-J form."""
  cos, sin = _angles(x)
  x1, x2 = x[..., ::2], x[..., 1::2]
  return jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).reshape(x.shape)


def _angles(x):
  angles = jnp.arange(x.shape[1])[:, None] * 100.0 ** (-jnp.arange(HD // 2) * 2 / HD)
  return jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]


ROPE = {"half": _rope_half, "interleaved": _rope_interleaved}


def _rms_norm(x, scale):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def lm_init(seed=0, heads=4, kv=2, layers=2, zero_out=False):
  """A pre-norm decoder: RMSNorm, attention with RoPE, SwiGLU; ``o`` zero if ``zero_out``."""
  rng = np.random.default_rng(seed)

  def dense(n_in, n_out):
    return {"kernel": rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)}

  def layer():
    o = dense(heads * HD, D)
    return {
      "attn_norm": {"scale": 1 + 0.1 * rng.standard_normal(D)},
      "attn": {
        "q": dense(D, heads * HD),
        "k": dense(D, kv * HD),
        "v": dense(D, kv * HD),
        "o": {"kernel": 0 * o["kernel"]} if zero_out else o,
      },
      "mlp_norm": {"scale": 1 + 0.1 * rng.standard_normal(D)},
      "mlp": {"gate": dense(D, F), "up": dense(D, F), "down": dense(F, D)},
    }

  params = {
    "embed": rng.standard_normal((V, D)),
    **{f"layer_{i}": layer() for i in range(layers)},
    "final_norm": {"scale": 1 + 0.1 * rng.standard_normal(D)},
    "head": dense(D, V),
  }
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)


def lm_forward(params, tokens, heads=4, kv=2, rope="half", expand="repeat", attn_gain=1.0):
  """Logits; ``expand``: how each KV head reaches its query heads; ``attn_gain`` multiplies
  the attention branch (0: a path that no parameter can make live)."""
  x = params["embed"][tokens]
  b, t, _ = x.shape
  for i in range(sum(k.startswith("layer_") for k in params)):
    p = params[f"layer_{i}"]
    h = _rms_norm(x, p["attn_norm"]["scale"])
    a = p["attn"]
    q = ROPE[rope]((h @ a["q"]["kernel"]).reshape(b, t, heads, HD))
    k = ROPE[rope]((h @ a["k"]["kernel"]).reshape(b, t, kv, HD))
    v = (h @ a["v"]["kernel"]).reshape(b, t, kv, HD)
    if expand == "repeat":
      k, v = jnp.repeat(k, heads // kv, axis=2), jnp.repeat(v, heads // kv, axis=2)
    else:  # one KV head broadcast to every query head
      k, v = jnp.broadcast_to(k, q.shape), jnp.broadcast_to(v, q.shape)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HD)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v).reshape(b, t, -1)
    x = x + attn_gain * (out @ a["o"]["kernel"])
    h = _rms_norm(x, p["mlp_norm"]["scale"])
    m = p["mlp"]
    x = x + (jax.nn.silu(h @ m["gate"]["kernel"]) * (h @ m["up"]["kernel"])) @ m["down"]["kernel"]
  return _rms_norm(x, params["final_norm"]["scale"]) @ params["head"]["kernel"]


def tokens(seed=0):
  return jnp.asarray(np.random.default_rng(600 + seed).integers(0, V, (2, T)), jnp.int32)


def lm_pairs(kv):
  """The exact symmetries of ``lm_forward``, by hand: Q/K and V/O per KV head, SwiGLU up/down
  per channel, each norm gain against the rows of the linears that read it."""
  return {
    saggs.Pair("q/kernel", "k/kernel", axes=(1, 1), groups=kv, name="attention Q/K"),
    saggs.Pair("v/kernel", "o/kernel", axes=(1, 0), groups=kv, name="attention V/O"),
    saggs.Pair("up/kernel", "down/kernel", axes=(1, 0), name="gated MLP up/down"),
    saggs.Pair(
      "attn_norm/scale",
      ("attn/q/kernel", "attn/k/kernel", "attn/v/kernel"),
      axes=(0, 0),
      name="norm gain",
    ),
    saggs.Pair(
      "mlp_norm/scale", ("mlp/gate/kernel", "mlp/up/kernel"), axes=(0, 0), name="norm gain"
    ),
    saggs.Pair("final_norm/scale", "head/kernel", axes=(0, 0), name="norm gain"),
  }


def orbit_deviation(forward, params, pairs, seed=0):
  """Largest output change under a NumPy orbit move of ``pairs``, relative to max |output|."""
  forward = jax.jit(forward)
  with jax.default_matmul_precision("highest"):
    y0 = np.asarray(forward(params, tokens()))
    y1 = np.asarray(forward(orbit_move(params, pairs, seed), tokens()))
  return float(np.max(np.abs(y1 - y0)) / np.max(np.abs(y0)))


def without_names(pairs):
  return {p.__class__(**{**p.__dict__, "name": None}) for p in pairs}


# ---------------------------------------------------------------------------
# Points 1 and 2: one KV head, interleaved RoPE.


@pytest.mark.parametrize("expand", ["repeat", "broadcast"])
def test_multi_query_attention_pairs_q_with_k_as_one_group(expand):
  forward = functools.partial(lm_forward, kv=1, expand=expand)
  params = lm_init(kv=1)
  d = discover(forward, params, tokens())
  assert set(d) == lm_pairs(kv=1)
  assert [r.a for r in d.rejected] == ["gate/kernel"]  # SiLU: not positively homogeneous
  assert orbit_deviation(forward, params, d) < 1e-5


def test_interleaved_rope_pairs_q_with_k_per_kv_head():
  forward = functools.partial(lm_forward, rope="interleaved")
  params = lm_init()
  d = discover(forward, params, tokens())
  assert set(d) == lm_pairs(kv=2)
  assert orbit_deviation(forward, params, d) < 1e-5
  # The oracle tells the groupings apart: per query head, Q/K is not exact.
  assert (
    orbit_deviation(forward, params, [saggs.Pair("q/kernel", "k/kernel", axes=(1, 1), groups=4)])
    > 1e-2
  )


# ---------------------------------------------------------------------------
# Point 4: no confirmation by a check that could not have failed.


def test_a_zero_output_projection_does_not_confirm_per_query_head_pairs():
  params = lm_init(zero_out=True)
  d = discover(lm_forward, params, tokens())
  assert set(d) == lm_pairs(kv=2)
  # Once o trains, what was found still holds; per query head it would not.
  live = lm_init(zero_out=False)
  assert orbit_deviation(lm_forward, live, d) < 1e-5
  per_query_head = [saggs.Pair("q/kernel", "k/kernel", axes=(1, 1), groups=4)]
  assert orbit_deviation(lm_forward, live, per_query_head) > 1e-2


def test_a_path_no_parameter_makes_live_is_reported_unconfirmed():
  forward = functools.partial(lm_forward, attn_gain=0.0)
  d = discover(forward, lm_init(), tokens())
  assert without_names(d) == without_names(
    p for p in lm_pairs(kv=2) if p.a not in ("q/kernel", "v/kernel", "attn_norm/scale")
  )
  reasons = {r.a: r.reason for r in d.rejected}
  for a in ("q/kernel", "v/kernel", "attn_norm/scale"):
    assert reasons[a].startswith(
      "unconfirmed: rescaling side a alone does not change the output"
    ), reasons


# ---------------------------------------------------------------------------
# Point 3: blocks of fused leaves.

H = 2  # heads of the fused models (head size HD)


def _layer_norm(x, p):
  mu = x.mean(-1, keepdims=True)
  x = (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
  return x * p["scale"] + p["bias"]


def gpt2_init(seed=0, layers=2):
  """GPT-2's layout: ``c_attn`` one (D, 3 H HD) kernel for q|k|v, with a fused bias."""
  rng = np.random.default_rng(seed)

  def dense(n_in, n_out):
    return {
      "kernel": rng.standard_normal((n_in, n_out)) / np.sqrt(n_in),
      "bias": 0.1 * rng.standard_normal(n_out),
    }

  def norm():
    return {"scale": 1 + 0.1 * rng.standard_normal(D), "bias": 0.1 * rng.standard_normal(D)}

  params = {"wte": rng.standard_normal((V, D)), "ln_f": norm(), "head": dense(D, V)}
  for i in range(layers):
    params[f"h_{i}"] = {
      "ln_1": norm(),
      "ln_2": norm(),
      "attn": {"c_attn": dense(D, 3 * H * HD), "c_proj": dense(H * HD, D)},
      "mlp": {"c_fc": dense(D, F), "c_proj": dense(F, D)},
    }
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)


def gpt2_forward(params, tokens, cut="split", out_in=False):
  """q, k, v cut from one projection by ``jnp.split`` or by slicing (``cut="slice"``);
  ``out_in``: ``c_attn/kernel`` read transposed, as transformers' FlaxConv1D stores it."""
  x = params["wte"][tokens]
  b, t, _ = x.shape
  for i in range(sum(k.startswith("h_") for k in params)):
    p = params[f"h_{i}"]
    a = p["attn"]
    w = a["c_attn"]["kernel"]
    qkv = _layer_norm(x, p["ln_1"]) @ (w.T if out_in else w)
    qkv = qkv + a["c_attn"]["bias"]
    n = H * HD
    q, k, v = (
      jnp.split(qkv, 3, axis=-1)
      if cut == "split"
      else (qkv[..., :n], qkv[..., n : 2 * n], qkv[..., 2 * n :])
    )
    q, k, v = (y.reshape(b, t, H, HD) for y in (q, k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HD)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v).reshape(b, t, n)
    x = x + out @ a["c_proj"]["kernel"] + a["c_proj"]["bias"]
    m = p["mlp"]
    h = jax.nn.gelu(_layer_norm(x, p["ln_2"]) @ m["c_fc"]["kernel"] + m["c_fc"]["bias"])
    x = x + h @ m["c_proj"]["kernel"] + m["c_proj"]["bias"]
  return _layer_norm(x, params["ln_f"]) @ params["head"]["kernel"] + params["head"]["bias"]


def gemma_init(seed=0, heads=4, kv=2, layers=2):
  """The gemma package's layout: ``kv_einsum/w`` (2, kv, D, HD) holds K and V on a leading axis,
  ``gating_einsum/w`` (2, F, D) gate and up; ``q_einsum/w`` (heads, D, HD),
  ``attn_vec_einsum/w`` (heads, HD, D), ``linear/w`` (F, D)."""
  rng = np.random.default_rng(seed)

  def w(*shape):
    return {"w": rng.standard_normal(shape) / np.sqrt(D)}

  params = {"embed": rng.standard_normal((V, D))}
  for i in range(layers):
    params[f"layer_{i}"] = {
      "attn": {
        "q_einsum": w(heads, D, HD),
        "kv_einsum": w(2, kv, D, HD),
        "attn_vec_einsum": w(heads, HD, D),
      },
      "mlp": {"gating_einsum": w(2, F, D), "linear": w(F, D)},
    }
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)


def gemma_forward(params, tokens, heads=4, kv=2, cut="unpack"):
  """K, V unpacked from one einsum's leading axis (``cut="split"``: by ``jnp.split``)."""
  x = params["embed"][tokens]
  b, t, _ = x.shape
  for i in range(sum(k.startswith("layer_") for k in params)):
    a, m = params[f"layer_{i}"]["attn"], params[f"layer_{i}"]["mlp"]
    h = _rms_norm(x, 1.0)
    q = _rope_half(jnp.einsum("BTD,NDH->BTNH", h, a["q_einsum"]["w"]))
    kv_proj = jnp.einsum("BSD,CKDH->CBSKH", h, a["kv_einsum"]["w"])
    k, v = kv_proj if cut == "unpack" else (y[0] for y in jnp.split(kv_proj, 2, axis=0))
    k = _rope_half(k)
    q = q.reshape(b, t, kv, heads // kv, HD)
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", q, k) / np.sqrt(HD)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool))[:, None, None], logits, -1e9)
    enc = jnp.einsum("BTKGS,BSKH->BTKGH", jax.nn.softmax(logits), v).reshape(b, t, heads, HD)
    x = x + jnp.einsum("BTNH,NHD->BTD", enc, a["attn_vec_einsum"]["w"])
    gate = jnp.einsum("...F,NHF->...NH", _rms_norm(x, 1.0), m["gating_einsum"]["w"])
    act = jax.nn.gelu(gate[..., 0, :]) * gate[..., 1, :]
    x = x + jnp.einsum("...H,HF->...F", act, m["linear"]["w"])
  return _rms_norm(x, 1.0) @ params["embed"].T


def qkv(pattern, axis, part):
  return saggs.Block(pattern, axis=axis, parts=3, part=part)


GPT2_FOUND = {
  saggs.Pair(
    qkv("c_attn/kernel", 1, 0),
    qkv("c_attn/kernel", 1, 1),
    axes=(1, 1),
    follow_a=(qkv("c_attn/bias", 0, 0),),
    follow_b=(qkv("c_attn/bias", 0, 1),),
    name="attention Q/K",
  ),
  saggs.Pair(
    qkv("attn/c_attn/kernel", 1, 2),
    "attn/c_proj/kernel",
    axes=(1, 0),
    follow_a=(qkv("attn/c_attn/bias", 0, 2),),
    name="attention V/O",
  ),
  saggs.Pair(
    "ln_1/scale", "attn/c_attn/kernel", axes=(0, 0), follow_a=("ln_1/bias",), name="norm gain"
  ),
  saggs.Pair(
    "ln_2/scale", "mlp/c_fc/kernel", axes=(0, 0), follow_a=("ln_2/bias",), name="norm gain"
  ),
  saggs.Pair("ln_f/scale", "head/kernel", axes=(0, 0), follow_a=("ln_f/bias",), name="norm gain"),
}


@pytest.mark.parametrize("cut", ["split", "slice"])
def test_gpt2_fused_qkv_pairs_its_column_blocks(cut):
  forward = functools.partial(gpt2_forward, cut=cut)
  params = gpt2_init()
  d = discover(forward, params, tokens())
  assert set(d) == GPT2_FOUND
  assert {(r.a, r.b) for r in d.rejected} == {("c_fc/kernel", "c_proj/kernel")}  # GELU
  assert orbit_deviation(forward, params, d) < 1e-5
  # The oracle sees blocks: Q against V instead of K changes the output.
  wrong = saggs.Pair(qkv("c_attn/kernel", 1, 0), qkv("c_attn/kernel", 1, 2), axes=(1, 1))
  assert orbit_deviation(forward, params, [wrong]) > 1e-2
  if cut == "split":  # the library's own check resolves the blocks alike
    assert max(saggs.check_symmetry(forward, params, d, tokens()).values()) < 1e-4


def test_saggs_balances_the_fused_blocks_discover_found_without_changing_the_function():
  """c_attn sits in three pairs at once: its rows against ln_1, its q|k columns in Q/K and its
  v columns in V/O; hard SAGGS steps balance them jointly (a few: one update moves a factor
  by at most ``step_limits``), each keeping the function."""
  params = gpt2_init(layers=1)
  d = discover(gpt2_forward, params, tokens())
  start = orbit_move(params, d, seed=3)  # far from balanced, same function
  tx = saggs.chain(optax.sgd(0.0), saggs.saggs(d))

  def step(p, s):
    updates, s = tx.update(jax.tree.map(jnp.zeros_like, p), s, p)
    return optax.apply_updates(p, updates), s

  step, forward = jax.jit(step), jax.jit(gpt2_forward)
  moved, state = start, tx.init(start)
  for _ in range(4):
    moved, state = step(moved, state)
    models.assert_same_function(forward, start, moved, tokens())
  worst = {
    name: max(float(jnp.max(jnp.abs(v))) for v in saggs.imbalance(p, d).values())
    for name, p in (("start", start), ("moved", moved))
  }
  assert worst["start"] > 0.5 and worst["moved"] < 1e-4, worst


GPT2_OUT_IN_FOUND = {
  saggs.Pair(
    qkv("c_attn/kernel", 0, 0),
    qkv("c_attn/kernel", 0, 1),
    axes=(0, 0),
    follow_a=(qkv("c_attn/bias", 0, 0),),
    follow_b=(qkv("c_attn/bias", 0, 1),),
    name="attention Q/K",
  ),
  saggs.Pair(
    qkv("attn/c_attn/kernel", 0, 2),
    "attn/c_proj/kernel",
    axes=(0, 0),
    follow_a=(qkv("attn/c_attn/bias", 0, 2),),
    name="attention V/O",
  ),
  saggs.Pair(
    "ln_1/scale", "attn/c_attn/kernel", axes=(0, 1), follow_a=("ln_1/bias",), name="norm gain"
  ),
  *(p for p in GPT2_FOUND if p.a in ("ln_2/scale", "ln_f/scale")),
}


def test_the_bias_of_an_out_in_kernel_follows_its_blocks():
  """transformers' FlaxConv1D stores ``c_attn`` (out, in): its q|k|v blocks lie on axis 0,
  the axis its bias (out,) follows. A bias vector is a Pair follower along its one axis, so
  Q/K and V/O are declared with the bias blocks following, and the orbit keeps the output."""
  params = gpt2_init()
  params = jax.tree_util.tree_map_with_path(
    lambda kp, x: x.reshape(x.shape[::-1]) if "c_attn" in jax.tree_util.keystr(kp) else x, params
  )
  forward = functools.partial(gpt2_forward, out_in=True)
  d = discover(forward, params, tokens())
  assert set(d) == GPT2_OUT_IN_FOUND
  assert {(r.a, r.b) for r in d.rejected} == {("c_fc/kernel", "c_proj/kernel")}  # GELU
  assert orbit_deviation(forward, params, d) < 1e-5
  no_bias = [saggs.Pair(p.a, p.b, axes=p.axes, name=p.name) for p in d if p.follow_a]
  assert orbit_deviation(forward, params, no_bias) > 1e-2  # the oracle sees the biases


def kv(part):
  return saggs.Block("kv_einsum/w", axis=0, parts=2, part=part)


GEMMA_FOUND = {
  saggs.Pair(kv(0), "q_einsum/w", axes=(1, 0), groups=2, name="attention Q/K"),
  saggs.Pair(kv(1), "attn_vec_einsum/w", axes=(1, 0), groups=2, name="attention V/O"),
  saggs.Pair(
    saggs.Block("gating_einsum/w", axis=0, parts=2, part=1),
    "linear/w",
    axes=(1, 0),
    name="gated MLP up/down",
  ),
}


@pytest.mark.parametrize("cut", ["unpack", "split"])
def test_gemma_kv_and_gating_leaves_pair_by_their_leading_blocks(cut):
  forward = functools.partial(gemma_forward, cut=cut)
  params = gemma_init()
  d = discover(forward, params, tokens())
  assert set(d) == GEMMA_FOUND
  assert [r.a for r in d.rejected] == ["gating_einsum/w[part 0 of 2 on axis 0]"]  # GELU gate
  assert orbit_deviation(forward, params, d) < 1e-5
  # V against Q (the wrong block) changes the output.
  assert (
    orbit_deviation(forward, params, [saggs.Pair(kv(1), "q_einsum/w", axes=(1, 0), groups=2)])
    > 1e-2
  )


@pytest.mark.skipif(
  importlib.util.find_spec("gemma") is None,
  reason="the gemma package is not installed (not a test dependency)",
)
def test_the_gemma_package_transformer():
  """``gm.nn.Transformer`` itself, in a subprocess (gemma patches flax process-wide)."""
  script = pathlib.Path(__file__).with_name("gemma_discover_check.py")
  done = subprocess.run(
    [sys.executable, str(script)], capture_output=True, text=True, timeout=600, check=True
  )
  *found, deviation = done.stdout.strip().splitlines()
  namespace = {
    "Discovery": Discovery,
    "Pair": saggs.Pair,
    "Block": saggs.Block,
    "Rejected": Rejected,
  }
  d = eval("\n".join(found), namespace)  # pylint: disable=eval-used
  gating = saggs.Block("gating_einsum", axis=0, parts=2, part=1)  # gemma names it without /w
  assert set(d) == {
    *(p for p in GEMMA_FOUND if p.b != "linear/w"),
    saggs.Pair(gating, "linear", axes=(1, 0), name="gated MLP up/down"),
  }
  assert float(deviation) < 1e-5
