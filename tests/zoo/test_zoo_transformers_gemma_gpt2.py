"""The zoo, transformers 4.x Flax: Gemma (MQA, (1 + w) norms) and GPT-2 (fused QKV), tiny configs with random weights.

Every check of ``zoo_oracle.CHECKS`` on each model; the models are built once per process.
"""

import functools

import pytest

pytestmark = pytest.mark.heavy  # run by .ci/run (pytest -m heavy), not by default

pytest.importorskip(
  "transformers", reason="the zoo extra is not installed: pip install -e '.[zoo]'"
)

import zoo_models  # noqa: E402
import zoo_oracle  # noqa: E402


@functools.cache
def model(name):
  return zoo_models.transformers_model(name)


@pytest.mark.parametrize("check", list(zoo_oracle.CHECKS))
@pytest.mark.parametrize("name", ["gemma", "gpt2"])
def test_transformers(name, check, tmp_path):
  zoo_oracle.CHECKS[check](model(name), tmp_path)


def test_gpt2_preset_moves_the_transformers_model_as_written_by_hand():
  """``presets.gpt2`` on FlaxGPT2LMHeadModel's own parameters (FlaxConv1D: kernels (out, in)):
  random factors move exactly the rows and columns a NumPy oracle moves, and the logits stay."""
  import numpy as np

  import saggs_jax as saggs

  zoo, hd = model("gpt2"), zoo_models.D // zoo_models.HEADS
  pairs = saggs.presets.gpt2(zoo_models.HEADS, prefix="transformer/h/*")
  rng, drawn = np.random.default_rng(5), {}
  moved, _ = saggs.reparameterize(
    zoo.params,
    None,
    pairs,
    lambda a, shape: drawn.setdefault(a, rng.uniform(0.3, 3.0, shape).astype(np.float32)),
  )
  want = zoo_oracle.leaves(zoo.params)
  for i in range(zoo_models.LAYERS):
    h = f"transformer/h/{i}/"
    qk, vo = (np.repeat(drawn.pop(f"{h}attn/c_attn/kernel[{p}]"), hd) for p in "qv")
    ln1, ln2 = drawn.pop(h + "ln_1/scale"), drawn.pop(h + "ln_2/scale")
    rows = np.concatenate([qk, 1 / qk, vo])  # c_attn's outputs: q, k, v heads
    want[h + "attn/c_attn/kernel"] *= rows[:, None] / ln1[None, :]
    want[h + "attn/c_attn/bias"] *= rows
    want[h + "attn/c_proj/kernel"] /= vo[None, :]  # its inputs: the heads' outputs
    want[h + "mlp/c_fc/kernel"] /= ln2[None, :]
    for leaf in ("scale", "bias"):
      want[f"{h}ln_1/{leaf}"] *= ln1
      want[f"{h}ln_2/{leaf}"] *= ln2
  assert not drawn  # no other instance
  got = zoo_oracle.leaves(moved)
  for path, value in want.items():
    np.testing.assert_allclose(got[path], value, rtol=1e-5, atol=1e-7, err_msg=path)
  assert zoo_oracle.deviation(zoo, moved) < zoo_oracle.EXACT
