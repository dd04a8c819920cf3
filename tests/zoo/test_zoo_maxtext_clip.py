"""MaxText's gradient clip through ``examples/maxtext_saggs.py``'s driver: two equivalent MaxText
checkpoints (the second moved per KV head in NumPy, its Adam moments transported by hand,
outside the library) resume to one trajectory under hard SAGGS with the clip firing on every
step, because the driver clips inside the chain; clipping outside, as MaxText's own train step
does, they part. Needs .ci/zoo's venv: skipped where MaxText is not installed."""

import os
import shutil
import sys

import numpy as np
import optax
import pytest

pytestmark = pytest.mark.heavy  # run by .ci/zoo (pytest -m heavy), not by default

pytest.importorskip("maxtext", reason="MaxText is not installed: see .ci/zoo maxtext")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

import maxtext_saggs  # noqa: E402
import zoo_maxtext  # noqa: E402

# Far below the tiny llama2's raw global gradient norms (the control records them): the clip
# fires on every step.
THRESHOLD = 1e-3


def _settings(root, run_name, steps):
  return dict(
    steps=steps,
    dataset_type="synthetic",
    learning_rate=1e-2,
    enable_checkpointing=True,
    async_checkpointing=False,
    checkpoint_period=1,
    enable_tensorboard=False,
    base_output_directory=str(root),
    run_name=run_name,
    gradient_clipping_threshold=THRESHOLD,
  )


def _moved(tree, rng):
  """``tree`` (a MaxText checkpoint's arrays) moved along the Q/K orbit per layer and KV head:
  query heads of KV head g times c_g, key head g over c_g; the moments of query by c^-1 (mu)
  and c^-2 (nu), of key by c and c^2."""
  kv = zoo_maxtext.KV
  c = np.exp(rng.uniform(-np.log(4), np.log(4), (zoo_maxtext.LAYERS, kv)))
  per_query = np.repeat(c, zoo_maxtext.HEADS // kv, axis=1)  # (layers, heads)

  def move(path, x):
    names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    if names[-1] != "kernel" or names[-2] not in ("query", "key"):
      return x
    f = per_query if names[-2] == "query" else 1 / c  # (layers, heads): axes 1 and 2
    k = {"mu": -1, "nu": -2}.get(next((n for n in names if n in ("mu", "nu")), ""), 1)
    return (np.asarray(x, np.float64) * f[None, :, :, None] ** k).astype(x.dtype)

  import jax

  return jax.tree_util.tree_map_with_path(move, tree)


def _resume(root, run_name, steps):
  """Run ``run_name`` from its checkpoint 0 to ``steps``."""
  checkpoints = os.path.join(str(root), run_name, "checkpoints")
  for step in os.listdir(checkpoints):
    if step != "0":
      shutil.rmtree(os.path.join(checkpoints, step))
  state = maxtext_saggs.train_loop(
    zoo_maxtext.config("llama2", **_settings(root, run_name, steps)),
    pairs=maxtext_saggs.llama_pairs,
    every=1,
  )
  from flax import nnx

  return nnx.to_pure_dict(nnx.state(state, nnx.Param))["model"]


def _equivalent_checkpoints(root):
  """Runs "a" for one step (checkpoint 0) and writes run "b"'s checkpoint 0, the same state
  moved along the orbit."""
  import orbax.checkpoint as ocp

  maxtext_saggs.train_loop(
    zoo_maxtext.config("llama2", **_settings(root, "a", 1)),
    pairs=maxtext_saggs.llama_pairs,
    every=1,
  )
  a, b = (os.path.join(str(root), run, "checkpoints", "0") for run in ("a", "b"))
  tree = ocp.PyTreeCheckpointer().restore(os.path.join(a, "items"))
  os.makedirs(b)
  ocp.PyTreeCheckpointer().save(os.path.join(b, "items"), _moved(tree, np.random.default_rng(0)))
  for name in ("_CHECKPOINT_METADATA", "commit_success.txt"):
    shutil.copy(os.path.join(a, name), os.path.join(b, name))


# MaxText 0.2.5's train loop calls jax APIs that jax 0.11 deprecates: MaxText's, not ours
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
# Orbax reads the test's own copy of MaxText's checkpoint on the one CPU it was written on
@pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring:UserWarning")
def test_equivalent_checkpoints_train_identically_with_the_clip_firing(tmp_path, monkeypatch):
  from maxtext.trainers.pre_train import train  # noqa: F401 (loads what the driver uses)

  _equivalent_checkpoints(tmp_path)
  a, b = _resume(tmp_path, "a", 5), _resume(tmp_path, "b", 5)
  import jax

  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6)

  # The control: MaxText's own clip, outside the optimizer, scales the two states' gradients
  # by different factors (their global norms differ), and the runs part.
  monkeypatch.setattr(maxtext_saggs, "unclipped", lambda config: config)
  real = maxtext_saggs.optimizer

  def without_inside_clip(config, *args, **kwargs):
    from maxtext.configs import pyconfig

    update = {"gradient_clipping_threshold": 0.0}
    off = pyconfig.HyperParameters(config._pydantic_config.model_copy(update=update))
    return real(off, *args, **kwargs)

  monkeypatch.setattr(maxtext_saggs, "optimizer", without_inside_clip)
  from maxtext.utils import maxtext_utils

  norms, clip = [], maxtext_utils.apply_gradient_clipping

  def recording(raw_grads, state, threshold):  # the raw global norms MaxText's clip sees
    jax.debug.callback(lambda n: norms.append(float(n)), optax.global_norm(raw_grads))
    return clip(raw_grads, state, threshold)

  monkeypatch.setattr(maxtext_utils, "apply_gradient_clipping", recording)
  a, b = _resume(tmp_path, "a", 5), _resume(tmp_path, "b", 5)
  assert len(norms) == 8 and min(norms) > 100 * THRESHOLD, norms  # it clipped every step
  gap = max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  assert gap > 1e-4, gap  # measured 2.8e-3 (2.5e-7 with the clip inside)
