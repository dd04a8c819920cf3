"""Ready-made pair declarations for common Flax attention, LLaMA-style and GPT-2 layouts.

Patterns are anchored at the end of a path and pair up within one module, so
they apply to every layer of a model at once; ``prefix`` restricts them to
part of the tree (e.g. ``"decoder/**"``). :func:`muon_dimension_numbers`
declares the same layouts' matrices for ``optax.contrib.muon``.

Example:
  >>> import saggs_jax as saggs
  >>> [pair.name for pair in saggs.presets.llama(num_kv_heads=2)]
  ['attention Q/K', 'attention V/O', 'SwiGLU up/down']
"""

from __future__ import annotations

from typing import Any, Literal

from optax.contrib import MuonDimensionNumbers

from saggs_jax.equivariant.dimension_numbers import (
  muon_dimension_numbers as _from_patterns,
)
from saggs_jax.pairs import Block, Pair


def _join(prefix: str | None, name: str) -> str:
  return f"{prefix}/{name}" if prefix else name


def flax_mha(*, bias: bool = True, stacked: int = 0, prefix: str | None = None) -> list[Pair]:
  """Q/K and V/O per head for ``flax.linen.MultiHeadDotProductAttention`` and
  ``flax.nnx.MultiHeadAttention``.

  Both store ``query``/``key``/``value`` kernels as (features, heads, head_dim)
  with biases (heads, head_dim), and ``out`` as (heads, head_dim, features).
  Query and value biases move with their kernels; the output bias does not
  move. With ``normalize_qk=True`` (a norm per head) Q and K are each
  scale-invariant: the Q/K pair is still exact, but balancing it is moot; drop it
  to save the work.

  Example:
    >>> import saggs_jax as saggs
    >>> pairs = saggs.presets.flax_mha()
  """

  def p(name):
    return _join(prefix, name)

  return [
    Pair(
      p("query/kernel"),
      p("key/kernel"),
      axes=(1, 1),
      stacked=stacked,
      follow_a=(p("query/bias"),) if bias else (),
      follow_b=(p("key/bias"),) if bias else (),
      name="attention Q/K",
    ),
    Pair(
      p("value/kernel"),
      p("out/kernel"),
      axes=(1, 0),
      stacked=stacked,
      follow_a=(p("value/bias"),) if bias else (),
      name="attention V/O",
    ),
  ]


linen_mha = flax_mha
nnx_mha = flax_mha


def llama(
  num_kv_heads: int,
  *,
  mlp: bool = True,
  bias: bool = False,
  stacked: int = 0,
  prefix: str | None = None,
  q: str = "q_proj",
  k: str = "k_proj",
  v: str = "v_proj",
  o: str = "o_proj",
  up: str = "up_proj",
  down: str = "down_proj",
) -> list[Pair]:
  """Q/K and V/O per KV head (GQA) and SwiGLU up/down per channel, LLaMA naming.

  Kernels are Flax Dense (in, out): q (d, H*hd), k and v (d, KVH*hd),
  o (H*hd, d), up (d, F), down (F, d). Query head h reads KV head
  ``h // (H // KVH)``, so each KV head's query heads form one contiguous block
  and one factor serves Q/K and V/O of the whole block. Exact with RoPE; with a
  per-head QK-norm the Q/K pair is exact but moot, with one norm over all heads
  it is not exact (drop it).

  Args:
    num_kv_heads: number of KV heads (= heads without GQA).
    mlp: include the SwiGLU up/down pair.
    bias: the q/k/v projections have biases that move with their kernels.
    stacked: leading layer axes of scanned layers.
    prefix: restricts the patterns to part of the tree.
    q, k, v, o, up, down: module names.

  Example:
    >>> import saggs_jax as saggs
    >>> pairs = saggs.presets.llama(num_kv_heads=2)
  """

  def p(module, leaf="kernel"):
    return _join(prefix, f"{module}/{leaf}")

  def biases(*modules):
    return tuple(p(m, "bias") for m in modules) if bias else ()

  pairs = [
    Pair(
      p(q),
      p(k),
      axes=(1, 1),
      groups=num_kv_heads,
      stacked=stacked,
      follow_a=biases(q),
      follow_b=biases(k),
      name="attention Q/K",
    ),
    Pair(
      p(v),
      p(o),
      axes=(1, 0),
      groups=num_kv_heads,
      stacked=stacked,
      follow_a=biases(v),
      name="attention V/O",
    ),
  ]
  if mlp:
    pairs.append(Pair(p(up), p(down), axes=(1, 0), stacked=stacked, name="SwiGLU up/down"))
  return pairs


