"""EasyDeL 0.3.0 with SAGGS: EasyDeL's own trainer, optimizer factory and checkpoints, with pair
balancing after EasyDeL's optimizer and EasyDeL's gradient clip inside the balanced chain.

EasyDeL's trainer takes its optimizer from ``BaseTrainer.configure_model``, which calls
``arguments.get_optimizer_and_scheduler(steps)`` (eformer's ``OptimizerFactory``: the optax chain
``clip_by_global_norm(clip_grad)``, the optimizer, the scheduled weight decay). A custom optax
transformation enters through a subclass that overrides ``configure_model``; :class:`SaggsTrainer`
is that subclass:

    tx = saggs.chain(<EasyDeL's chain: clip, optimizer, weight decay>, saggs.saggs(pairs, ...))

``saggs.chain`` balances the parameters and transports the incoming gradient and the moments
before it runs EasyDeL's chain, so EasyDeL's clip sees the gradient at the balanced point, the
same for every member of an orbit (a global norm taken before the balancing would not be: the
pair rescalings move ``g`` to ``g / c`` on one side and ``g * c`` on the other). With ``base=``,
another optimizer (the symmetry-compatible stack) takes the place of EasyDeL's, still behind
EasyDeL's clip. The state is EasyDeL's ``EasyDeLState.opt_state``: EasyDeL's checkpointing
saves it (:func:`checkpointable`: no ``/`` in its keys), and resuming restores it into the
structure of this optimizer (EasyDeL builds its restore template from
``arguments.get_tx_template()``, which the trainer points here) and onto the model given
(EasyDeL's resume rebuilds the model from the checkpoint's config, which loses settings).

  python examples/easydel_saggs.py

trains a tiny Qwen3 (random weights, CPU) a few steps in EasyDeL's trainer with EasyDeL's
``clip_grad`` on: AdamW with SAGGS (saving EasyDeL checkpoints, then resuming from the middle
one to the same end), and the symmetry-compatible stack routed by ``saggs.discover``'s roles.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# EasyDeL rewrites XLA_FLAGS with GPU-only flags at import unless EASYDEL_AUTO=0; jaxlib 0.10+
# rejects them on a CPU and the process aborts
os.environ.setdefault("EASYDEL_AUTO", "0")

import easydel as ed  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from easydel.trainers.trainer_protocol import TrainerConfigureModelOutput  # noqa: E402
from flax import nnx  # noqa: E402

import saggs_jax as saggs  # noqa: E402

Base = Callable[[optax.Schedule], optax.GradientTransformation]

ATTN = "self_attn/"


def qwen3_pairs(config) -> list[saggs.Pair]:
  """EasyDeL's Qwen3 (Flax ``(in, out)`` kernels, ``model/layers/<i>/...``): V/O per KV head,
  the q_norm/k_norm gains (one factor per layer: QK-norm makes Q and K each scale-invariant, so
  no Q/K pair), SwiGLU up/down per channel, and each RMSNorm gain against the rows it feeds."""
  return [
    saggs.Pair(
      ATTN + "v_proj/kernel", ATTN + "o_proj/kernel", axes=(1, 0), groups=config.num_key_value_heads
    ),
    saggs.Pair(ATTN + "q_norm/kernel", ATTN + "k_norm/kernel", axes=(0, 0), groups=1),
    saggs.Pair("mlp/up_proj/kernel", "mlp/down_proj/kernel", axes=(1, 0)),
    saggs.Pair(
      "input_layernorm/kernel", tuple(ATTN + f"{x}_proj/kernel" for x in "qkv"), axes=(0, 0)
    ),
    saggs.Pair(
      "post_attention_layernorm/kernel", ("mlp/gate_proj/kernel", "mlp/up_proj/kernel"), axes=(0, 0)
    ),
    saggs.Pair("model/norm/kernel", "lm_head/kernel", axes=(0, 0)),
  ]


def _check_supported(arguments):
  if getattr(arguments, "pruning_module", None) is not None:
    # EasyDeL wraps the whole optimizer in the pruning module, outside the SAGGS chain
    raise ValueError("easydel_saggs does not compose EasyDeL's pruning_module")


def optimizer(
  arguments,
  steps: int | None = None,
  *,
  pairs: Sequence[saggs.Pair] = (),
  every: int = 1,
  base: Base | None = None,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """``(tx, scheduler)`` as ``arguments.get_optimizer_and_scheduler(steps)`` returns them, with
  ``saggs.saggs(pairs, every)`` chained after EasyDeL's optimizer (none when ``pairs`` is
  empty). ``base(scheduler)``, when given, replaces EasyDeL's optimizer and weight decay;
  EasyDeL's ``clip_grad`` clip stays first inside the chain either way."""
  _check_supported(arguments)
  tx, scheduler = arguments.get_optimizer_and_scheduler(steps)
  if base is not None:
    clip = arguments.clip_grad
    tx = base(scheduler)
    if clip:  # where eformer's factory puts it: first in the chain
      tx = optax.chain(optax.clip_by_global_norm(clip), tx)
  if len(pairs):
    tx = saggs.chain(tx, saggs.saggs(pairs, every=every))
  return checkpointable(tx), scheduler


