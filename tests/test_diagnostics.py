"""check_symmetry's failure hints: each broken declaration on a tiny model gets the cause
that the extra rescalings measure, and the fix it names is checked to be exact."""

import functools
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
import saggs_jax as saggs
from saggs_jax._src.diagnostics import MootPairWarning

X = jnp.asarray(np.random.default_rng(0).standard_normal((4, models.CONFIG.d_model)), jnp.float32)
UP_DOWN = [saggs.Pair("up/kernel", "down/kernel", axes=(1, 0))]
QK_NORM = models.Config(qk_norm=True)
qk_norm_forward = functools.partial(models.llama_forward, c=QK_NORM)


def failure(*args, **kwargs) -> str:
  """The message of the ValueError that ``check_symmetry(*args)`` raises, with its diagnosis
  (a note)."""
  with pytest.raises(ValueError, match="is not a symmetry of the model") as info:
    saggs.check_symmetry(*args, **kwargs)
  return " ".join([str(info.value), *info.value.__notes__])


def measured(message, what):
  """The numbers the message reports for ``what`` (a regex with one group per number)."""
  found = re.search(what, message)
  assert found, message
  return [float(x) for x in found.groups()]


NUMBER = r"([0-9.e+-]+)"


def test_gelu_mlp_is_a_non_homogeneous_activation():
  message = failure(models.gelu_mlp_forward, models.gelu_mlp_init(), UP_DOWN, X)
  near, far = measured(message, f"{NUMBER} with c within 5% of 1 and {NUMBER} with c up to 4")
  assert far > 3 * near
  assert re.search(
    r"Likely cause: the deviation grows with c and no other group axis, grouping"
    r" or follower is exact, so a function that is not positively homogeneous"
    r" sits between 'mlp/up/kernel' and 'mlp/down/kernel'",
    message,
  ), message
  assert "normalization" not in message and "QK-norm" not in message


def normed_mlp(p, x):
  """up -> RMS normalization -> down: rescaling up is undone by the norm, not by down."""
  h = x @ p["mlp"]["up"]["kernel"]
  h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
  return h @ p["mlp"]["down"]["kernel"]


def test_norm_between_the_two_sides():
  message = failure(normed_mlp, models.gelu_mlp_init(), UP_DOWN, X)
  alone_a, alone_b = measured(
    message, f"'mlp/up/kernel' alone x2: {NUMBER}, 'mlp/down/kernel' alone /2: {NUMBER}"
  )
  assert alone_a < 1e-5 < 0.1 < alone_b
  assert re.search(
    r"Likely cause: 'mlp/up/kernel' is scale-invariant on its own: a"
    r" normalization follows it \(a norm between 'mlp/up/kernel' and"
    r" 'mlp/down/kernel'\)",
    message,
  ), message


def test_qk_norm_across_heads_makes_each_side_invariant():
  params, toks = models.llama_init(0, QK_NORM), models.tokens(0, c=QK_NORM)
  message = failure(qk_norm_forward, params, models.llama_pairs(QK_NORM), toks)
  assert re.search(
    r"'layers/0/attn/q_proj/kernel' and 'layers/0/attn/k_proj/kernel' are each"
    r" scale-invariant.*With one factor per tensor the pair is a symmetry, but"
    r" balancing it is moot",
    message,
  ), message
  # Both claims, checked directly: Q alone times 3 changes nothing, and one factor
  # per tensor (axes=None) is exact.
  attn = params["layers"]["0"]["attn"]
  scaled = {
    **params,
    "layers": {
      **params["layers"],
      "0": {
        **params["layers"]["0"],
        "attn": {**attn, "q_proj": {"kernel": 3 * attn["q_proj"]["kernel"]}},
      },
    },
  }
  models.assert_same_output(qk_norm_forward(scaled, toks), qk_norm_forward(params, toks))
  whole = [saggs.Pair("q_proj/kernel", "k_proj/kernel")]
  with pytest.warns(MootPairWarning, match="exact but moot"):
    assert max(saggs.check_symmetry(qk_norm_forward, params, whole, toks).values()) < 1e-5


class PerHeadQKNorm(nn.Module):
  """Flax attention with ``normalize_qk=True``: a LayerNorm over each query and key head."""

  @nn.compact
  def __call__(self, x):
    return nn.MultiHeadDotProductAttention(
      num_heads=2, qkv_features=8, normalize_qk=True, name="attn"
    )(x)


def test_per_head_qk_norm_keeps_the_pair_exact():
  # The docs' claim: Q and K are each scale-invariant, and the per-head pair is a symmetry.
  model, x = PerHeadQKNorm(), models.mha_input(0)
  params = models.random_like(jax.eval_shape(model.init, jax.random.PRNGKey(0), x), 1)
  qk = saggs.presets.flax_mha()[:1]
  with pytest.warns(
    MootPairWarning, match=r"'params/attn/query/kernel' alone, or 'params/attn/key/kernel' alone"
  ):
    assert max(saggs.check_symmetry(model.apply, params, qk, x).values()) < 1e-5
  query = params["params"]["attn"]["query"]
  scaled = jax.tree.map(lambda v: 5 * v, query)  # Q alone, kernel and bias
  moved = {"params": {**params["params"], "attn": {**params["params"]["attn"], "query": scaled}}}
  models.assert_same_output(model.apply(moved, x), model.apply(params, x))


