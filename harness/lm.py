"""The example LM shared by ``examples/``, ``tests/`` and ``bench/``: data, a small
LLaMA-style LM, training.

For the project's own examples, tests and benchmarks (as ``chex`` ships its test
utilities), not a stable API. It needs ``matplotlib`` and ``tqdm`` (the
``examples`` extra) only for plots and the progress bar.

Everything here runs on a laptop CPU without downloads:

* **Data.** A byte-level corpus made of the Python standard library's own
  ``.py`` files, split into train and validation by file, sampled as random
  windows for next-byte prediction (vocabulary 256).
* **Model.** A decoder-only Transformer in ``flax.nnx``: RMSNorm, grouped-query
  attention with RoPE, SwiGLU MLP, untied LM head. Weight paths such as
  ``layers/0/attn/q_proj/kernel`` are what the ``saggs_jax`` path patterns
  address.
* **Training.** Pure functional steps on ``(params, opt_state)``, so any optax
  ``GradientTransformation`` (the library's ones included) plugs in; a loop
  with a progress bar, periodic evaluation and metric logging; a plain-text
  results table and PNG plots.

Typical use::

  from harness import lm
  corpus = lm.load_corpus()
  graphdef, params = lm.init_model(lm.ModelConfig(), seed=0)
  params, opt_state, history = lm.train(
      graphdef, params, optax.adamw(3e-3), corpus, steps=500)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import os
import pathlib
import sysconfig
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

if TYPE_CHECKING:
  from matplotlib.figure import Figure

import saggs_jax as saggs
from saggs_jax._src import paths

VOCAB_SIZE = 256  # bytes
T = TypeVar("T")

# ----------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------

# Third-party code and the (large, repetitive) test suites are left out, so the
# corpus is the library proper and does not depend on what else is installed.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})


class Corpus(NamedTuple):
  """Byte streams (uint8 jax arrays) for training and validation."""

  train: jax.Array
  val: jax.Array
  num_files: int


def stdlib_source_files() -> list[pathlib.Path]:
  """The standard library's ``.py`` files, in a fixed order that mixes packages.

  Files are sorted by a hash of their relative path rather than by name, so a
  byte budget picks a spread of modules instead of the alphabetically first
  packages. The order depends only on the file names.
  """
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  relative = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]  # prune the walk
    rel_dir = pathlib.Path(dirpath).relative_to(root)
    relative += [(rel_dir / f).as_posix() for f in filenames if f.endswith(".py")]
  relative.sort(key=lambda rel: (hashlib.sha256(rel.encode()).hexdigest(), rel))
  return [root / rel for rel in relative]


def load_corpus(max_bytes: int = 4_000_000, val_fraction: float = 0.1) -> Corpus:
  """Reads up to ``max_bytes`` of stdlib source and splits it by file.

  A file goes to validation while validation holds less than ``val_fraction``
  of the bytes read so far, so no validation window comes from a file seen in
  training. The last file read is truncated so the total is exactly
  ``max_bytes`` (when the library is that large).
  """
  train, val = [], []
  total = val_bytes = 0
  for path in stdlib_source_files():
    if total >= max_bytes:
      break
    data = path.read_bytes()[: max_bytes - total]
    if val_bytes < val_fraction * total:
      val.append(data)
      val_bytes += len(data)
    else:
      train.append(data)
    total += len(data)
  as_array = lambda chunks: jnp.asarray(np.frombuffer(b"".join(chunks), np.uint8))
  return Corpus(as_array(train), as_array(val), len(train) + len(val))


@functools.partial(jax.jit, static_argnames=("batch_size", "seq_len"))
def sample_batch(key: jax.Array, data: jax.Array, batch_size: int, seq_len: int) -> jax.Array:
  """Random windows of ``seq_len + 1`` bytes, shape (batch_size, seq_len + 1), int32.

  Position t of a window predicts position t + 1 (see ``loss_fn``).
  """
  starts = jax.random.randint(key, (batch_size, 1), 0, data.shape[0] - seq_len)
  return data[starts + jnp.arange(seq_len + 1)].astype(jnp.int32)


def sample_batches(
  key: jax.Array, data: jax.Array, num_batches: int, batch_size: int, seq_len: int
) -> jax.Array:
  """``num_batches`` batches stacked, shape (num_batches, batch_size, seq_len + 1)."""
  keys = jax.random.split(key, num_batches)
  return jax.vmap(lambda k: sample_batch(k, data, batch_size, seq_len))(keys)


# ----------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes of the LM. The defaults train in seconds on two CPU cores."""

  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  mlp_hidden: int = 172  # ~8/3 d_model, as in LLaMA
  seq_len: int = 64  # training context; RoPE itself has no length limit
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-5
  param_dtype: str = "float32"  # a name, so that it works as a command-line flag

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
      )
    if self.head_dim % 2:
      raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")


