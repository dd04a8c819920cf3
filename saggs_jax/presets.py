"""Ready-made pair declarations for common Flax attention and LLaMA-style layouts.

Patterns are anchored at the end of a path and pair up within one module, so
they apply to every layer of a model at once; ``prefix`` restricts them to
part of the tree (e.g. ``"decoder/**"``).
"""

from __future__ import annotations

from saggs_jax.pairs import Pair


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

  Example::

    >>> import saggs_jax as saggs
    >>> pairs = saggs.presets.flax_mha()
  """
  def p(name):
    return _join(prefix, name)

  return [
      Pair(p("query/kernel"), p("key/kernel"), axes=(1, 1), stacked=stacked,
           follow_a=(p("query/bias"),) if bias else (), follow_b=(p("key/bias"),) if bias else (),
           name="attention Q/K"),
      Pair(p("value/kernel"), p("out/kernel"), axes=(1, 0), stacked=stacked,
           follow_a=(p("value/bias"),) if bias else (), name="attention V/O"),
  ]


linen_mha = flax_mha
nnx_mha = flax_mha


def llama(num_kv_heads: int, *, mlp: bool = True, bias: bool = False, stacked: int = 0,
          prefix: str | None = None, q: str = "q_proj", k: str = "k_proj", v: str = "v_proj",
          o: str = "o_proj", up: str = "up_proj", down: str = "down_proj") -> list[Pair]:
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

  Example::

    >>> import saggs_jax as saggs
    >>> pairs = saggs.presets.llama(num_kv_heads=2)
  """
  def p(module, leaf="kernel"):
    return _join(prefix, f"{module}/{leaf}")

  def biases(*modules):
    return tuple(p(m, "bias") for m in modules) if bias else ()

  pairs = [
      Pair(p(q), p(k), axes=(1, 1), groups=num_kv_heads, stacked=stacked,
           follow_a=biases(q), follow_b=biases(k), name="attention Q/K"),
      Pair(p(v), p(o), axes=(1, 0), groups=num_kv_heads, stacked=stacked,
           follow_a=biases(v), name="attention V/O"),
  ]
  if mlp:
    pairs.append(Pair(p(up), p(down), axes=(1, 0), stacked=stacked, name="SwiGLU up/down"))
  return pairs