SLASH, STAND_IN = "/", ":"


def _rekey(tree, old: str, new: str):
  """``tree`` with ``old`` replaced by ``new`` in the keys of its plain dicts (tuples and
  NamedTuples rebuilt around them; anything else, nnx states included, kept as it is)."""
  if type(tree) is dict:
    clash = [k for k in tree if isinstance(k, str) and new in k]
    if clash:
      raise ValueError(f"easydel_saggs: state key {clash[0]!r} already holds {new!r}")
    return {
      (k.replace(old, new) if isinstance(k, str) else k): _rekey(v, old, new)
      for k, v in tree.items()
    }
  if isinstance(tree, tuple):
    items = [_rekey(x, old, new) for x in tree]
    return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
  return tree


def checkpointable(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """``tx`` with no ``/`` in the keys of its state's dicts (written ``:``). EasyDeL's
  TensorStore checkpointer (eformer 0.0.99) stores each array under a path made from its keys
  and cannot read a key holding ``/`` back (``TensorStore index keys mismatch``); the SAGGS
  stage keys its factors by the pair's parameter paths."""

  def init(params):
    return _rekey(tx.init(params), SLASH, STAND_IN)

  def update(updates, state, params=None, **extra):
    updates, state = tx.update(updates, _rekey(state, STAND_IN, SLASH), params, **extra)
    return updates, _rekey(state, SLASH, STAND_IN)

  return optax.GradientTransformationExtraArgs(init, update)


class SaggsTrainer(ed.Trainer):
  """EasyDeL's ``Trainer`` with :func:`optimizer` in place of EasyDeL's: ``SaggsTrainer(arguments,
  model=..., dataset_train=..., pairs=..., every=..., base=...)``; everything else (the train
  step, data, checkpoints, resuming) is EasyDeL's."""

  def __init__(
    self,
    arguments,
    *args,
    pairs: Sequence[saggs.Pair] = (),
    every: int = 1,
    base: Base | None = None,
    **kwargs,
  ):
    self._saggs = dict(pairs=pairs, every=every, base=base)
    _check_supported(arguments)
    # EasyDeL resumes inside BaseTrainer.__init__, restoring opt_state into the structure of
    # arguments.get_tx_template(), its own optimizer, not this one (the restore would fail and
    # EasyDeL would go on with a fresh optimizer state): the template is this optimizer
    arguments.get_tx_template = self._template
    model = kwargs.get("model")
    self._given = model.to_state() if model is not None else kwargs["model_state"]
    super().__init__(arguments, *args, **kwargs)
    if arguments.resume_if_possible and not self._resumed_from_checkpoint:
      # EasyDeL logs a failed resume as a warning and trains from the start: refused here
      from eformer.serialization.checkpointer import find_latest_checkpoint

      latest = find_latest_checkpoint(str(arguments._get_save_directory(create=False)))
      if latest is not None:
        raise RuntimeError(f"easydel_saggs: EasyDeL did not resume from {latest} (see its log)")

  def __setattr__(self, name: str, value: Any) -> None:
    # EasyDeL's resume (in BaseTrainer.__init__) rebuilds the model from the checkpoint's
    # config.json, which leaves out some of the given model's settings (attn_dtype and
    # attn_softmax_dtype among them): on the same parameters and batch the resumed model's loss
    # differs in the sixth digit, and Adam's steps carry that into the parameters. Only the
    # restored arrays are taken; the model stays the one given.
    given = self.__dict__.get("_given")
    if (
      name == "model_state" and given is not None and self.__dict__.get("_resumed_from_checkpoint")
    ):
      if value.opt_state is None:  # EasyDeL would go on with fresh moments at the saved step
        raise RuntimeError(
          "easydel_saggs: EasyDeL resumed the parameters but could not restore the optimizer"
          " state into this optimizer's structure (see its log)"
        )
      value = given.replace(graphstate=value.graphstate, opt_state=value.opt_state, step=value.step)
      del self.__dict__["_given"]
    super().__setattr__(name, value)

  def _template(self, possible_max: int | None = None) -> optax.GradientTransformation:
    return optimizer(self.arguments, possible_max or 2**63 - 1, **self._saggs)[0]

  def configure_model(self) -> TrainerConfigureModelOutput:
    tx, scheduler = optimizer(self.arguments, self.max_training_steps, **self._saggs)
    return TrainerConfigureModelOutput(
      model=self.model, tx=tx, scheduler=scheduler, config=self.model.config
    )


def discover(model, tokens: jax.Array) -> saggs.discovery.Discovery:
  """``saggs.discover`` on an EasyDeL model's parameters (``nnx.state(model, nnx.Param)``):
  its ``roles`` route ``equivariant.symmetry_compatible``, its pairs feed ``saggs.saggs``."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def apply(params, ids):
    with model.mesh:  # EasyDeL's sharding constraints look the mesh up here
      return nnx.merge(graphdef, params, rest, copy=True)(input_ids=ids).logits

  return saggs.discover(apply, params, tokens)


def stack(roles: Mapping[str, Any], head_dim: int, weight_decay: float = 0.0, **options) -> Base:
  """``base`` for :func:`optimizer`: the symmetry-compatible stack routed by ``roles``, on
  EasyDeL's learning-rate schedule."""
  return lambda scheduler: saggs.equivariant.symmetry_compatible(
    scheduler,
    patterns=roles,
    decoder=saggs.equivariant.Decoder(head_dim=head_dim),
    weight_decay=weight_decay,
    **options,
  )


# ---------------------------------------------------------------------------------------------
# The demonstration: a tiny Qwen3 with random weights, on the CPU


def tiny_qwen3(layers: int = 2, seed: int = 0):
  """EasyDeL's Qwen3 from a tiny config, float32, vanilla attention."""
  config = ed.Qwen3Config(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=layers,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    # vanilla attention in float32 (its dtype defaults to bfloat16), given here, not set on the
    # config afterwards: EasyDeL writes only the constructor's settings into a checkpoint's
    # config.json, and a resumed run would otherwise compute attention in bfloat16
    attn_mechanism="vanilla",
    attn_dtype=jnp.float32,
    attn_softmax_dtype=jnp.float32,
  )
  return ed.Qwen3ForCausalLM(
    config, dtype=jnp.float32, param_dtype=jnp.float32, precision="highest", rngs=nnx.Rngs(seed)
  )


def dataset(rows: int, length: int, vocab: int = 64, seed: int = 0):
  """A Hugging Face dataset of ``rows`` token sequences with a pattern a model can learn (each
  token the previous one plus one, from a random start)."""
  import datasets

  start = np.random.default_rng(seed).integers(0, vocab, (rows, 1))
  ids = ((start + np.arange(length)) % vocab).astype(np.int32)
  return datasets.Dataset.from_dict(
    {"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist()}
  )


def arguments(directory, steps: int, *, clip_grad: float = 1.0, **overrides):
  """EasyDeL's ``TrainingArguments`` for the tiny runs: AdamW, a clip, a checkpoint per step."""
  settings = dict(
    save_directory=str(directory),
    max_training_steps=steps,
    total_batch_size=4,
    max_length=16,
    learning_rate=1e-2,
    weight_decay=0.01,
    clip_grad=clip_grad,
    save_steps=1,
    use_wandb=False,
    report_metrics=False,
    shuffle_train_dataset=False,
    progress_bar_type="json",
  )
  return ed.TrainingArguments(**(settings | overrides))


def params_of(state) -> dict:
  """The parameters of an ``EasyDeLState`` as a pure dict of NumPy arrays."""
  return jax.tree.map(np.asarray, nnx.to_pure_dict(state.graphstate))


def loss(model_state, data) -> float:
  """Mean next-token cross-entropy of ``model_state``'s model on ``data``."""
  ids = jnp.asarray(data["input_ids"])
  model = model_state.model
  with model.mesh:
    logits = model(input_ids=ids).logits
  return float(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean())


def main(argv: Sequence[str] | None = None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--clip-grad", type=float, default=1.0, help="EasyDeL's clip_grad")
  parser.add_argument("--out", type=pathlib.Path, default=None, help="checkpoints (default: tmp)")
  args = parser.parse_args(argv)
  if os.environ.get("SAGGS_SMOKE"):
    args.steps = min(args.steps, 4)
  out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="easydel_saggs_"))
  data = dataset(64, 16)
  model = tiny_qwen3()
  pairs = qwen3_pairs(model.config)
  before = loss(model.to_state(), data)

  def run(name, steps, learning_rate=1e-2, **options):
    trainer = SaggsTrainer(
      arguments(out / name, steps, clip_grad=args.clip_grad, learning_rate=learning_rate),
      model=tiny_qwen3(),
      dataset_train=data,
      **options,
    )
    return trainer.train().state

  full = run("saggs", args.steps, pairs=pairs, every=1)
  # the same run, resumed from EasyDeL's checkpoint of its middle step
  half = args.steps // 2
  shutil.copytree(out / "saggs", out / "resumed")
  for checkpoint in (out / "resumed").glob("*/run-*"):
    if int(checkpoint.name.split("-")[1]) > half:
      shutil.rmtree(checkpoint)
  resumed = run("resumed", args.steps, pairs=pairs, every=1)
  gap = max(
    float(np.max(np.abs(a - b)))
    for a, b in zip(jax.tree.leaves(params_of(full)), jax.tree.leaves(params_of(resumed)))
  )
  roles = discover(model, jnp.zeros((1, 8), jnp.int32)).roles
  base = stack(roles, head_dim=model.config.head_dim)
  stacked = run("stack", args.steps, learning_rate=3e-2, base=base)
  print(f"EasyDeL's clip_grad={args.clip_grad}, inside the chain; loss at the start: {before:.2f}")
  print(f"AdamW + SAGGS (every=1), {args.steps} steps: loss {loss(full, data):.2f}")
  print(f"resumed from the checkpoint of step {half}: parameters {gap:.1e} apart from the above")
  print(f"symmetry-compatible stack, {args.steps} steps: loss {loss(stacked, data):.2f}")
  print("roles:", {role: list(p) for role, p in roles.items()})
  return full, resumed, stacked


if __name__ == "__main__":
  main()