def add_model_flags(parser: argparse.ArgumentParser) -> None:
  """Adds one ``--flag`` per ``ModelConfig`` field (``d_model`` -> ``--d-model``)."""
  for field in dataclasses.fields(ModelConfig):
    parser.add_argument(
      "--" + field.name.replace("_", "-"),
      type=type(field.default),
      default=field.default,
      help=f"model {field.name} (default %(default)s)",
    )


# What every example shrinks to under SAGGS_SMOKE=1, the documented commands' test
# (tests/test_examples.py): a model of about 3k parameters, every code path in seconds.
SMOKE = "SAGGS_SMOKE"
SMOKE_MODEL = {
  "d_model": 16,
  "num_layers": 1,
  "num_heads": 2,
  "num_kv_heads": 1,
  "head_dim": 8,
  "mlp_hidden": 32,
  "seq_len": 16,
}


def smoke_defaults(parser: argparse.ArgumentParser, **training: Any) -> None:
  """Under ``SAGGS_SMOKE=1`` the parser's defaults become the tiny model and ``training``
  (a few steps, one seed): the example runs end to end in seconds. Flags given still win."""
  if os.environ.get(SMOKE):
    parser.set_defaults(**SMOKE_MODEL, **training)


def add_training_flags(parser: argparse.ArgumentParser, out: str) -> None:
  """The flags of a single training comparison from a Q/K-imbalanced start."""
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--weight-decay", type=float, default=0.1)
  parser.add_argument(
    "--imbalance",
    type=float,
    default=8.0,
    help="q_proj is scaled by this factor and k_proj by its inverse",
  )
  parser.add_argument("--every", type=int, default=10, help="balance every this many updates")
  parser.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
  parser.add_argument("--eval-every", type=int, default=50)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(out))


def config_from_flags(args: argparse.Namespace) -> ModelConfig:
  """The ``ModelConfig`` described by flags added with ``add_model_flags``."""
  return ModelConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ModelConfig)})


