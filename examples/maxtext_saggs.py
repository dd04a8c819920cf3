"""MaxText 0.2.5 with SAGGS: MaxText's own optimizer, then pair balancing, in MaxText's own train
step and checkpoints, without replacing anything of MaxText's.

MaxText's ``train.train_loop`` builds its optimizer in ``train_utils.setup_train_loop``, which
calls ``train_utils.create_training_optimizer(config, model, mesh)``: ``opt_type`` picks one of
MaxText's own, and neither function takes an optimizer (``train_loop``'s ``state`` argument is
overwritten by ``setup_train_loop``'s). So :func:`train_loop` here is a thin driver that composes
the building blocks ``setup_train_loop`` and ``train_loop`` call, in their order, with
:func:`optimizer` in the optimizer's place:

    tx = saggs.chain(<MaxText's tx>, saggs.saggs(pairs(config), every=...))

``saggs.chain`` transports the moments of MaxText's optimizer with the parameters. MaxText's
``gradient_clipping_threshold`` clip moves inside that chain, before MaxText's tx, and MaxText's
own (outside the optimizer) is turned off: a global norm taken outside would differ between
equivalent states. The state is
part of MaxText's ``TrainStateNNX``, so MaxText's Orbax checkpoint manager saves and restores it
with everything else. Each step is MaxText's ``train.training_loop_iteration`` (its train step,
checkpoint saving, eval and metrics). What the driver does not compose (DiLoCo, LoRA, the
context-parallel reordering, the dropless MoE retry, TE MoE's overflow check) is refused with the
config key that asks for it.

  python examples/maxtext_saggs.py maxtext/configs/base.yml model_name=llama2-7b ...

The pairs: ``saggs.presets.maxtext(config)`` where it exists, else the per-layer declarations
of ``llama_pairs`` below (LLaMA-style decoders scanned with MaxText's default
``param_scan_axis=1``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import saggs_jax as saggs

Pairs = Callable[[Any], Sequence[saggs.Pair]]


def llama_pairs(config) -> list[saggs.Pair]:
  """Per layer (the layer axis at ``config.param_scan_axis``): Q/K and V/O per KV head, SwiGLU
  up/down per channel, and each RMSNorm gain against the rows it feeds."""
  stacked = (config.param_scan_axis,) if config.scan_layers else 0
  layer = "decoder/layers/" if config.scan_layers else "decoder/layers_*/"
  attn, kv = layer + "self_attention/", config.num_kv_heads
  return [
    saggs.Pair(attn + "query/kernel", attn + "key/kernel", axes=(1, 1), groups=kv, stacked=stacked),
    saggs.Pair(attn + "value/kernel", attn + "out/kernel", axes=(1, 0), groups=kv, stacked=stacked),
    saggs.Pair(layer + "mlp/wi_1/kernel", layer + "mlp/wo/kernel", axes=(1, 0), stacked=stacked),
    saggs.Pair(
      layer + "pre_self_attention_layer_norm/scale",
      tuple(attn + f"{x}/kernel" for x in ("query", "key", "value")),
      axes=(0, 0),
      stacked=stacked,
    ),
    saggs.Pair(
      layer + "post_self_attention_layer_norm/scale",
      (layer + "mlp/wi_0/kernel", layer + "mlp/wi_1/kernel"),
      axes=(0, 0),
      stacked=stacked,
    ),
  ]


def default_pairs(config) -> Sequence[saggs.Pair]:
  maxtext_preset = getattr(saggs.presets, "maxtext", None)
  return maxtext_preset(config) if maxtext_preset is not None else llama_pairs(config)


def optimizer(config, model, mesh=None, *, pairs: Pairs = default_pairs, **saggs_options):
  """``(schedule, tx)`` as MaxText's ``create_training_optimizer(config, model, mesh)`` returns
  them, with ``saggs.saggs(pairs(config), **saggs_options)`` chained after MaxText's tx, and
  MaxText's ``gradient_clipping_threshold`` clip first inside the chain (see :func:`unclipped`:
  the train step must then not clip again)."""
  import optax
  from maxtext.optimizers import optimizers
  from maxtext.utils import maxtext_utils

  schedule = maxtext_utils.create_learning_rate_schedule(config)
  tx = optimizers.get_optimizer(config, schedule, model, mesh=mesh)
  if config.gradient_clipping_threshold > 0:
    tx = optax.chain(optax.clip_by_global_norm(config.gradient_clipping_threshold), tx)
  return schedule, saggs.chain(tx, saggs.saggs(pairs(config), **saggs_options))


def unclipped(config):
  """``config`` with MaxText's own clip off: the train step clips the raw gradients by their
  global norm, which the pair rescalings change (``g / c`` on one side, ``g * c`` on the
  other), so equivalent states would be clipped by different factors and leave one
  trajectory. Inside the chain (:func:`optimizer`) the clip sees the gradient SAGGS has
  transported to the balanced point, the same for every member of an orbit."""
  from maxtext.configs import pyconfig

  if config.gradient_clipping_threshold <= 0:
    return config
  update = {"gradient_clipping_threshold": 0.0}
  return pyconfig.HyperParameters(config._pydantic_config.model_copy(update=update))


def _check_supported(config, mesh):
  from maxtext.utils import max_utils

  asks = {
    "enable_diloco": config.enable_diloco,
    "lora.enable_lora": getattr(getattr(config, "lora", None), "enable_lora", False),
    "moe_dropless_fallback='step'": config.moe_dropless_fallback == "step",
    "te_moe_block": getattr(config, "te_moe_block", False),
    "eval_ragged_buffer_factor": getattr(config, "eval_ragged_buffer_factor", 0) > 0,
    "context parallelism with reordering": max_utils.reordered_cp_size(config, mesh) > 1,
  }
  asked = [key for key, on in asks.items() if on]
  if asked:
    raise ValueError(f"maxtext_saggs.train_loop does not compose MaxText's {', '.join(asked)}")


def train_loop(config, recorder=None, *, pairs: Pairs = default_pairs, **saggs_options):
  """MaxText's ``train.train_loop(config, recorder)`` with :func:`optimizer`; returns the final
  ``TrainStateNNX``, as MaxText's. Resumes from MaxText's latest checkpoint when there is one."""
  import datetime

  import jax
  from flax import nnx
  from flax.core.spmd import logical_axis_rules
  from maxtext.common import checkpointing, metric_logger, profiler, train_state_nnx
  from maxtext.common.data_loader import create_dataloader
  from maxtext.input_pipeline.input_pipeline_interface import create_data_iterator
  from maxtext.trainers.pre_train import train
  from maxtext.utils import maxtext_utils, model_creation_utils, sharding, train_utils
  from maxtext.utils.rampup_batch import create_rampup_manager

  # train_utils.setup_train_loop, with our optimizer
  init_rng = jax.random.PRNGKey(config.init_weights_seed)
  mesh = maxtext_utils.get_mesh_from_config(config)
  _check_supported(config, mesh)
  create_model, model = model_creation_utils.create_nnx_abstract_model(config, mesh)
  schedule, tx = optimizer(config, model, mesh, pairs=pairs, **saggs_options)
  if config.gradient_clipping_threshold > 0:
    print(
      f"maxtext_saggs: gradient_clipping_threshold={config.gradient_clipping_threshold} clips"
      " inside the optimizer chain, before SAGGS; MaxText's own clip is off."
    )
  config = unclipped(config)  # what the train step sees

  def init_state_fn():
    model = create_model()
    return train_state_nnx.TrainStateNNX(model, nnx.Optimizer(model, tx, wrt=nnx.Param))

  checkpoint_manager = train_utils.create_checkpoint_manager(config, mesh, init_state_fn)
  data_iterator, eval_data_iterator = create_data_iterator(config, mesh)
  rampup_manager = create_rampup_manager(config, checkpoint_manager)
  data_loader = create_dataloader(config, mesh, data_iterator, recorder, rampup_manager)
  state, _, state_mesh_shardings, data_iterator, _ = maxtext_utils.setup_training_state(
    data_iterator, config, mesh, checkpoint_manager, init_state_fn
  )
  with logical_axis_rules(config.logical_axis_rules):
    state_graphdef = nnx.graphdef(nnx.eval_shape(init_state_fn))
  train_state = nnx.merge(state_graphdef, state)

  # train.train_loop, without the programs of the features _check_supported refuses
  start_step = train.get_first_step(train_state.model, train_state)
  train_utils.validate_completed_steps(start_step, config.steps)
  jit_model, state = nnx.split(train_state)
  params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(
    config, state_mesh_shardings
  )
  p_train_step, p_eval_step = train_utils.jit_train_and_eval_step(
    config, jit_model, mesh, state, state_mesh_shardings, train.train_step, train.eval_step,
    eval_data_iterator, params_shardings,
  )  # fmt: skip
  if config.shard_optimizer_over_data:
    with jax.set_mesh(mesh):
      state = jax.device_put(state, state_mesh_shardings)
  logger = metric_logger.MetricLogger(
    config=config, learning_rate_schedule=schedule, start_step=start_step
  )
  logger.write_setup_info_to_tensorboard(nnx.state(train_state.model, nnx.Param))
  device_state = dict(
    state=state, init_rng=init_rng, mesh=mesh, state_mesh_shardings=state_mesh_shardings,
    p_train_step=p_train_step, p_eval_step=p_eval_step, model=jit_model,
  )  # fmt: skip
  python_vars: dict[str, Any] = dict(
    step=start_step, last_step_completion=datetime.datetime.now(), data_loader=data_loader,
    rampup_manager=rampup_manager, recorder=recorder, checkpoint_manager=checkpoint_manager,
    data_iterator=data_iterator, eval_data_iterator=eval_data_iterator,
    metric_logger_instance=logger, prof=profiler.Profiler(config, offset_step=start_step),
  )  # fmt: skip
  keys = ("steps", "eval_interval", "eval_steps", "eval_start_step", "dump_hlo", "dump_step")
  keys += ("dump_hlo_local_dir", "dump_hlo_gcs_dir", "dump_hlo_module_name")
  keys += ("dump_hlo_delete_local_after", "dump_hlo_upload_all")
  immutable_data = {key: getattr(config, key) for key in keys} | dict(
    config=config, start_step=start_step, logical_axis_rules_for_train=config.logical_axis_rules,
    logical_axis_rules_for_eval=config.logical_axis_rules_for_eval,
  )  # fmt: skip
  try:
    while python_vars["step"] < config.steps:
      train.training_loop_iteration(device_state, python_vars, immutable_data)
      python_vars["step"] += 1
    if config.save_checkpoint_on_completion:
      checkpointing.maybe_save_checkpoint(
        checkpoint_manager, device_state["state"], config, data_iterator
      )
    if checkpoint_manager is not None:
      checkpointing.wait_until_finished(checkpoint_manager)
  finally:
    logger.flush_metrics_and_cleanup()
  return nnx.merge(jit_model, device_state["state"])


def main(argv: Sequence[str], *, pairs: Pairs = default_pairs, **saggs_options):
  """MaxText's ``train.main(argv)``: its ``initialize(argv)``, then :func:`train_loop`."""
  from maxtext.trainers.pre_train import train

  config, recorder = train.initialize(argv)
  return train_loop(config, recorder, pairs=pairs, **saggs_options)


if __name__ == "__main__":
  main([sys.argv[0], *sys.argv[1:]], every=100)
