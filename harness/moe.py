r"""A small OLMoE-style MoE byte LM and the quantities Lau & Su's MoE claims are about.

For the study's ``moe`` experiment (:mod:`harness.study`); like the rest of
:mod:`harness`, not a stable API.

* **Model.** ``harness.lm``'s decoder with two OLMoE changes: a QK-norm (one
  RMSNorm over the whole query projection, one over the key projection, before
  RoPE) and a sparse MoE block instead of the dense MLP: a router ``mlp/router``
  (d, E) whose softmax picks the top-k of ``E`` SwiGLU experts stacked as bare
  leaves ``mlp/experts/{gate,up,down}_proj`` (E, d, F), (E, d, F), (E, F, d); the
  chosen experts' outputs are summed weighted by their router probabilities
  (OLMoE's ``norm_topk_prob=False``). Every expert runs on every token and the
  unchosen ones get weight 0: the same function as a dispatch, cheaper at this
  size. The names are those ``saggs_jax.equivariant.ROLE_PATTERNS`` route
  (``router/kernel``, ``experts/*_proj``) and ``presets.llama(..., qk_norm="all",
  experts="mlp/experts", expert_leaf=None, mlp=False)`` pairs.
* **Loss.** Next-byte cross-entropy plus ``aux_weight`` (0.01, OLMoE's) times
  the Switch-style load-balancing loss per layer, averaged over layers:
  ``E * sum_e f_e * P_e``, ``f_e`` the fraction of the layer's token-slots routed
  to expert ``e`` and ``P_e`` its mean router probability (``k`` when uniform).

The measured quantities, each a pure function of routing indices or logits:

* ``load_imbalance(counts)``: for tokens-per-expert counts ``c_e`` (a layer,
  one batch, every top-k slot counted), the coefficient of variation
  ``std(c) / mean(c)`` (population std) and ``max(c) / mean(c)``. 0 and 1 when
  every expert gets the same load; ``sqrt(E/k - 1)`` and ``E/k`` when every token
  picks the same ``k`` experts.
* ``topk_changed(before, after, E)``: the fraction of tokens whose *set* of
  top-k experts differs between two routings of the same tokens (order within
  the top-k ignored).
* ``logit_stats(logits)``: the maximum ``|logit|`` and the root mean square of
  the LM head's vocabulary logits.
* ``router_logit_norm(z)``: the mean over tokens of the Euclidean norm of each
  token's router logit vector ``z_t`` (E,); ``router_logit_change(before,
  after)``: the mean over tokens of ``||after_t - before_t||``, the same tokens'
  router logits at two steps.

``train`` logs them at every step without waiting for the device: the jitted step
also returns the load of its own training batch and runs the updated model on a
fixed probe batch (``probe``), comparing it with the previous step's probe routing,
carried on the device (``probe_changes``); see ``make_train_step``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import saggs_jax as saggs
from harness import lm


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Sizes of the MoE LM: ``lm.ModelConfig``'s attention and widths, plus the experts."""

  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  num_experts: int = 8
  top_k: int = 2
  expert_hidden: int = 64
  seq_len: int = 64
  aux_weight: float = 0.01  # OLMoE's load-balancing loss weight
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-5

  def __post_init__(self):
    if not 0 < self.top_k <= self.num_experts:
      raise ValueError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
      )


def pairs(config: MoEConfig) -> list[saggs.Pair]:
  """The model's exact symmetries: V/O per KV head, the QK-norm gains per KV head, and
  up/down per channel of each expert."""
  return saggs.presets.llama(
    config.num_kv_heads, qk_norm="all", experts="mlp/experts", expert_leaf=None, mlp=False
  )


def _linear(d_in: int, d_out: int, rngs: nnx.Rngs, **kwargs) -> nnx.Linear:
  return nnx.Linear(d_in, d_out, use_bias=False, rngs=rngs, **kwargs)