def test_wrong_axes_are_named_with_the_exact_ones():
  params, toks = models.llama_init(0), models.tokens(0)
  wrong = [saggs.Pair("up_proj/kernel", "down_proj/kernel", axes=(0, 1))]
  message = failure(models.llama_forward, params, wrong, toks)
  assert re.search(
    r"Likely cause: the group axes: with axes=\(1, 0\) \(declared: \(0, 1\)\) the"
    r" pair is exact",
    message,
  ), message
  assert "groups deviating when rescaled alone: all of 8 probed (16 in all)" in message
  fixed = [saggs.Pair("up_proj/kernel", "down_proj/kernel", axes=(1, 0))]
  assert max(saggs.check_symmetry(models.llama_forward, params, fixed, toks).values()) < 1e-5


def test_wrong_grouping_is_named_with_the_exact_one():
  # GQA with 4 query heads on 2 KV heads: a factor per query head is not a symmetry.
  params, toks = models.llama_init(0), models.tokens(0)
  per_head = [saggs.Pair("q_proj/kernel", "k_proj/kernel", axes=(1, 1), groups=4)]
  message = failure(models.llama_forward, params, per_head, toks)
  assert re.search(
    r"Likely cause: the grouping: with groups=2 \(declared: 4 groups\) the pair"
    r" is exact",
    message,
  ), message


RNG = np.random.default_rng(1)
RELU_PARAMS = {
  "fc1": {
    "kernel": jnp.asarray(RNG.standard_normal((models.CONFIG.d_model, 8)), jnp.float32),
    "bias": jnp.asarray(RNG.standard_normal(8), jnp.float32),
  },
  "fc2": {
    "kernel": jnp.asarray(RNG.standard_normal((8, 3)), jnp.float32),
    "bias": jnp.asarray(RNG.standard_normal(3), jnp.float32),
  },
}


def relu_mlp(p, x):
  h = jax.nn.relu(x @ p["fc1"]["kernel"] + p["fc1"]["bias"])
  return h @ p["fc2"]["kernel"] + p["fc2"]["bias"]


@pytest.mark.parametrize(
  "declared, hint",
  [
    (dict(axes=(1, 0)), "a follower left out: with 'fc1/bias' in follow_a the pair is exact"),
    # One factor per tensor, and the output bias moved as if it were part of fc2.
    (
      dict(follow_a="fc1/bias", follow_b="fc2/bias"),
      "a follower too many: without 'fc2/bias' in follow_b the pair is exact",
    ),
  ],
  ids=["missing", "wrong side"],
)
def test_biases_are_named(declared, hint):
  message = failure(relu_mlp, RELU_PARAMS, [saggs.Pair("fc1/kernel", "fc2/kernel", **declared)], X)
  assert f"Likely cause: {hint}" in message, message
  fixed = saggs.Pair("fc1/kernel", "fc2/kernel", axes=declared.get("axes"), follow_a="fc1/bias")
  assert max(saggs.check_symmetry(relu_mlp, RELU_PARAMS, [fixed], X).values()) < 1e-5


def half_gelu_mlp(p, x):
  """Hidden channels 0-3 through ReLU (exact), 4-7 through GELU (not)."""
  h = x @ p["fc1"]["kernel"]
  act = jnp.where(jnp.arange(h.shape[-1]) < 4, jax.nn.relu(h), jax.nn.gelu(h))
  return act @ p["fc2"]["kernel"]


def test_the_deviating_groups_are_listed():
  pair = saggs.Pair("fc1/kernel", "fc2/kernel", axes=(1, 0))
  # Small pre-activations, where GELU is far from linear on either side.
  params = {**RELU_PARAMS, "fc1": {"kernel": 0.2 * RELU_PARAMS["fc1"]["kernel"]}}
  message = failure(half_gelu_mlp, params, [pair], X)
  assert "groups deviating when rescaled alone: [4, 5, 6, 7] of 8 probed (8 in all)" in message
  assert "not positively homogeneous" in message


def test_rounding_noise_asks_for_a_larger_rtol():
  params = jax.tree.map(lambda v: v.astype(jnp.bfloat16), models.llama_init(0))
  message = failure(models.llama_forward, params, models.llama_pairs(), models.tokens(0), rtol=1e-5)
  near, far = measured(message, f"{NUMBER} with c within 5% of 1 and {NUMBER} with c up to 4")
  assert far < 3 * near
  assert "Likely cause: the deviation hardly depends on c, so it is rounding noise" in message
  deviations = saggs.check_symmetry(
    models.llama_forward, params, models.llama_pairs(), models.tokens(0), rtol=3e-2
  )
  assert max(deviations.values()) < 3e-2


def _post_norm(p, x):
  """V/O of two heads, then a norm over the whole output (a post-norm block without its
  residual): one common factor on V is invisible, each head's relative one is not."""
  y = (x @ p["v"]) @ p["o"]
  return y / jnp.sqrt(jnp.mean(y * y, -1, keepdims=True))


def test_a_post_norm_is_no_reason_to_call_a_pair_moot():
  """Per-head V/O under a norm after the product is exact and not moot: V's heads rescaled
  alone move the output (checked by hand), so no MootPairWarning."""
  rng = np.random.default_rng(3)
  p = {
    "v": jnp.asarray(rng.standard_normal((4, 8)), jnp.float32),
    "o": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
  }
  x = jnp.asarray(rng.standard_normal((5, 4)), jnp.float32)
  one_head = {**p, "v": p["v"] * jnp.repeat(jnp.array([3.0, 1.0]), 4)}
  assert float(jnp.max(jnp.abs(_post_norm(one_head, x) - _post_norm(p, x)))) > 0.1
  models.assert_same_output(_post_norm({**p, "v": 3 * p["v"]}, x), _post_norm(p, x))
  pair = [saggs.Pair("v", "o", axes=(1, 0), groups=2)]
  with warnings.catch_warnings():
    warnings.simplefilter("error", MootPairWarning)
    assert max(saggs.check_symmetry(_post_norm, p, pair, x).values()) < 1e-5
