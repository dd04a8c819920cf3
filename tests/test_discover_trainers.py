"""``saggs.discover`` on programs written the way MaxText and EasyDeL write them (issue 31), and
the shared-layer, ``jnp.take`` dispatch and ``(Σ q)(Σ k)`` cases of issue 32's finding 6.

The models (``discover_trainers``) wrap every projection in ``checkpoint_name`` and each layer's
input in ``optimization_barrier``, apply norm gains as MaxText does (``scale + 0.0``, then an
einsum) or as Gemma does (``1 + w``), and route MoE tokens by softmax and ``top_k``. Each test
checks the found set against the architecture's list written here, each found pair's exactness
by a NumPy orbit move (``test_discover.orbit_move``, independent of discover's confirmation), a
look-alike that must move the logits, the rejections' reasons, and ``found.roles`` entry by
entry.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import discover_trainers as dt
import saggs_jax as saggs
from saggs_jax import equivariant as eqv
from saggs_jax.discovery import discover
from test_discover import orbit_move

LLAMA = dt.Arch()
GEMMA3 = dt.Arch(gemma=True, qk_norm=True)
GPT_OSS = dt.Arch(biases=True, moe="take")
OLMOE = dt.Arch(qk_norm=True, moe="dense")
DEEPSEEK = dt.Arch(moe="dense", deepseek=True)


@functools.cache
def found(arch: dt.Arch):
  return discover(functools.partial(dt.forward, arch=arch), dt.init(arch), dt.tokens())


@functools.cache
def forward(arch: dt.Arch):
  return jax.jit(functools.partial(dt.forward, arch=arch))


def deviation(arch: dt.Arch, pairs, seed: int = 0) -> float:
  """Largest logit change under a NumPy orbit move of ``pairs``, relative to max |logit|."""
  params = dt.init(arch)
  with jax.default_matmul_precision("highest"):
    y0 = np.asarray(forward(arch)(params, dt.tokens()), np.float64)
    y1 = np.asarray(forward(arch)(orbit_move(params, pairs, seed), dt.tokens()), np.float64)
  return float(np.max(np.abs(y1 - y0)) / np.max(np.abs(y0)))


def reasons(d) -> dict:
  return {(r.a, r.b): r.reason for r in d.rejected}


def check_roles(d, expected: dict):
  assert set(d.roles) == set(expected)
  for role, patterns in expected.items():
    assert d.roles[role] == patterns, role


Q_PROJ, K_PROJ, V_PROJ = (f"self_attention/{n}/kernel" for n in ("query", "key", "value"))
PRE_NORM = saggs.Pair(
  "pre_self_attention_norm/scale", (Q_PROJ, K_PROJ, V_PROJ), axes=(0, 0), name="norm gain"
)
FINAL_NORM = saggs.Pair("decoder_norm/scale", "logits_dense/kernel", axes=(0, 0), name="norm gain")
UP_DOWN = saggs.Pair("wi_1/kernel", "wo/kernel", axes=(1, 0), name="gated MLP up/down")
QK = saggs.Pair("key/kernel", "query/kernel", axes=(1, 1), groups=2, name="attention Q/K")
VO = saggs.Pair("value/kernel", "out/kernel", axes=(1, 0), groups=2, name="attention V/O")
ATTENTION_ROLES = {
  "embedding": ("embedding",),
  "lm_head": ("logits_dense/kernel",),
  "query": ("query/kernel",),
  "key_value": ("key/kernel", "value/kernel"),
  "output": ("out/kernel",),
}
MLP_ROLES = {"gate_up": ("wi_0/kernel", "wi_1/kernel"), "down": ("wo/kernel",)}
MOE_ROLES = {"router": ("gate/kernel",), "experts": ("wi_0", "wi_1", "wo")}
SILU = "not positively homogeneous: logistic between them"
MOOT = (
  "moot: each side is scale-invariant on its own (a normalization follows each, QK-norm), so"
  " the pair is exact but balancing it changes nothing that matters"
)
OFFSET = "not exact: a constant added to it first (a gain stored as w in 1 + w) between them"


def test_maxtext_llama_behind_checkpoint_names_barriers_and_einsum_gains():
  d = found(LLAMA)
  post = saggs.Pair(
    "post_self_attention_norm/scale",
    ("mlp/wi_0/kernel", "mlp/wi_1/kernel"),
    axes=(0, 0),
    name="norm gain",
  )
  assert set(d) == {FINAL_NORM, PRE_NORM, post, UP_DOWN, QK, VO}
  assert deviation(LLAMA, list(d)) < 1e-5
  assert reasons(d) == {("wi_0/kernel", "wo/kernel"): SILU}
  gate = saggs.Pair("wi_0/kernel", "wo/kernel", axes=(1, 0))
  assert deviation(LLAMA, [gate]) > 1e-2
  check_roles(d, {**ATTENTION_ROLES, **MLP_ROLES})


def test_gemma3_one_plus_w_gains_and_qk_norm_are_rejected_with_their_reasons():
  d = found(GEMMA3)
  assert set(d) == {UP_DOWN, VO}
  assert deviation(GEMMA3, list(d)) < 1e-5
  why = reasons(d)
  assert why[("key/kernel", "query/kernel")] == MOOT
  assert why[PRE_NORM.a, PRE_NORM.b] == OFFSET
  assert why["decoder_norm/scale", "logits_dense/kernel"] == OFFSET
  assert why["post_self_attention_norm/scale", ("mlp/wi_0/kernel", "mlp/wi_1/kernel")] == OFFSET
  assert (
    why["wi_0/kernel", "wo/kernel"] == "not positively homogeneous: integer_pow, tanh between them"
  )
  assert deviation(GEMMA3, [PRE_NORM, FINAL_NORM]) > 1e-2  # (1 + w) c is no rescaling
  # the Q/K pair is moot, not lost: q and k keep their roles, read from the attention itself
  check_roles(d, {**ATTENTION_ROLES, **MLP_ROLES})


def test_gpt_oss_biases_sinks_and_experts_gathered_by_take():
  d = found(GPT_OSS)
  experts = saggs.Pair(
    "wi_1", "wo", axes=(1, 0), stacked=1, follow_a=("wi_1_bias",), name="expert up/down"
  )
  post = saggs.Pair(
    "post_self_attention_norm/scale",
    ("MoeBlock_0/gate/kernel", "MoeBlock_0/wi_0", "MoeBlock_0/wi_1"),
    axes=(0, (0, 1, 1)),
    name="norm gain",
  )
  qk = dataclasses.replace(QK, follow_a=("key/bias",), follow_b=("query/bias",))
  vo = dataclasses.replace(VO, follow_a=("value/bias",))
  assert set(d) == {FINAL_NORM, PRE_NORM, post, experts, qk, vo}
  assert deviation(GPT_OSS, list(d)) < 1e-5
  assert reasons(d)["wi_0", "wo"] == SILU
  assert deviation(GPT_OSS, [saggs.Pair("wi_0", "wo", axes=(1, 0), stacked=1)]) > 1e-2
  # the expert biases are gathered by the router's choices: no embedding, no role
  check_roles(d, {**ATTENTION_ROLES, **MOE_ROLES})


def test_olmoe_roles_do_not_need_the_moot_qk_pair():
  d = found(OLMOE)
  assert reasons(d)[("key/kernel", "query/kernel")] == MOOT
  assert not [p for p in d if p.a == "key/kernel"]
  assert deviation(OLMOE, list(d)) < 1e-5
  check_roles(d, {**ATTENTION_ROLES, **MOE_ROLES})


@pytest.mark.parametrize("moe", ["combined", "ragged"])
def test_every_expert_matrix_is_found_however_the_experts_are_combined(moe):
  """The down projection contracting its expert axis with the router's weights in one product
  (HF OLMoE's einsum), and the grouped matmul of tokens sorted by expert (``lax.ragged_dot``,
  EasyDeL's gpt-oss): the experts are gate, up and down all three."""
  check_roles(found(dt.Arch(moe=moe)), {**ATTENTION_ROLES, **MOE_ROLES})


def test_a_dense_mlp_and_a_narrower_shared_expert_pair_apart():
  d = found(DEEPSEEK)  # layer 0: mlp of F; layer 1: MoE and shared_experts of F / 2
  dense = dataclasses.replace(UP_DOWN, a="mlp/wi_1/kernel", b="mlp/wo/kernel")
  shared = dataclasses.replace(
    UP_DOWN, a="shared_experts/wi_1/kernel", b="shared_experts/wo/kernel"
  )
  assert {dense, shared} <= set(d)
  assert deviation(DEEPSEEK, list(d)) < 1e-5
  check_roles(d, {**ATTENTION_ROLES, **MLP_ROLES, **MOE_ROLES})


# ---------------------------------------------------------------------------
# Issue 32, finding 6.

D, F = 8, 16
RNG = np.random.default_rng(0)
MLP = {
  "up": jnp.asarray(RNG.standard_normal((D, F)) / 3, jnp.float32),
  "down": jnp.asarray(RNG.standard_normal((F, D)) / 4, jnp.float32),
}
X = jnp.asarray(RNG.standard_normal((2, 4, D)), jnp.float32)
RELU = saggs.Pair("up", "down", axes=(1, 0), name="ReLU MLP up/down (positive factors)")


def albert(p, x):
  """One ReLU MLP block shared by three layers."""
  for _ in range(3):
    x = x + jax.nn.relu(x @ p["up"]) @ p["down"]
  return x


SHARED = {
  **MLP,
  **{n: jnp.asarray(RNG.standard_normal((D, D)) / 3, jnp.float32) for n in ("q", "k", "v", "o")},
}


def albert_block(p, x):
  """An attention (no RoPE) and a ReLU MLP, shared by two layers."""
  for _ in range(2):
    s = jnp.einsum("bqd,bkd->bqk", x @ p["q"], x @ p["k"])
    x = x + (jax.nn.softmax(s) @ (x @ p["v"])) @ p["o"]
    x = x + jax.nn.relu(x @ p["up"]) @ p["down"]
  return x


def sums(p, x):
  """``einsum("bqd,bke->bqk")``: each side summed over its channels, then multiplied."""
  return jnp.einsum("bqd,bke->bqk", x @ p["up"], x @ p["down"].T)


def numpy_deviation(fn, params, pairs) -> float:
  with jax.default_matmul_precision("highest"):
    y0 = np.asarray(fn(params, X), np.float64)
    y1 = np.asarray(fn(orbit_move(params, pairs), X), np.float64)
  return float(np.max(np.abs(y1 - y0)) / np.max(np.abs(y0)))


def test_a_layer_shared_across_depth_is_found():
  d = discover(albert, MLP, X)
  assert list(d) == [RELU]
  assert numpy_deviation(albert, MLP, [RELU]) < 1e-6
  assert not any("weight tying" in r.reason for r in d.rejected)


def test_a_shared_attention_layer_is_found():
  d = discover(albert_block, SHARED, X)
  assert set(d) == {
    RELU,
    saggs.Pair("q", "k", axes=(1, 1), name="attention Q/K"),
    saggs.Pair("v", "o", axes=(1, 0), name="attention V/O"),
  }
  assert numpy_deviation(albert_block, SHARED, list(d)) < 1e-5
  assert not any("weight tying" in r.reason for r in d.rejected)
  assert d.roles == {"query": ("q",), "key_value": ("k", "v"), "output": ("o",)} | {
    "gate_up": ("up",),
    "down": ("down",),
  }


def test_a_product_of_sums_is_found_at_one_group():
  d = discover(sums, MLP, X)
  one = saggs.Pair("up", "down", axes=(1, 0), groups=1, name="product of sums")
  assert list(d) == [one]
  assert numpy_deviation(sums, MLP, [one]) < 1e-6
  per_channel = dataclasses.replace(one, groups=None)
  assert numpy_deviation(sums, MLP, [per_channel]) > 1e-2


def test_the_default_expert_patterns_leave_the_expert_biases_alone():
  params = {
    "mlp": {
      "router": {"kernel": jnp.ones((4, 3))},
      "experts": {
        "gate_up_proj": jnp.ones((3, 4, 8)),
        "gate_up_proj_bias": jnp.ones((3, 8)),
        "down_proj": jnp.ones((3, 4, 4)),
        "down_proj_bias": jnp.ones((3, 4)),
      },
    }
  }
  matched = {
    path
    for path, _ in saggs._src.paths.arrays_with_paths(params)
    for pattern in eqv.ROLE_PATTERNS["experts"]
    if saggs._src.paths.match(pattern, path) is not None
  }
  assert matched == {"mlp/experts/gate_up_proj", "mlp/experts/down_proj"}


@pytest.mark.parametrize("arch", [LLAMA, GPT_OSS], ids=["llama", "gpt_oss"])
def test_every_matrix_has_one_role_or_none(arch):
  """No leaf is matched by two roles' patterns, and of the leaves with two axes or more only
  biases (per head, per expert) are left to AdamW."""
  d = found(arch)
  leaves = dict(saggs._src.paths.arrays_with_paths(dt.init(arch)))
  left = set()
  for path, x in leaves.items():
    roles = [r for r, pats in d.roles.items() if any(saggs._src.paths.match(p, path) for p in pats)]
    assert len(roles) <= 1, (path, roles)
    if not roles and np.ndim(x) >= 2:
      left.add(path)
  assert left == {p for p, x in leaves.items() if p.endswith("bias") and np.ndim(x) >= 2}


# ---------------------------------------------------------------------------
# MaxText's scan_layers with param_scan_axis=1: the layer axis at position 1 of every leaf.


def _copy_axes_supported() -> bool:
  """Whether ``Pair(stacked=positions)`` resolves (the copy-axes work of issue 31)."""
  leaves = {"a": jnp.ones((2, 3, 4)), "b": jnp.ones((2, 3, 4))}
  try:
    saggs._src.plan.resolve([saggs.Pair("a", "b", axes=(1, 1), stacked=(1,))], leaves)
  except (TypeError, ValueError):
    return False
  return True


needs_copy_axes = pytest.mark.skipif(
  not _copy_axes_supported(), reason="needs Pair(stacked=(1,)): copy axes at any position"
)
LLAMA_SCANNED = dt.Arch(scan_axis=1)
MIXTRAL_SCANNED = dt.Arch(scan_axis=1, moe="dense", qk_norm=True)


def layer_axis_first(params, arch: dt.Arch):
  """``params`` with the layer axis moved from ``arch.scan_axis`` to the front."""
  dec = params["decoder"]
  layers = jax.tree.map(lambda w: jnp.moveaxis(w, arch.scan_axis, 0), dec["layers"])
  return {**params, "decoder": {**dec, "layers": layers}}


def scanned_deviation(arch: dt.Arch, pairs) -> float:
  """The orbit oracle on the layers moved to the front: each pair's copy axes then lead."""
  params = dt.init(arch)
  front = arch._replace(scan_axis=0)
  leading = [
    dataclasses.replace(p, stacked=len(p.stacked)) if isinstance(p.stacked, tuple) else p
    for p in pairs
  ]
  moved = orbit_move(layer_axis_first(params, arch), leading)
  with jax.default_matmul_precision("highest"):
    y0 = np.asarray(forward(arch)(params, dt.tokens()), np.float64)
    y1 = np.asarray(forward(front)(moved, dt.tokens()), np.float64)
  return float(np.max(np.abs(y1 - y0)) / np.max(np.abs(y0)))


@needs_copy_axes
def test_a_layer_axis_at_position_1_gives_per_layer_pairs():
  d = found(LLAMA_SCANNED)
  post = saggs.Pair(
    "post_self_attention_norm/scale",
    ("mlp/wi_0/kernel", "mlp/wi_1/kernel"),
    axes=(0, 0),
    name="norm gain",
  )
  per_layer = {dataclasses.replace(p, stacked=(1,)) for p in (PRE_NORM, post, UP_DOWN, QK, VO)}
  assert set(d) == per_layer | {FINAL_NORM}
  assert scanned_deviation(LLAMA_SCANNED, list(d)) < 1e-5
  assert reasons(d) == {("wi_0/kernel", "wo/kernel"): SILU}
  check_roles(d, {**ATTENTION_ROLES, **MLP_ROLES})


@needs_copy_axes
def test_experts_and_layers_at_positions_0_and_1_with_qk_norm():
  d = found(MIXTRAL_SCANNED)  # experts (E, L, in, out), the rest (.., L, ..)
  experts = saggs.Pair("wi_1", "wo", axes=(1, 0), stacked=2, name="expert up/down")
  assert experts in set(d)
  assert {p.stacked for p in d} == {0, 2, (1,)}
  assert scanned_deviation(MIXTRAL_SCANNED, list(d)) < 1e-5
  assert reasons(d)[("key/kernel", "query/kernel")] == MOOT
  check_roles(d, {**ATTENTION_ROLES, **MOE_ROLES})


# Muon's matrices of each scanned kernel, by hand: (reduction, output) axes, the layer axis (1)
# and the expert axis (0) batched; the router, embedding, LM head and norms to AdamW (absent).
SCANNED_MATRICES = {
  "self_attention/query/kernel": ((0,), (2, 3)),  # (d, L, heads, head_dim)
  "self_attention/key/kernel": ((0,), (2, 3)),
  "self_attention/value/kernel": ((0,), (2, 3)),
  "self_attention/out/kernel": ((0, 2), (3,)),  # (heads, L, head_dim, d)
}
DENSE_MATRICES = {f"mlp/{n}/kernel": ((0,), (2,)) for n in ("wi_0", "wi_1", "wo")}  # (in, L, out)
EXPERT_MATRICES = {f"MoeBlock_0/{n}": ((2,), (3,)) for n in ("wi_0", "wi_1", "wo")}  # (E, L, ..)


def axes_of(axes) -> tuple[int, ...]:
  return (axes,) if isinstance(axes, int) else tuple(axes)


@needs_copy_axes
@pytest.mark.parametrize(
  "arch, want",
  [
    (LLAMA_SCANNED, {**SCANNED_MATRICES, **DENSE_MATRICES}),
    (MIXTRAL_SCANNED, {**SCANNED_MATRICES, **EXPERT_MATRICES}),
    # no up/down pair through ragged_dot: the expert axis from the roles alone
    (dt.Arch(scan_axis=1, moe="ragged"), {**SCANNED_MATRICES, **EXPERT_MATRICES}),
  ],
)
def test_muon_dimension_numbers_batch_the_layer_and_expert_axes_wherever_they_sit(arch, want):
  """Every kernel's copy axes from the program (the axis the scan slices, an expert's expert
  axis), the unpaired ones too (query and key under QK-norm)."""
  params = dt.init(arch)
  dims = found(arch).muon_dimension_numbers(params)
  got = {}
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    dn = functools.reduce(lambda t, k: t[k.key], path, dims)
    if dn is not None:
      name = "/".join(str(k.key) for k in path).removeprefix("decoder/layers/")
      got[name] = tuple(tuple(sorted(a % x.ndim for a in axes_of(ax))) for ax in dn)
  assert got == want
