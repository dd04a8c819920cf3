"""SAGGS in EasyDeL 0.3.0's own trainer through ``examples/easydel_saggs.py`` (tiny Qwen3, random
weights, CPU): two equivalent states (the second moved per KV head in NumPy, its Adam moments
transported by hand, outside the library) train identically with EasyDeL's clip firing on every
step, because the recipe clips inside the SAGGS chain; with the clip outside, where eformer's
factory puts it in front of any optimizer it is given, they part. A run resumed from EasyDeL's
checkpoint equals the uninterrupted one, and the symmetry-compatible stack routed by
``discover``'s roles trains. Needs .ci/zoo's EasyDeL venv
(``.ci/zoo-easydel-requirements.txt``): skipped where EasyDeL is not installed."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

# before easydel is first imported (by importorskip): see zoo_easydel
os.environ.setdefault("EASYDEL_AUTO", "0")

pytestmark = [
  pytest.mark.heavy,  # run by .ci/zoo (pytest -m heavy), not by default
  # EasyDeL 0.3.0's own: nnx `.value` reads, `with mesh:`, jax APIs jax 0.10 deprecates
  pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

pytest.importorskip(
  "easydel", reason="EasyDeL is not installed: see .ci/zoo-easydel-requirements.txt"
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import easydel_saggs  # noqa: E402
import saggs_jax as saggs  # noqa: E402
import zoo_easydel  # noqa: E402

# Far below the tiny Qwen3's global gradient norms (recorded): the clip fires on every step.
THRESHOLD = 1e-3
STEPS = 5
DATA = easydel_saggs.dataset(64, 16)


@pytest.fixture
def clip_norms(monkeypatch):
  """The global norms that every ``optax.clip_by_global_norm`` built during the test sees in
  the train step (eformer's factory and the recipe call it by that name); the SAGGS chain's
  degree probe, which runs the optimizer on a small proxy of the parameters, is left out."""
  norms, clip = [], optax.clip_by_global_norm
  size = sum(x.size for x in jax.tree.leaves(easydel_saggs.params_of(_fresh_state())))

  def recording(max_norm):
    inner = clip(max_norm)

    def update(updates, state, params=None):
      if sum(x.size for x in jax.tree.leaves(updates)) == size:
        jax.debug.callback(lambda n: norms.append(float(n)), optax.global_norm(updates))
      return inner.update(updates, state, params)

    return optax.GradientTransformation(inner.init, update)

  monkeypatch.setattr(optax, "clip_by_global_norm", recording)
  return norms


def _fresh_state():
  return easydel_saggs.tiny_qwen3().to_state()


def _trainer(root, name, steps, cls=easydel_saggs.SaggsTrainer, state=None, **options):
  model = {"model_state": state} if state is not None else {"model": easydel_saggs.tiny_qwen3()}
  arguments = easydel_saggs.arguments(root / name, steps, clip_grad=THRESHOLD)
  return cls(arguments, dataset_train=DATA, **model, **options)


def _pairs():
  return easydel_saggs.qwen3_pairs(easydel_saggs.tiny_qwen3().config)


def _params(state):
  return easydel_saggs.params_of(state)


def _names(path):
  return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def _moved(state, rng):
  """``state`` moved along the V/O orbit per layer and KV head, in NumPy: value columns of KV
  head g times c_g, the output rows of the query heads that read it over c_g; Adam's moments
  of value by c^-1 (mu) and c^-2 (nu), of output by c and c^2."""
  kv, heads, hd = zoo_easydel.KV, zoo_easydel.HEADS, zoo_easydel.HD
  c = np.exp(rng.uniform(-np.log(4), np.log(4), (zoo_easydel.LAYERS, kv)))
  value = np.repeat(c, hd, axis=1)  # (layers, kv * hd): v_proj's columns
  output = np.repeat(1 / c, heads // kv * hd, axis=1)  # (layers, heads * hd): o_proj's rows

  def move(path, x):
    names = _names(path)
    proj = next((n for n in names if n in ("v_proj", "o_proj")), None)
    if proj is None or "kernel" not in names:
      return x
    layer = int(names[names.index("layers") + 1])
    f = value[layer][None, :] if proj == "v_proj" else output[layer][:, None]
    k = {"mu": -1, "nu": -2}.get(next((n for n in names if n in ("mu", "nu")), ""), 1)
    return jnp.asarray((np.asarray(x, np.float64) * f**k).astype(x.dtype))

  state = _copy(state)
  moved = jax.tree_util.tree_map_with_path(move, (state.graphstate, state.opt_state))
  return state.replace(graphstate=moved[0], opt_state=moved[1], tx=None)


def _copy(state):
  """Every array of an ``EasyDeLState`` copied: the trainer donates the state it trains."""
  return jax.tree.map(lambda x: jnp.array(x, copy=True), state)


def _gap(a, b):
  return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


class ClipOutside(easydel_saggs.SaggsTrainer):
  """The control: EasyDeL's clip in front of the SAGGS chain, as eformer's factory puts it in
  front of any optimizer it builds (``chain(clip, <SAGGS over AdamW>, weight decay)``)."""

  def configure_model(self):
    kwargs = self.arguments.optimizer_kwargs
    self.arguments.optimizer_kwargs = {**kwargs, "clip_grad": None}
    try:
      unclipped, scheduler = self.arguments.get_optimizer_and_scheduler(self.max_training_steps)
    finally:
      self.arguments.optimizer_kwargs = kwargs
    balanced = saggs.chain(unclipped, saggs.saggs(self._saggs["pairs"], every=1))
    tx = easydel_saggs.checkpointable(optax.chain(optax.clip_by_global_norm(THRESHOLD), balanced))
    return easydel_saggs.TrainerConfigureModelOutput(
      model=self.model, tx=tx, scheduler=scheduler, config=self.model.config
    )


def _outside(state):
  """The recipe's opt_state, ((clip, adamw, weight decay), stage), as the control holds it:
  (clip, ((adamw, weight decay), stage))."""
  state = _copy(state)
  (clip, adamw, decay), stage = state.opt_state
  return state.replace(opt_state=(clip, ((adamw, decay), stage)), tx=None)


def test_example_pairs_are_the_zoos():
  # tests/test_zoo_easydel.py checks zoo_easydel.qwen3() exact on EasyDeL's logits
  assert _pairs() == zoo_easydel.qwen3()


def test_equivalent_states_train_identically_with_the_clip_firing(tmp_path, clip_norms):
  pairs = _pairs()
  # one step of the recipe (Adam's moments nonzero), saved by EasyDeL and resumed from there
  _trainer(tmp_path, "a", 1, pairs=pairs).train()
  resumed = _trainer(tmp_path, "a", STEPS, pairs=pairs)
  start = resumed.model_state
  b = _moved(start, np.random.default_rng(0))
  assert _gap(_params(start), _params(b)) > 0.1  # a real move
  start_out, b_out = _outside(start), _outside(b)  # for the control, before A's arrays go
  del clip_norms[:]
  a_end = resumed.train().state
  b_end = _trainer(tmp_path, "b", STEPS, state=b, pairs=pairs).train().state
  assert len(clip_norms) == 2 * (STEPS - 1) and min(clip_norms) > 100 * THRESHOLD, clip_norms
  gap = _gap(_params(a_end), _params(b_end))
  assert gap < 1e-5, gap  # measured 2.8e-7

  # The control: the clip in front of the SAGGS chain sees the two states' raw gradients,
  # whose global norms differ, scales them by different factors, and the runs part.
  del clip_norms[:]
  a_end = _trainer(tmp_path, "a_out", STEPS, ClipOutside, start_out, pairs=pairs).train().state
  b_end = _trainer(tmp_path, "b_out", STEPS, ClipOutside, b_out, pairs=pairs).train().state
  assert len(clip_norms) == 2 * (STEPS - 1) and min(clip_norms) > 100 * THRESHOLD, clip_norms
  raw = np.reshape(clip_norms, (2, STEPS - 1))
  assert abs(raw[0, 0] - raw[1, 0]) > 1e-3 * raw[0, 0], raw  # A's and B's raw norms differ
  gap = _gap(_params(a_end), _params(b_end))
  assert gap > 1e-4, gap  # measured 7.6e-3 (raw norms 1.37 and 1.48 at the first step)


def test_resume_from_easydel_checkpoint_is_the_uninterrupted_run(tmp_path):
  pairs = _pairs()
  full = _trainer(tmp_path, "full", 4, pairs=pairs).train().state
  shutil.copytree(tmp_path / "full", tmp_path / "resumed")
  for checkpoint in (tmp_path / "resumed").glob("*/run-*"):
    if int(checkpoint.name.split("-")[1]) > 2:
      shutil.rmtree(checkpoint)
  trainer = _trainer(tmp_path, "resumed", 4, pairs=pairs)
  assert trainer._resumed_from_checkpoint and int(trainer.model_state.step) == 2
  resumed = trainer.train().state
  assert int(resumed.step) == 4
  for x, y in zip(jax.tree.leaves((full.graphstate, full.opt_state)), jax.tree.leaves(
    (resumed.graphstate, resumed.opt_state)
  )):  # fmt: skip
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  stage = resumed.opt_state[1]
  assert int(stage.step) == 4 and all(":" in key and "/" not in key for key in stage.factors)


def test_a_resume_that_loses_the_state_is_refused(tmp_path):
  pairs = _pairs()
  _trainer(tmp_path, "run", 1, pairs=pairs[:1]).train()
  # more pairs than the checkpoint has factors for: EasyDeL's optimizer restore misses arrays,
  # and EasyDeL logs it and goes on from the saved step with a fresh optimizer state
  with pytest.raises(RuntimeError, match="could not restore the optimizer state"):
    _trainer(tmp_path, "run", 2, pairs=pairs)
  # a checkpoint without its weights: EasyDeL logs that the resume failed and starts afresh
  shutil.rmtree(next((tmp_path / "run").glob("*/run-1")) / "model")
  with pytest.raises(RuntimeError, match="did not resume"):
    _trainer(tmp_path, "run", 2, pairs=pairs[:1])


def test_the_symmetry_compatible_stack_trains(tmp_path, clip_norms):
  model = easydel_saggs.tiny_qwen3()
  found = easydel_saggs.discover(model, jnp.zeros((1, 8), jnp.int32))
  assert set(found.roles) == set(zoo_easydel.ROLES["qwen3"])
  before = easydel_saggs.loss(model.to_state(), DATA)
  trainer = easydel_saggs.SaggsTrainer(
    easydel_saggs.arguments(tmp_path / "stack", 8, learning_rate=3e-2),
    model=model,
    dataset_train=DATA,
    base=easydel_saggs.stack(found.roles, head_dim=zoo_easydel.HD),
  )
  state = trainer.train().state
  assert len(clip_norms) == 8  # EasyDeL's clip_grad, inside the chain
  after = easydel_saggs.loss(state, DATA)
  assert after < before - 0.5, (before, after)


def test_the_documented_command_runs(tmp_path):
  # docs/easydel.md's command, at smoke size (tests/test_examples.py cannot run it: no EasyDeL)
  root = os.path.join(os.path.dirname(__file__), "..", "..")
  env = dict(os.environ, SAGGS_SMOKE="1", EASYDEL_AUTO="0")
  done = subprocess.run(
    [sys.executable, "examples/easydel_saggs.py", "--out", str(tmp_path)],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert "resumed from the checkpoint of step 2: parameters 0.0e+00 apart" in done.stdout, (
    done.stdout
  )
