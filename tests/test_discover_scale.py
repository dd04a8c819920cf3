"""``saggs.discover`` where the example checks are weak or impossible: parameters drawn at a
small init scale, and abstract parameters (shapes only, as for a 7B model on one host).

At init std 0.02 (every leaf, norm gains included) the attention logits are ~1e-3, and
rescaling Q/K per channel (a wrong grouping: RoPE rotates channel pairs) moves an LM's logits
by ~1e-5 of their size, under any fixed tolerance; the check must still tell the KV-head
grouping from the others, on scanned layers as on unrolled ones, and find the LLaMA preset.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
import saggs_jax as saggs
from saggs_jax.discovery import Discovery, discover
from test_discover import orbit_move

SMALL = models.Config(
  vocab=32, d_model=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, mlp_hidden=96
)


def small_init(c: models.Config, std: float = 0.02):
  """Every leaf N(0, std^2), norm gains included: the logits of attention are tiny."""
  rng = np.random.default_rng(7)
  shapes = jax.eval_shape(lambda: models.llama_init(0, c))
  return jax.tree.map(lambda x: jnp.asarray(std * rng.standard_normal(x.shape), x.dtype), shapes)


def unnamed(pairs):
  return {dataclasses.replace(p, name=None) for p in pairs}


@pytest.mark.parametrize("stacked", [False, True])
def test_qk_is_found_per_kv_head_at_init_std_002(stacked):
  c = dataclasses.replace(SMALL, stacked=stacked)
  params = small_init(c)
  found = discover(lambda p, t: models.llama_forward(p, t, c), params, models.tokens(0, 1, 8, c))
  # Q/K and V/O per KV head, up/down per channel: the hand-written preset, nothing dropped.
  assert unnamed(models.llama_pairs(c)) <= unnamed(found)
  assert not [r for r in found.rejected if "unconfirmed" in r.reason]
  assert found.confirmation == "parameters"
  # And the pairs found are exact: the NumPy orbit move of test_discover.
  tokens = models.tokens(0, 1, 8, c)
  with jax.default_matmul_precision("highest"):
    y0 = np.asarray(models.llama_forward(params, tokens, c))
    y1 = np.asarray(models.llama_forward(orbit_move(params, found), tokens, c))
  assert np.max(np.abs(y1 - y0)) < 1e-5 * np.max(np.abs(y0))


def abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def test_abstract_parameters_are_traced_and_reported_unconfirmed():
  c = dataclasses.replace(SMALL, stacked=True)
  forward = lambda p, t: models.llama_forward(p, t, c)  # noqa: E731
  tokens = models.tokens(0, 1, 8, c)
  found = discover(forward, abstract(small_init(c)), tokens)
  assert found.confirmation == "none" and len(found) == 0
  # Every candidate of the concrete run is listed, as unconfirmed for want of values.
  concrete = discover(forward, small_init(c), tokens)
  abstract_reason = {(r.a, r.b) for r in found.rejected if "abstract" in r.reason}
  assert {(p.a, p.b) for p in concrete} <= abstract_reason
  assert "Confirmation: not checked (abstract parameters)" in found.report()
  assert "confirmation='none'" in repr(found)


def test_tracers_are_parameters_too():
  params = {"up": jnp.ones((3, 4)), "down": jnp.ones((4, 2)), "flag": True}

  def mlp(p, x):
    return jax.nn.relu(x @ p["up"]) @ p["down"]

  seen = []
  jax.jit(lambda p: seen.append(discover(mlp, p, jnp.ones((2, 3)))) or 0)(
    {k: v for k, v in params.items() if k != "flag"}
  )
  (found,) = seen
  assert found.confirmation == "none"
  assert [(r.a, r.b) for r in found.rejected] == [("up", "down")]
  assert list(discover(mlp, params, jnp.ones((2, 3)))) == [
    saggs.Pair("up", "down", axes=(1, 0), name="ReLU MLP up/down (positive factors)")
  ]


def test_the_confirmation_is_part_of_the_result():
  assert Discovery().confirmation == "parameters"
  with pytest.raises(ValueError, match="confirmation must be one of"):
    Discovery(confirmation="maybe")
  assert Discovery(confirmation="none") != Discovery()


@pytest.mark.parametrize("stacked", [False, True])
def test_abstract_parameters_are_confirmed_on_a_reduced_copy(stacked):
  # A wider, deeper GQA LLaMA as shapes, confirmed on SMALL (2 KV heads of 4 query heads,
  # 3 layers): the pairs are the preset of the big one, with its own head counts.
  big = models.Config(
    vocab=48, d_model=128, num_layers=5, num_heads=8, num_kv_heads=4, head_dim=16, mlp_hidden=200
  )
  b, s = (dataclasses.replace(c, stacked=stacked) for c in (big, SMALL))
  found = discover(
    functools.partial(models.llama_forward, c=b),
    abstract(jax.eval_shape(lambda: models.llama_init(0, b))),
    models.tokens(0, 1, 8, b),
    reduced=(
      functools.partial(models.llama_forward, c=s),
      small_init(s),
      models.tokens(0, 1, 8, s),
    ),
  )
  assert found.confirmation == "reduced"
  assert unnamed(models.llama_pairs(b)) <= unnamed(found)
  assert len(found) == 6 and len(found.rejected) == 1  # norm gains too; the SiLU gate


def test_a_reduced_copy_of_another_head_structure_confirms_nothing_it_cannot_map():
  mha = dataclasses.replace(SMALL, num_kv_heads=4)  # per head here, per KV head in SMALL
  found = discover(
    lambda p, t: models.llama_forward(p, t, mha),
    abstract(jax.eval_shape(lambda: models.llama_init(0, mha))),
    models.tokens(0, 1, 8, mha),
    reduced=(lambda p, t: models.llama_forward(p, t, SMALL), small_init(SMALL), models.tokens()),
  )
  reasons = {(r.a, r.b): r.reason for r in found.rejected}
  assert "other groupings" in reasons["q_proj/kernel", "k_proj/kernel"]
  assert ("q_proj/kernel", "k_proj/kernel") not in {(p.a, p.b) for p in found}
