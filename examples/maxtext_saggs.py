"""MaxText 0.2.5 with SAGGS: MaxText's own optimizer, then pair balancing, in MaxText's own train
loop and checkpoints.

MaxText builds its optimizer in ``maxtext.utils.train_utils.create_training_optimizer(config,
model, mesh)`` from ``opt_type``; 0.2.5 offers no setting that names another. This adapter
keeps MaxText's optimizer (adamw, muon, ... as configured) and chains SAGGS after it:

    tx = saggs.chain(<MaxText's tx>, saggs.saggs(pairs(config), every=...))

``saggs.chain`` transports the moments of MaxText's optimizer with the parameters. The state is
part of MaxText's ``TrainStateNNX``, so MaxText's Orbax checkpointing saves and restores it
with everything else. :func:`training_optimizer` is the optimizer slot's function itself;
:func:`train` runs MaxText's ``train.main`` with it in the slot for the duration of the call
(MaxText's module attribute is swapped and restored: no file of MaxText is changed).

  python examples/maxtext_saggs.py maxtext/configs/base.yml model_name=llama2-7b ...

The pairs: ``saggs.presets.maxtext(config)`` where it exists, else the per-layer declarations
of ``PAIRS`` below (LLaMA-style decoders scanned with MaxText's default ``param_scan_axis=1``).
"""

from __future__ import annotations

import contextlib
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


def training_optimizer(pairs: Pairs = default_pairs, **saggs_options) -> Callable:
  """A ``create_training_optimizer(config, model, mesh=None)`` for MaxText's slot: MaxText's
  schedule and optimizer, with ``saggs.saggs(pairs(config), **saggs_options)`` chained after."""
  from maxtext.optimizers import optimizers
  from maxtext.utils import maxtext_utils

  def create_training_optimizer(config, model, mesh=None):
    schedule = maxtext_utils.create_learning_rate_schedule(config)
    tx = optimizers.get_optimizer(config, schedule, model, mesh=mesh)
    return schedule, saggs.chain(tx, saggs.saggs(pairs(config), **saggs_options))

  return create_training_optimizer


@contextlib.contextmanager
def in_slot(create_training_optimizer: Callable):
  """MaxText's trainers build their optimizer with ``create_training_optimizer`` inside this
  block; MaxText's own function is back after it."""
  from maxtext.utils import train_utils

  original = train_utils.create_training_optimizer
  train_utils.create_training_optimizer = create_training_optimizer
  try:
    yield
  finally:
    train_utils.create_training_optimizer = original


def train(argv: Sequence[str], pairs: Pairs = default_pairs, **saggs_options):
  """MaxText's ``train.main(argv)`` with SAGGS; returns nothing, as MaxText's."""
  from maxtext.trainers.pre_train import train as maxtext_train

  with in_slot(training_optimizer(pairs, **saggs_options)):
    maxtext_train.main(argv)


if __name__ == "__main__":
  train([sys.argv[0], *sys.argv[1:]], every=100)