def gpt2(
  num_heads: int, *, norms: bool = True, stacked: int = 0, prefix: str | None = None
) -> list[Pair]:
  """Q/K and V/O per head in GPT-2's fused attention, and each LayerNorm against the input
  columns that read it (Hugging Face Flax names and layout).

  Hugging Face's ``FlaxConv1D`` stores kernels (out, in): ``attn/c_attn/kernel``
  (3d, d) holds q, k and v as blocks of rows (its output axis 0), and
  ``attn/c_attn/bias`` (3d,) likewise; head h is rows ``h*hd ... (h+1)*hd`` of
  each block. Q/K and V/O take :class:`~saggs_jax.Block` s of them, with the
  q, k and v biases moving with their rows, and the input columns (axis 1) of
  ``attn/c_proj/kernel`` (d, d) on the other side of V/O. ``ln_1`` (gain and
  bias per channel) pairs with the input columns of ``c_attn``, ``ln_2`` with
  those of ``mlp/c_fc/kernel`` (4d, d); ``c_attn`` is then in three pairs at
  once, balanced jointly. The GELU MLP has no pair.

  Args:
    num_heads: the number of attention heads.
    norms: include the two LayerNorm pairs of each layer.
    stacked: leading layer axes of scanned layers.
    prefix: restricts the patterns to part of the tree.

  Example:
    >>> import saggs_jax as saggs
    >>> pairs = saggs.presets.gpt2(num_heads=12)
    >>> pairs[0].a
    Block('attn/c_attn/kernel', axis=0, parts=('q', 'k', 'v'), part='q')
  """

  def p(name):
    return _join(prefix, name)

  def qkv(leaf, part):
    return Block(p(f"attn/c_attn/{leaf}"), axis=0, parts=("q", "k", "v"), part=part)

  pairs = [
    Pair(
      qkv("kernel", "q"),
      qkv("kernel", "k"),
      axes=(0, 0),
      groups=num_heads,
      stacked=stacked,
      follow_a=qkv("bias", "q"),
      follow_b=qkv("bias", "k"),
      name="attention Q/K",
    ),
    Pair(
      qkv("kernel", "v"),
      p("attn/c_proj/kernel"),
      axes=(0, 1),
      groups=num_heads,
      stacked=stacked,
      follow_a=qkv("bias", "v"),
      name="attention V/O",
    ),
  ]
  if norms:  # each LayerNorm against the input columns of the kernel that reads it
    pairs += [
      Pair(
        p(f"{ln}/scale"),
        p(reader),
        axes=(0, 1),
        stacked=stacked,
        follow_a=p(f"{ln}/bias"),
        name=f"LayerNorm {ln}",
      )
      for ln, reader in (("ln_1", "attn/c_attn/kernel"), ("ln_2", "mlp/c_fc/kernel"))
    ]
  return pairs


# The hidden matrices of each layout for Muon; negative axes, so that the
# leading axes of scanned layers are batched too.
_MUON_LAYOUTS: dict[str, dict[tuple[str, ...], MuonDimensionNumbers]] = {
  # Dense (in, out) kernels.
  "llama": {
    (
      "q_proj/kernel",
      "k_proj/kernel",
      "v_proj/kernel",
      "o_proj/kernel",
      "gate_proj/kernel",
      "up_proj/kernel",
      "down_proj/kernel",
    ): MuonDimensionNumbers(-2, -1)
  },
  # (d, H, hd) query/key/value and (H, hd, d) output kernels: one matrix per head.
  "flax_mha": {
    ("query/kernel", "key/kernel", "value/kernel"): MuonDimensionNumbers(-3, -1),
    ("out/kernel",): MuonDimensionNumbers(-2, -1),
  },
  # FlaxConv1D (out, in) kernels; c_attn's q, k and v blocks form one matrix.
  "gpt2": {
    (
      "attn/c_attn/kernel",
      "attn/c_proj/kernel",
      "mlp/c_fc/kernel",
      "mlp/c_proj/kernel",
    ): MuonDimensionNumbers(-1, -2)
  },
}


def muon_dimension_numbers(
  params: Any, layout: Literal["llama", "flax_mha", "gpt2"], *, prefix: str | None = None
) -> Any:
  """The ``muon_weight_dimension_numbers`` tree of ``optax.contrib.muon`` for a preset layout.

  The hidden matrices of :func:`llama` (q/k/v/o and the SwiGLU kernels),
  :func:`flax_mha` (one matrix per head: the heads axis is batched) or
  :func:`gpt2` get their ``MuonDimensionNumbers``; every other leaf (norms,
  biases, embeddings, the LM head) ``None``, which Muon leaves to AdamW. The
  same declarations serve :func:`saggs_jax.equivariant.scale_by_polar`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import saggs_jax as saggs
    >>> params = {"attn": {"query": {"kernel": jnp.ones((8, 2, 4))}, "out": {"kernel": jnp.ones((2, 4, 8))}},
    ...           "ln": {"scale": jnp.ones(8)}}
    >>> dims = saggs.presets.muon_dimension_numbers(params, "flax_mha")
    >>> dims["attn"]["query"]["kernel"], dims["ln"]["scale"]
    (MuonDimensionNumbers(reduction_axis=-3, output_axis=-1), None)
    >>> tx = optax.contrib.muon(0.02, muon_weight_dimension_numbers=dims)
    >>> updates, _ = tx.update(params, tx.init(params), params)
  """
  if layout not in _MUON_LAYOUTS:
    raise ValueError(f"Unknown layout {layout!r}; expected one of {sorted(_MUON_LAYOUTS)}.")
  return _from_patterns(
    params,
    {tuple(_join(prefix, p) for p in pats): dims for pats, dims in _MUON_LAYOUTS[layout].items()},
  )