def apply_rope(x: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding of ``x`` with shape (batch, seq, heads, head_dim).

  Rotates the pairs (i, i + head_dim/2) by angle ``position * theta**(-2i/head_dim)``.
  """
  seq_len, head_dim = x.shape[1], x.shape[-1]
  inv_freq = theta ** (-jnp.arange(head_dim // 2, dtype=jnp.float32) * 2 / head_dim)
  angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq  # (seq, head_dim/2)
  cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]  # broadcast over heads
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _linear(d_in: int, d_out: int, config: ModelConfig, rngs: nnx.Rngs, **kwargs) -> nnx.Linear:
  return nnx.Linear(
    d_in, d_out, use_bias=False, param_dtype=jnp.dtype(config.param_dtype), rngs=rngs, **kwargs
  )


def _rms_norm(config: ModelConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
  return nnx.RMSNorm(
    config.d_model, epsilon=config.norm_eps, param_dtype=jnp.dtype(config.param_dtype), rngs=rngs
  )


class Attention(nnx.Module):
  """Causal grouped-query self-attention with RoPE.

  Query head h reads KV head ``h // (num_heads // num_kv_heads)``: the query
  heads of one KV head are contiguous columns of ``q_proj`` and rows of
  ``o_proj``, which is the grouping that ``saggs.Pair(..., groups=num_kv_heads)``
  assumes.
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.sow_max_logits = False  # see loss_and_max_logits
    d, hd = config.d_model, config.head_dim
    self.q_proj = _linear(d, config.num_heads * hd, config, rngs)
    self.k_proj = _linear(d, config.num_kv_heads * hd, config, rngs)
    self.v_proj = _linear(d, config.num_kv_heads * hd, config, rngs)
    self.o_proj = _linear(config.num_heads * hd, d, config, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    batch, seq_len, _ = x.shape
    q = self.q_proj(x).reshape(batch, seq_len, c.num_heads, c.head_dim)
    k = self.k_proj(x).reshape(batch, seq_len, c.num_kv_heads, c.head_dim)
    v = self.v_proj(x).reshape(batch, seq_len, c.num_kv_heads, c.head_dim)
    q, k = apply_rope(q, c.rope_theta), apply_rope(k, c.rope_theta)
    if self.sow_max_logits:  # what saggs.qk_clip reads, from the q and k of this forward pass
      self.sow(
        nnx.Intermediate,
        "max_logits",
        saggs.max_logits(q, k, is_causal=True),
        reduce_fn=lambda _, new: new,
      )  # pyright: ignore[reportArgumentType]  # one value per call, not a growing tuple
    # Groups query heads contiguously per KV head and takes the softmax in float32.
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return self.o_proj(out.reshape(batch, seq_len, c.num_heads * c.head_dim))


class SwiGLU(nnx.Module):
  """``down(silu(gate(x)) * up(x))``."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    d, f = config.d_model, config.mlp_hidden
    self.gate_proj = _linear(d, f, config, rngs)
    self.up_proj = _linear(d, f, config, rngs)
    self.down_proj = _linear(f, d, config, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
  """Pre-norm residual block: attention, then MLP."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.attn_norm = _rms_norm(config, rngs)
    self.attn = Attention(config, rngs=rngs)
    self.mlp_norm = _rms_norm(config, rngs)
    self.mlp = SwiGLU(config, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.attn_norm(x))
    return x + self.mlp(self.mlp_norm(x))


class LM(nnx.Module):
  """Decoder-only byte LM: tokens (batch, seq) -> logits (batch, seq, 256)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.embed = nnx.Embed(
      VOCAB_SIZE, config.d_model, param_dtype=jnp.dtype(config.param_dtype), rngs=rngs
    )
    self.layers = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
    self.final_norm = _rms_norm(config, rngs)
    # A small head makes the initial prediction near uniform: loss starts at ~ln 256.
    self.lm_head = _linear(
      config.d_model,
      VOCAB_SIZE,
      config,
      rngs,
      kernel_init=nnx.initializers.variance_scaling(0.01, "fan_in", "normal"),
    )

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    for layer in self.layers:
      x = layer(x)
    return self.lm_head(self.final_norm(x))


def init_model(config: ModelConfig, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
  """A freshly initialised ``LM`` split into its static graph and its ``nnx.Param`` state."""
  return nnx.split(LM(config, rngs=nnx.Rngs(seed)), nnx.Param)


def forward(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array) -> jax.Array:
  """Logits of the model ``(graphdef, params)``, as a pure function."""
  return nnx.merge(graphdef, params)(tokens)


def _cross_entropy(logits: jax.Array, batch: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), batch[:, 1:]
  ).mean()


def loss_fn(params: nnx.State, graphdef: nnx.GraphDef, batch: jax.Array) -> jax.Array:
  """Mean next-byte cross-entropy (nats) over windows ``batch`` of shape (B, T + 1)."""
  return _cross_entropy(forward(graphdef, params, batch[:, :-1]), batch)


def loss_and_max_logits(
  params: nnx.State, graphdef: nnx.GraphDef, batch: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """``loss_fn`` and, from the same forward pass, each layer's per-head max attention logit.

  The logits are keyed by the layer's query kernel path, as ``saggs.qk_clip``
  reads them: ``{"layers/0/attn/q_proj/kernel": (num_heads,), ...}``. Each
  ``Attention`` sows them (``nnx.Intermediate``) when asked to, and
  ``nnx.capture`` collects them.
  """
  model = nnx.merge(graphdef, params)
  model.set_attributes(sow_max_logits=True)
  logits, sown = nnx.capture(model, nnx.Intermediate)(batch[:, :-1])
  return _cross_entropy(logits, batch), {
    path.replace("/max_logits", "/q_proj/kernel"): value
    for path, value in paths.leaves_with_paths(sown)
  }


def num_params(params: Any) -> int:
  """Total number of parameter entries."""
  return sum(x.size for x in jax.tree.leaves(params))


def induce_qk_imbalance(params: nnx.State, factor: float | jax.Array) -> nnx.State:
  """Scales every ``q_proj`` kernel by ``factor`` and its layer's ``k_proj`` by ``1/factor``.

  ``factor`` is a scalar or one value per KV head (shape (num_kv_heads,)); a
  per-KV-head factor multiplies the query heads of that group. The function
  is unchanged: q.k is invariant and a per-head scalar commutes with RoPE.
  """
  factor = jnp.asarray(factor, jnp.float32).reshape(-1)  # (groups,); 1 group for a scalar

  def scale(kernel, power):
    grouped = kernel.reshape(kernel.shape[0], factor.size, -1)  # contiguous head groups
    return (grouped * factor[:, None] ** power).reshape(kernel.shape).astype(kernel.dtype)

  def rescale(key_path, x):
    path = jax.tree_util.keystr(key_path, simple=True, separator="/")
    if "/q_proj/kernel" in path:
      return scale(x, 1)
    if "/k_proj/kernel" in path:
      return scale(x, -1)
    return x

  return jax.tree_util.tree_map_with_path(rescale, params)


# ----------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------

TrainStep = Callable[
  [nnx.State, optax.OptState, jax.Array], tuple[nnx.State, optax.OptState, jax.Array]
]


@functools.lru_cache(maxsize=16)  # runs given the same graph and optimizer share one compilation
def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation) -> TrainStep:
  """A jitted ``train_step(params, opt_state, batch) -> (params, opt_state, loss)``.

  ``params`` is passed to ``tx.update``, so transformations that rewrite the
  parameters (symmetry balancing) can do so through their updates. The
  ``params`` and ``opt_state`` arguments are donated: do not use them after
  the call.
  """

  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, graphdef, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(train_step, donate_argnums=(0, 1))


ClipStep = Callable[
  [nnx.State, optax.OptState, jax.Array],
  tuple[nnx.State, optax.OptState, jax.Array, jax.Array],
]


def make_max_logits_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation) -> ClipStep:
  """A jitted ``step(params, opt_state, batch) -> (params, opt_state, loss, max logit)``.

  For chains that end in ``saggs.qk_clip``: the per-head max logits of the
  forward pass that gives the gradient (``loss_and_max_logits``) go to
  ``tx.update(..., max_logits=...)``, so the clip needs no second forward
  pass; the last output is their maximum over layers and heads. A ``tx``
  without extra arguments ignores them. Donates ``params`` and ``opt_state``
  as ``make_train_step`` does.
  """
  tx = optax.with_extra_args_support(tx)

  def step(params, opt_state, batch):
    (loss, logits), grads = jax.value_and_grad(loss_and_max_logits, has_aux=True)(
      params, graphdef, batch
    )
    updates, opt_state = tx.update(grads, opt_state, params, max_logits=logits)
    top = jnp.max(jnp.stack(list(logits.values())))
    return optax.apply_updates(params, updates), opt_state, loss, top

  return jax.jit(step, donate_argnums=(0, 1))


@functools.cache  # one compilation per model graph, shared by every run that trains it
def make_evaluate(graphdef: nnx.GraphDef) -> Callable[[nnx.State, jax.Array], jax.Array]:
  """A jitted ``evaluate(params, batches) -> mean loss`` over stacked batches (N, B, T + 1)."""

  def evaluate(params, batches):
    return jax.lax.map(lambda batch: loss_fn(params, graphdef, batch), batches).mean()

  return jax.jit(evaluate)


def donatable_copy(tree: T) -> T:
  """Copies every leaf of ``tree`` as a strongly typed array.

  A copy can be donated to ``train_step`` while the original stays usable. A
  weak-typed leaf (say an optimizer state built from a Python scalar) would
  come back strong from the first step and trigger a second compilation.
  """
  return jax.tree.map(lambda x: jnp.array(x, dtype=jnp.result_type(x)), tree)


MetricsFn = Callable[[int, nnx.State, optax.OptState], Mapping[str, Any]]


def train(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  tx: optax.GradientTransformation,
  corpus: Corpus,
  *,
  steps: int,
  batch_size: int = 32,
  seq_len: int = ModelConfig.seq_len,
  seed: int = 0,
  opt_state: optax.OptState | None = None,
  eval_every: int = 100,
  eval_batches: int = 16,
  log_every: int = 10,
  metrics_fn: MetricsFn | None = None,
  metrics_every: int = 10,
  desc: str | None = None,
  progress: bool = True,
) -> tuple[nnx.State, optax.OptState, dict[str, np.ndarray]]:
  """Trains for ``steps`` updates and returns ``(params, opt_state, history)``.

  Batches depend only on ``seed`` (the batch of update s is drawn with
  ``fold_in(key, s)``), so runs that differ only in the optimizer see the same
  data; the validation batches are fixed for the whole run. The caller's
  ``params`` and ``opt_state`` stay valid (the loop donates copies).
  ``opt_state`` defaults to ``tx.init(params)``.

  ``metrics_fn(step, params, opt_state)`` returns a dict of scalars or
  fixed-shape arrays; it runs before the first update and after every
  ``metrics_every`` updates, and must not keep references to its arguments.

  ``history`` holds numpy arrays:
    ``step``, ``loss``: update number 1..steps and its training-batch loss;
    ``eval_step``, ``eval_loss``: validation loss at step 0, every
    ``eval_every`` steps and at the end;
    ``metric_step`` and one entry per ``metrics_fn`` key, stacked over calls;
    ``seconds``: wall time of the loop, compilation and evaluation included.
  """
  params = donatable_copy(params)
  opt_state = donatable_copy(tx.init(params) if opt_state is None else opt_state)
  train_step, evaluate = make_train_step(graphdef, tx), make_evaluate(graphdef)
  data_key, eval_key = jax.random.split(jax.random.key(seed))
  val_batches = sample_batches(eval_key, corpus.val, eval_batches, batch_size, seq_len)

  losses, evals, metrics = [], [], []

  def log_eval(step):
    evals.append((step, float(evaluate(params, val_batches))))

  def log_metrics(fn: MetricsFn, step, params, opt_state):
    metrics.append((step, jax.tree.map(np.asarray, dict(fn(step, params, opt_state)))))

  start = time.perf_counter()
  log_eval(0)
  if metrics_fn:
    log_metrics(metrics_fn, 0, params, opt_state)
  from tqdm import tqdm  # the examples extra: importing this module does not need it

  bar = tqdm(range(1, steps + 1), desc=desc, disable=not progress, dynamic_ncols=True)
  for step in bar:
    batch = sample_batch(jax.random.fold_in(data_key, step), corpus.train, batch_size, seq_len)
    params, opt_state, loss = train_step(params, opt_state, batch)
    losses.append(loss)  # stays on device: no sync on steps that log nothing
    if step % eval_every == 0 or step == steps:
      log_eval(step)
    if metrics_fn and step % metrics_every == 0:
      log_metrics(metrics_fn, step, params, opt_state)
    if step % log_every == 0 or step == steps:
      bar.set_postfix(loss=f"{float(loss):.4f}", val=f"{evals[-1][1]:.4f}")
  seconds = time.perf_counter() - start

  history = {
    "step": np.arange(1, steps + 1),
    "loss": np.asarray(jax.device_get(losses), np.float32),
    "eval_step": np.array([s for s, _ in evals]),
    "eval_loss": np.array([v for _, v in evals], np.float32),
    "seconds": np.asarray(seconds),
  }
  if metrics_fn:
    history["metric_step"] = np.array([s for s, _ in metrics])
    for name in metrics[0][1]:
      if name in history:
        raise ValueError(f"metrics_fn key {name!r} clashes with a history entry")
      history[name] = np.stack([m[name] for _, m in metrics])
  return params, opt_state, history


# ----------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------


def results_table(
  rows: Sequence[Sequence[Any]], headers: Sequence[str], floatfmt: str = ".4f"
) -> str:
  """Prints and returns an aligned plain-text table; numbers right-aligned."""

  def cell(x):
    return format(x, floatfmt) if isinstance(x, (float, np.floating)) else str(x)

  cells = [[cell(x) for x in row] for row in rows]
  numeric = [
    all(isinstance(row[i], (int, float, np.number)) for row in rows) for i in range(len(headers))
  ]
  widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

  def line(items):
    return "  ".join(
      s.rjust(w) if num else s.ljust(w) for s, w, num in zip(items, widths, numeric)
    ).rstrip()

  text = "\n".join([line(headers), "  ".join("-" * w for w in widths)] + [line(r) for r in cells])
  print(text)
  return text


def _ema(values: np.ndarray, decay: float) -> np.ndarray:
  """Bias-corrected exponential moving average (decay 0 returns the values)."""
  out, acc = np.empty(len(values)), 0.0
  for i, v in enumerate(values):
    acc = decay * acc + (1 - decay) * v
    out[i] = acc / (1 - decay ** (i + 1))
  return out


def _save(fig: Figure, path: str | pathlib.Path) -> None:
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120, bbox_inches="tight")


def plot_curves(
  histories: Mapping[str, Mapping[str, np.ndarray]],
  path: str | pathlib.Path,
  title: str = "",
  smooth: float = 0.9,
) -> None:
  """Saves a PNG of several runs ``{label: history}`` from ``train``: left, training
  loss (EMA-smoothed, solid) and validation loss (dashed, a marker per evaluation);
  right, validation loss minus the first run's, where runs a few hundredths apart
  are told apart."""
  # Figure without pyplot renders PNGs with Agg and touches no global backend state.
  from matplotlib.figure import Figure

  fig = Figure(figsize=(12, 4.5))
  ax, gap = fig.subplots(1, 2)
  reference = next(iter(histories.values()))["eval_loss"]
  for i, (label, h) in enumerate(histories.items()):
    color = f"C{i}"
    ax.plot(h["step"], _ema(h["loss"], smooth), color=color, alpha=0.8, label=f"{label} train")
    ax.plot(h["eval_step"], h["eval_loss"], "o--", color=color, markersize=3, label=f"{label} val")
    gap.plot(
      h["eval_step"], h["eval_loss"] - reference, "o-", color=color, markersize=3, label=label
    )
  ax.set(
    xlabel="step",
    ylabel="loss (nats/byte)",
    title=f"{title}\n(train: EMA-smoothed, decay {smooth}; val: markers at evaluations)",
  )
  gap.set(
    xlabel="step",
    ylabel=f"val loss - {next(iter(histories))} val loss (nats/byte)",
    title="Validation loss relative to the first run",
  )
  for a in (ax, gap):
    a.grid(alpha=0.3)
    a.legend(fontsize="small")
  _save(fig, path)


def plot_metric_curves(
  curves: Mapping[str, tuple[np.ndarray, np.ndarray]],
  path: str | pathlib.Path,
  ylabel: str,
  title: str = "",
  logy: bool = False,
) -> None:
  """Saves a PNG of ``{label: (steps, values)}``.

  ``values`` of shape (steps,) is one line; shape (steps, ...) draws one thin
  line per trailing entry (e.g. per layer and head), all in the label's color.
  """
  from matplotlib.figure import Figure

  fig = Figure(figsize=(7, 4.5))
  ax = fig.subplots()
  for i, (label, (steps, values)) in enumerate(curves.items()):
    values = np.asarray(values).reshape(len(steps), -1)
    lines = ax.plot(
      steps,
      values,
      ".-" if len(steps) <= 50 else "-",
      markersize=4,
      color=f"C{i}",
      linewidth=1.5 if values.shape[1] == 1 else 0.8,
    )
    lines[0].set_label(label)
  ax.set(xlabel="step", ylabel=ylabel, title=title)
  if logy:
    ax.set_yscale("log")
  ax.grid(alpha=0.3)
  ax.legend(fontsize="small")
  _save(fig, path)