class Attention(nnx.Module):
  """``lm.Attention`` with OLMoE's QK-norm over the whole q and k projections."""

  def __init__(self, c: MoEConfig, *, rngs: nnx.Rngs):
    self.c = c
    d, hd = c.d_model, c.head_dim
    self.q_proj = _linear(d, c.num_heads * hd, rngs)
    self.k_proj = _linear(d, c.num_kv_heads * hd, rngs)
    self.v_proj = _linear(d, c.num_kv_heads * hd, rngs)
    self.o_proj = _linear(c.num_heads * hd, d, rngs)
    self.q_norm = nnx.RMSNorm(c.num_heads * hd, epsilon=c.norm_eps, rngs=rngs)
    self.k_norm = nnx.RMSNorm(c.num_kv_heads * hd, epsilon=c.norm_eps, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.c
    b, t, _ = x.shape
    q = self.q_norm(self.q_proj(x)).reshape(b, t, c.num_heads, c.head_dim)
    k = self.k_norm(self.k_proj(x)).reshape(b, t, c.num_kv_heads, c.head_dim)
    v = self.v_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim)
    q, k = lm.apply_rope(q, c.rope_theta), lm.apply_rope(k, c.rope_theta)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return self.o_proj(out.reshape(b, t, c.num_heads * c.head_dim))


class Experts(nnx.Module):
  """``E`` SwiGLU experts stacked on a leading axis, bare leaves (no ``kernel``)."""

  def __init__(self, c: MoEConfig, *, rngs: nnx.Rngs):
    e, d, f = c.num_experts, c.d_model, c.expert_hidden
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    self.gate_proj = nnx.Param(init(rngs.params(), (e, d, f)))
    self.up_proj = nnx.Param(init(rngs.params(), (e, d, f)))
    self.down_proj = nnx.Param(init(rngs.params(), (e, f, d)))

  def __call__(self, x: jax.Array, weights: jax.Array) -> jax.Array:
    """``x`` (B, T, d), ``weights`` (B, T, E) zero off the top-k -> (B, T, d)."""
    gate = jnp.einsum("btd,edf->btef", x, self.gate_proj[...])
    up = jnp.einsum("btd,edf->btef", x, self.up_proj[...])
    return jnp.einsum("bte,btef,efd->btd", weights, jax.nn.silu(gate) * up, self.down_proj[...])


