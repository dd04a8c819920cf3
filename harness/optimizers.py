"""The four optimizers of the comparison and the study: AdamW, Muon, the stack, the reference.

``make_optimizer(name, lr, config, args)`` builds one of ``OPTIMIZERS`` for the
example LM of :mod:`harness.lm`, on the warm-up + cosine schedule of
``schedule``. ``examples/compare_optimizers.py`` describes them and sweeps
their rates; :mod:`harness.study` tunes them over multiples of
``DEFAULT_LRS``. Like the rest of :mod:`harness`, not a stable API.

>>> import argparse
>>> from harness import lm, optimizers
>>> args = argparse.Namespace(steps=100, warmup=0.1, weight_decay=0.0, aux_lr=1e-2)
>>> lr = optimizers.schedule(0.05, args)  # the peak after 10% of the steps, 1/10 at the end
>>> print(f"{lr(0):g} {lr(10):g} {lr(100):g}")
0 0.05 0.005
>>> tx = optimizers.make_optimizer("stack", 0.05, lm.ModelConfig(), args)
>>> optimizers.floats("1e-3,3e-3")
(0.001, 0.003)
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any, Protocol

import optax

from saggs_jax import equivariant as eqv
from saggs_jax._src.equivariant import stack

OPTIMIZERS = ("adamw", "muon", "stack", "reference")
# Peak learning rates swept by default: for muon and stack the rate of the
# matrix rules (their updates have about unit spectral norm per block or unit
# norm per row, so rates are ~10x AdamW's). Centred on each optimizer's best
# rate at the default model size and 200 steps (a 4-rate pilot, seed 0; stack and
# reference: the 3-seed sweep in the docstring).
DEFAULT_LRS = {
  "adamw": (3e-3, 1e-2, 3e-2),
  "muon": (0.02, 0.05, 0.1),
  "stack": (0.02, 0.05, 0.1),
  "reference": (0.02, 0.05, 0.1),
}


class Heads(Protocol):
  """What ``make_optimizer`` reads of a model's config (``lm.ModelConfig``,
  ``moe.MoEConfig``)."""

  @property
  def num_heads(self) -> int: ...
  @property
  def num_kv_heads(self) -> int: ...
  @property
  def head_dim(self) -> int: ...


def floats(text: str) -> tuple[float, ...]:
  """``"1e-3,3e-3"`` -> ``(0.001, 0.003)``: a comma-separated flag of rates."""
  return tuple(float(x) for x in text.split(",") if x.strip())


def schedule(peak: float, args: argparse.Namespace) -> optax.Schedule:
  """Linear warm-up to ``peak``, then cosine decay to ``peak / 10`` at the last step."""
  return optax.warmup_cosine_decay_schedule(
    0.0, peak, max(1, int(args.warmup * args.steps)), args.steps, peak / 10
  )


def make_optimizer(
  name: str,
  lr: float,
  config: Heads,
  args: argparse.Namespace,
  roles: Mapping[str, Any] | None = None,
) -> optax.GradientTransformation:
  """``name`` (one of ``OPTIMIZERS``) at the peak rate ``lr``, for a model of ``config``'s heads.

  ``args`` holds ``steps``, ``warmup`` (a fraction of them), ``weight_decay``
  and ``aux_lr``: the AdamW rate of what Muon and the stack leave to AdamW
  (the norm gains). The reference preset scales all of Lau & Su's per-role
  rates so that the hidden matrices get ``lr``.

  ``roles`` (``saggs_jax.discover(...).roles``; default the dense LM's names) routes
  the stack and the reference preset, and gives Muon its matrices: the hidden ones
  (``role_dimension_numbers``: attention and MLP kernels, stacked experts batched per
  expert; embedding, LM head and router on Adam). Without it Muon takes every 2-D
  leaf, optax's default, which would leave 3-D stacked experts to Adam.
  """
  wd, aux = args.weight_decay, schedule(args.aux_lr, args)
  if name == "adamw":
    return optax.adamw(schedule(lr, args), weight_decay=wd)
  if name == "muon":
    dims = None if roles is None else (lambda params: eqv.role_dimension_numbers(params, roles))
    return optax.contrib.muon(
      schedule(lr, args),
      weight_decay=wd,
      adam_learning_rate=aux,
      adam_weight_decay=wd,
      muon_weight_dimension_numbers=dims,
    )
  heads: dict[str, Any] = {
    "decoder": eqv.Decoder(config.num_heads, config.num_kv_heads, config.head_dim),
    "patterns": roles,
  }
  if name == "reference":
    scale = lr / stack.REFERENCE_LEARNING_RATES["query"]
    return eqv.symmetry_compatible(
      preset="reference",
      **heads,
      learning_rates={
        r: schedule(v * scale, args) for r, v in stack.REFERENCE_LEARNING_RATES.items()
      },
      weight_decays={role: wd for role in stack.REFERENCE_WEIGHT_DECAYS},
    )
  return eqv.symmetry_compatible(
    schedule(lr, args),
    weight_decay=wd,
    learning_rates={"adamw": aux},
    weight_decays={"adamw": wd},
    **heads,
  )