def route(router_logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Router logits (..., E) -> (probabilities, top-k indices (..., k), combine weights
  (..., E): each chosen expert's probability, 0 elsewhere)."""
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  top, idx = jax.lax.top_k(probs, top_k)
  weights = jnp.sum(jax.nn.one_hot(idx, probs.shape[-1]) * top[..., None], axis=-2)
  return probs, idx, weights


def balance_loss(probs: jax.Array, idx: jax.Array) -> jax.Array:
  """Switch-style load-balancing loss of one layer: ``E * sum_e f_e * P_e`` with ``f_e``
  the tokens routed to ``e`` (every top-k slot) over the tokens, ``P_e`` the mean
  probability of ``e``; ``probs`` (..., E), ``idx`` (..., k)."""
  e = probs.shape[-1]
  f = jax.nn.one_hot(idx, e).sum(-2).reshape(-1, e).mean(0)
  return e * jnp.sum(f * probs.reshape(-1, e).mean(0))


class MoE(nnx.Module):
  def __init__(self, c: MoEConfig, *, rngs: nnx.Rngs):
    self.top_k = c.top_k
    self.router = _linear(c.d_model, c.num_experts, rngs)
    self.experts = Experts(c, rngs=rngs)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """-> (output (B, T, d), router logits (B, T, E))."""
    logits = self.router(x)
    _, _, weights = route(logits, self.top_k)
    return self.experts(x, weights.astype(x.dtype)), logits


class Block(nnx.Module):
  def __init__(self, c: MoEConfig, *, rngs: nnx.Rngs):
    self.attn_norm = nnx.RMSNorm(c.d_model, epsilon=c.norm_eps, rngs=rngs)
    self.attn = Attention(c, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(c.d_model, epsilon=c.norm_eps, rngs=rngs)
    self.mlp = MoE(c, rngs=rngs)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    x = x + self.attn(self.attn_norm(x))
    out, router_logits = self.mlp(self.mlp_norm(x))
    return x + out, router_logits


class MoELM(nnx.Module):
  """Tokens (B, T) -> (vocabulary logits (B, T, 256), router logits (layers, B, T, E))."""

  def __init__(self, c: MoEConfig, *, rngs: nnx.Rngs):
    self.c = c
    self.embed = nnx.Embed(lm.VOCAB_SIZE, c.d_model, rngs=rngs)
    self.layers = nnx.List([Block(c, rngs=rngs) for _ in range(c.num_layers)])
    self.final_norm = nnx.RMSNorm(c.d_model, epsilon=c.norm_eps, rngs=rngs)
    self.lm_head = _linear(  # small, as lm.LM's: the first prediction is near uniform
      c.d_model,
      lm.VOCAB_SIZE,
      rngs,
      kernel_init=nnx.initializers.variance_scaling(0.01, "fan_in", "normal"),
    )

  def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    x = self.embed(tokens)
    routers = []
    for layer in self.layers:
      x, router_logits = layer(x)
      routers.append(router_logits)
    return self.lm_head(self.final_norm(x)), jnp.stack(routers)


def init_model(config: MoEConfig, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
  return nnx.split(MoELM(config, rngs=nnx.Rngs(seed)), nnx.Param)


@functools.cache
def discovered_roles(config: MoEConfig) -> dict[str, tuple[str, ...]]:
  """``saggs.discover(...).roles`` of the model (seed 0's parameters, one 8-byte
  sequence): the path patterns of each role of ``equivariant.symmetry_compatible``,
  read from the program (the router is the linear map feeding ``top_k``, the experts the
  matrices with a leading axis of ``num_experts``)."""
  graphdef, params = init_model(config, seed=0)
  forward = lambda p, tokens: nnx.merge(graphdef, p)(tokens)[0]
  return dict(saggs.discover(forward, params, jnp.arange(8)[None]).roles)


def losses(params, graphdef, batch, top_k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(next-byte cross-entropy, mean over layers of ``balance_loss``, the top-k indices
  (L, B, T, k) the balance loss saw) of windows (B, T + 1)."""
  logits, routers = nnx.merge(graphdef, params)(batch[:, :-1])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch[:, 1:])
  probs, idx, _ = route(routers, top_k)
  return ce.mean(), jax.vmap(balance_loss)(probs, idx).mean(), idx


# ----------------------------------------------------------------------------
# The measured quantities
# ----------------------------------------------------------------------------


def expert_counts(idx: jax.Array, num_experts: int) -> jax.Array:
  """Tokens per expert of top-k indices ``idx`` (..., tokens, k) -> (..., E), every slot
  counted (a token counts once for each of its ``k`` experts)."""
  return jax.nn.one_hot(idx, num_experts, dtype=jnp.float32).sum(axis=(-3, -2))


def load_imbalance(counts: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(std(c) / mean(c), max(c) / mean(c))`` over the last axis of tokens-per-expert
  counts ``c`` (population std): the coefficient of variation and the max/mean load."""
  counts = jnp.asarray(counts, jnp.float32)
  mean = counts.mean(-1)
  return counts.std(-1) / mean, counts.max(-1) / mean


def topk_changed(before: jax.Array, after: jax.Array, num_experts: int) -> jax.Array:
  """The fraction of tokens whose top-k expert set differs between two routings of the
  same tokens: ``before``, ``after`` (..., tokens, k) -> (...)."""
  as_set = lambda idx: jax.nn.one_hot(idx, num_experts, dtype=jnp.int32).sum(-2)
  changed = jnp.any(as_set(before) != as_set(after), axis=-1)
  return changed.astype(jnp.float32).mean(-1)


def logit_stats(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(max |logit|, sqrt(mean(logit**2)))`` over every entry of ``logits``."""
  logits = jnp.asarray(logits, jnp.float32)
  return jnp.max(jnp.abs(logits)), jnp.sqrt(jnp.mean(logits**2))


def router_logit_norm(router_logits: jax.Array) -> jax.Array:
  """``mean_t ||z_t||``: router logits (..., tokens, E) -> (...), the Euclidean norm of
  each token's logit vector averaged over the tokens."""
  z = jnp.asarray(router_logits, jnp.float32)
  return jnp.linalg.norm(z, axis=-1).mean(-1)


def router_logit_change(before: jax.Array, after: jax.Array) -> jax.Array:
  """``mean_t ||after_t - before_t||``: the same tokens' router logits (..., tokens, E) at
  two evaluations -> (...)."""
  return router_logit_norm(jnp.asarray(after, jnp.float32) - jnp.asarray(before, jnp.float32))


# ----------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------


def probe(params, graphdef: nnx.GraphDef, tokens: jax.Array, top_k: int) -> dict[str, jax.Array]:
  """The model on the probe tokens (B, T) -> ``router`` logits (L, B*T, E) in float32, their
  top-k ``idx`` (L, B*T, k), ``router_norm`` (L,) and the vocabulary logits' ``logit_max``
  and ``logit_rms`` (``logit_stats``)."""
  logits, routers = nnx.merge(graphdef, params)(tokens)
  routers = routers.reshape(routers.shape[0], -1, routers.shape[-1]).astype(jnp.float32)
  _, idx, _ = route(routers, top_k)
  logit_max, logit_rms = logit_stats(logits)
  return {
    "router": routers,
    "idx": idx,
    "router_norm": router_logit_norm(routers),
    "logit_max": logit_max,
    "logit_rms": logit_rms,
  }


def probe_changes(before: dict, after: dict, num_experts: int) -> dict[str, jax.Array]:
  """Two ``probe`` results of the same tokens -> per layer (L,) ``flip``
  (``topk_changed``) and ``router_change`` (``router_logit_change``) from ``before`` to
  ``after``."""
  return {
    "flip": topk_changed(before["idx"], after["idx"], num_experts),
    "router_change": router_logit_change(before["router"], after["router"]),
  }


# What ``make_train_step``'s step returns besides the state; small, kept on device.
STEP_METRICS = ("cv", "max_mean", "flip", "router_change")
PROBE_METRICS = ("router_norm", "logit_max", "logit_rms")


@functools.cache  # shared by every arm and seed of a config
def make_probe(graphdef: nnx.GraphDef, config: MoEConfig) -> Callable:
  """A jitted ``probe(params, tokens)`` (the function above) for the step-0 values."""
  return jax.jit(lambda params, tokens: probe(params, graphdef, tokens, config.top_k))


@functools.lru_cache(maxsize=16)  # the seeds of an arm share one compilation
def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, config: MoEConfig):
  """A jitted ``step(params, opt_state, batch, probe_tokens, last) -> (params, opt_state,
  cross-entropy, metrics, routing)`` on the cross-entropy plus ``aux_weight`` times the
  balance loss; donates its state and ``last``, the previous step's ``routing``.

  ``routing`` is the ``router`` and ``idx`` of the ``probe`` of the updated model on
  ``probe_tokens``. ``metrics`` holds (L,) arrays: ``cv`` and ``max_mean``, the
  ``load_imbalance`` of the step's own training batch as the step routes it (the
  parameters before the update), and ``probe_changes(last, routing)``; and that probe's
  ``PROBE_METRICS``.
  """

  def objective(params, batch):
    ce, balance, idx = losses(params, graphdef, batch, config.top_k)
    return ce + config.aux_weight * balance, (ce, idx)

  def step(params, opt_state, batch, probe_tokens, last):
    (_, (ce, idx)), grads = jax.value_and_grad(objective, has_aux=True)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    # Load on the training batch: it is the routing the balance loss sees and the experts
    # carry, free from this forward pass, and fresh tokens each step, so a mean over
    # steps averages over batches; the probe batch is for what needs the same tokens twice.
    idx = idx.reshape(idx.shape[0], -1, idx.shape[-1])  # (L, B*T, k)
    cv, max_mean = load_imbalance(expert_counts(idx, config.num_experts))
    new = probe(params, graphdef, probe_tokens, config.top_k)
    metrics = {
      "cv": cv,
      "max_mean": max_mean,
      **probe_changes(last, new, config.num_experts),
      **{k: new[k] for k in PROBE_METRICS},
    }
    return params, opt_state, ce, metrics, {k: new[k] for k in ("router", "idx")}

  return jax.jit(step, donate_argnums=(0, 1, 4))


@functools.cache
def make_evaluate(graphdef: nnx.GraphDef, config: MoEConfig) -> Callable:
  """A jitted ``evaluate(params, batches (N, B, T + 1))`` -> mean cross-entropy."""

  def one(params, batch):
    logits, _ = nnx.merge(graphdef, params)(batch[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch[:, 1:])
    return ce.mean()

  return jax.jit(lambda params, batches: jax.lax.map(lambda b: one(params, b), batches).mean())


def train(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  tx: optax.GradientTransformation,
  corpus: lm.Corpus,
  config: MoEConfig,
  *,
  steps: int,
  batch_size: int,
  seed: int,
  eval_every: int,
  eval_batches: int,
  desc: str | None = None,
) -> dict[str, Any]:
  """Trains for ``steps`` updates; the batches depend only on ``seed``, as in ``lm.train``
  (update ``s``'s is drawn with ``fold_in(data_key, s)``, the validation batches with
  ``eval_key``, ``data_key, eval_key = split(key(seed))``).

  Returns numpy arrays: ``eval_step`` (0, every ``eval_every`` steps and the last) and
  ``eval_loss`` (over the ``eval_batches`` validation batches); every step, per layer:
  ``cv`` and ``max_mean`` (steps, L), step ``s``'s training batch as it routes it (by
  the parameters after ``s - 1`` updates: row 0 is the initial routing), ``flip`` and
  ``router_change`` (steps, L), row ``s - 1`` from the probe batch's routing after
  ``s - 1`` updates to that after ``s``; ``router_norm`` (steps + 1, L), ``logit_max``
  and ``logit_rms`` (steps + 1,) of the probe batch after 0, 1, ..., ``steps`` updates;
  ``seconds``; and the trained ``params``. The probe batch is the first validation batch.
  Nothing waits for the device inside the loop: the metrics stay there until the end.
  """
  from tqdm import tqdm

  params = lm.donatable_copy(params)
  opt_state = lm.donatable_copy(tx.init(params))
  step_fn, evaluate = make_train_step(graphdef, tx, config), make_evaluate(graphdef, config)
  data_key, eval_key = jax.random.split(jax.random.key(seed))
  val = lm.sample_batches(eval_key, corpus.val, eval_batches, batch_size, config.seq_len)
  probe_tokens = val[0, :, :-1]
  start = time.perf_counter()
  initial = make_probe(graphdef, config)(params, probe_tokens)
  first = {k: initial[k] for k in PROBE_METRICS}
  last = {k: initial[k] for k in ("router", "idx")}  # donated to the first step
  evals, metrics = [(0, evaluate(params, val))], []
  for step in tqdm(range(1, steps + 1), desc=desc, dynamic_ncols=True):
    batch = lm.sample_batch(
      jax.random.fold_in(data_key, step), corpus.train, batch_size, config.seq_len
    )
    params, opt_state, _, m, last = step_fn(params, opt_state, batch, probe_tokens, last)
    metrics.append(m)
    if step % eval_every == 0 or step == steps:
      evals.append((step, evaluate(params, val)))
  evals, first, metrics = jax.device_get((evals, first, metrics))  # the one wait
  return {
    "eval_step": np.array([s for s, _ in evals]),
    "eval_loss": np.array([v for _, v in evals], np.float32),
    **{k: np.stack([m[k] for m in metrics]) for k in STEP_METRICS},
    **{k: np.stack([first[k]] + [m[k] for m in metrics]) for k in PROBE_METRICS},
    "seconds": np.asarray(time.perf_counter() - start),
    "params": params,
  }
