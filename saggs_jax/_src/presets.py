"""The implementation of :mod:`saggs_jax.presets`: declarations for known layouts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

from saggs_jax._src.pairs import Block, Pair


def _join(prefix: str | None, name: str) -> str:
  return f"{prefix}/{name}" if prefix else name


def flax_mha(
  *, bias: bool = True, stacked: int | tuple[int, ...] = 0, prefix: str | None = None
) -> list[Pair]:
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
      ndim=(3, 3),
    ),
    Pair(
      p("value/kernel"),
      p("out/kernel"),
      axes=(1, 0),
      stacked=stacked,
      follow_a=(p("value/bias"),) if bias else (),
      name="attention V/O",
      ndim=(3, 3),
    ),
  ]


class LlamaNames(NamedTuple):
  """The module and leaf names :func:`llama` reads, LLaMA's (Hugging Face Flax) by default.

  Attributes:
    q, k, v, o, up, down: the projections' module names (MaxText's ``query``, ``key``,
      ``value``, ``out``; Mistral's ``wq``, ``wo``, ...).
    q_norm, k_norm: the QK norms' module names (Persimmon's ``q_layernorm``).
    qk_norm_gain: the leaf name of the QK norms' gain; default any one leaf (``*``), or
      ``"scale"`` (Flax's ``LayerNorm``) with ``qk_norm_bias``, which a wildcard would
      also match.
    qk_norm_bias: the leaf name of the QK norms' bias (``"bias"``), which then moves with
      the gain; None: the norms have no bias.

  Example:
    >>> LlamaNames(q="wq", o="wo").q
    'wq'
  """

  q: str = "q_proj"
  k: str = "k_proj"
  v: str = "v_proj"
  o: str = "o_proj"
  up: str = "up_proj"
  down: str = "down_proj"
  q_norm: str = "q_norm"
  k_norm: str = "k_norm"
  qk_norm_gain: str | None = None
  qk_norm_bias: str | None = None


def llama(
  num_kv_heads: int,
  *,
  mlp: bool = True,
  bias: bool = False,
  stacked: int | tuple[int, ...] = 0,
  prefix: str | None = None,
  names: LlamaNames = LlamaNames(),
  qk_norm: Literal["head", "all"] | None = None,
  experts: str | None = None,
  expert_leaf: str | None = "kernel",
) -> list[Pair]:
  """Q/K and V/O per KV head (GQA) and SwiGLU up/down per channel, LLaMA naming; QK-norm
  (Qwen3, Gemma 3, OLMoE) and stacked MoE experts (OLMoE, Qwen3-MoE) too.

  Kernels are Flax Dense (in, out): q (d, H*hd), k and v (d, KVH*hd),
  o (H*hd, d), up (d, F), down (F, d). Query head h reads KV head
  ``h // (H // KVH)``, so each KV head's query heads form one contiguous block
  and one factor serves Q/K and V/O of the whole block. Exact with RoPE.

  Under a QK-norm the Q/K kernel pair is left out: a per-head norm makes it moot
  (each side is scale-invariant), one norm over all heads makes it inexact. The
  norms' gains pair instead, ``q_norm`` against ``k_norm`` (their one leaf each):
  ``qk_norm="head"`` (Qwen3, Gemma 3: each head normalised over ``hd``, one gain
  (hd,) shared by the heads) gives one factor per layer, a scalar, which commutes
  with RoPE; ``qk_norm="all"`` (OLMoE: one norm over the H*hd query, gain (H*hd,))
  gives one factor per KV head, for the query heads that read it. A QK LayerNorm with a
  bias (Persimmon, StableLM: ``q = γ n(x) + β``) scales ``q`` only if its bias moves with
  its gain by the same factor: name the bias leaf, ``names=LlamaNames(qk_norm_bias="bias")``,
  and it follows the gain. Without it the default gain pattern (any leaf of each norm) also matches the
  bias, which a factor of its own would move off the symmetry: the pairs refuse it, naming
  the bias, where they first meet the parameters.

  ``experts`` names the module of stacked experts, ``<experts>/<up>`` (E, d, F) and
  ``<experts>/<down>`` (E, F, d) (each ``/<expert_leaf>``, or bare leaves when it is
  None): up/down per channel of each expert. The expert axis is the first axis that
  is not a layer copy axis of ``stacked``. The gated activation must be
  ``act(gate) * up`` (gpt-oss's clamped ``(up + 1)`` is not homogeneous in ``up``).

  Args:
    num_kv_heads: number of KV heads (= heads without GQA).
    mlp: include the dense SwiGLU up/down pair (False for a model whose MLPs are all
      experts: the dense pattern would also match the experts' kernels, and refuse
      their rank).
    bias: the q/k/v projections have biases that move with their kernels.
    stacked: the copy axes of scanned layers (see :class:`~saggs_jax.Pair`).
    prefix: restricts the patterns to part of the tree.
    names: the module names, and the QK norms' leaf names (:class:`LlamaNames`).
    qk_norm: ``"head"`` or ``"all"``, the QK-norm's extent (above); None: no QK-norm.
    experts: the module holding the stacked experts, e.g. ``"mlp/experts"``.
    expert_leaf: the leaf name of the experts' kernels, or None for bare leaves.

  Example:
    >>> import saggs_jax as saggs
    >>> pairs = saggs.presets.llama(num_kv_heads=2)
    >>> [pair.name for pair in saggs.presets.llama(2, qk_norm="head", experts="mlp/experts",
    ...                                            mlp=False)]
    ['attention V/O', 'QK-norm gains', 'expert up/down']
  """

  def p(module, leaf="kernel"):
    return _join(prefix, f"{module}/{leaf}")

  def biases(*modules):
    return tuple(p(m, "bias") for m in modules) if bias else ()

  if not isinstance(names, LlamaNames):
    raise TypeError(f"llama: names must be a saggs_jax.presets.LlamaNames, got {names!r}.")
  q, k, v, o, up, down, q_norm, k_norm, qk_norm_gain, qk_norm_bias = names
  if qk_norm not in (None, "head", "all"):
    raise ValueError(f"llama: qk_norm must be None, 'head' or 'all', got {qk_norm!r}.")
  gain = qk_norm_gain or ("*" if qk_norm_bias is None else "scale")
  if qk_norm_bias is not None and "*" in gain:
    raise ValueError(
      f"llama: qk_norm_gain={gain!r} would also match the bias {qk_norm_bias!r}, pairing it"
      " apart from its gain; name the gain's leaf (LlamaNames(qk_norm_gain='scale' or"
      " 'weight'))."
    )
  vo = Pair(
    p(v),
    p(o),
    axes=(1, 0),
    groups=num_kv_heads,
    stacked=stacked,
    follow_a=biases(v),
    name="attention V/O",
    ndim=(2, 2),
  )
  if qk_norm is None:
    qk = Pair(
      p(q),
      p(k),
      axes=(1, 1),
      groups=num_kv_heads,
      stacked=stacked,
      follow_a=biases(q),
      follow_b=biases(k),
      name="attention Q/K",
      ndim=(2, 2),
    )
    pairs = [qk, vo]
  else:
    follow = qk_norm_bias is not None  # a LayerNorm's bias moves with its gain
    gains = Pair(
      p(q_norm, gain),
      p(k_norm, gain),
      axes=(0, 0),
      groups=1 if qk_norm == "head" else num_kv_heads,
      stacked=stacked,
      follow_a=(p(q_norm, qk_norm_bias),) if follow else (),
      follow_b=(p(k_norm, qk_norm_bias),) if follow else (),
      name="QK-norm gains",
      ndim=(1, 1),
    )
    pairs = [vo, gains]
  if mlp:
    pairs.append(
      Pair(p(up), p(down), axes=(1, 0), stacked=stacked, name="SwiGLU up/down", ndim=(2, 2))
    )
  if experts is not None:
    layers = tuple(range(stacked)) if isinstance(stacked, int) else tuple(stacked)
    expert_axis = next(i for i in range(len(layers) + 1) if i not in layers)
    leaf = "" if expert_leaf is None else f"/{expert_leaf}"
    pairs.append(
      Pair(
        _join(prefix, f"{experts}/{up}{leaf}"),
        _join(prefix, f"{experts}/{down}{leaf}"),
        axes=(1, 0),
        stacked=tuple(sorted((*layers, expert_axis))),
        name="expert up/down",
        ndim=(2, 2),
      )
    )
  return pairs


def gpt2(
  num_heads: int,
  *,
  norms: bool = True,
  stacked: int | tuple[int, ...] = 0,
  prefix: str | None = None,
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
    stacked: the copy axes of scanned layers (see :class:`~saggs_jax.Pair`).
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
      ndim=(2, 2),
    ),
    Pair(
      qkv("kernel", "v"),
      p("attn/c_proj/kernel"),
      axes=(0, 1),
      groups=num_heads,
      stacked=stacked,
      follow_a=qkv("bias", "v"),
      name="attention V/O",
      ndim=(2, 2),
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
        ndim=(1, 2),
      )
      for ln, reader in (("ln_1", "attn/c_attn/kernel"), ("ln_2", "mlp/c_fc/kernel"))
    ]
  return pairs


_MAXTEXT_BLOCKS = {  # decoder_block -> its Q/K pair is exact and not moot
  "llama2": True,
  "mistral": True,
  "mixtral": True,
  "gemma": True,
  "gemma2": True,
  "qwen3": False,  # QK-norm: Q and K are each scale-invariant, the pair is moot
  "gemma3": False,  # QK-norm
  "deepseek": True,  # MLA (see _maxtext_mla); dense MLPs, shared and routed experts
}


def _setting(config: Any, name: str, given: Any, default: Any) -> Any:
  """``given`` if not None, else ``config``'s attribute or key ``name``, else ``default``."""
  if given is not None:
    return given
  if isinstance(config, Mapping):
    value = config.get(name)
  else:
    value = getattr(config, name, None)
  value = getattr(value, "value", value)  # an enum (DecoderBlockType)
  return default if value is None else value


def maxtext(
  config: Any = None,
  *,
  num_kv_heads: int | None = None,
  decoder_block: str | None = None,
  scan_layers: bool | None = None,
  param_scan_axis: int | None = None,
  num_experts: int | None = None,
  prefix: str | None = None,
) -> list[Pair]:
  """The exact pairs of a MaxText decoder block, per layer on its scanned layer axis.

  MaxText (``maxtext``) keeps DenseGeneral kernels with their heads axes apart:
  ``self_attention/query/kernel`` (emb, heads, head_dim), ``key`` and ``value``
  (emb, kv_heads, head_dim), ``out`` (heads, head_dim, emb), ``mlp/wi_0`` (the gate)
  and ``wi_1`` (emb, mlp), ``wo`` (mlp, emb), MoE experts ``MoeBlock_0/wi_0|wi_1``
  (experts, emb, mlp) and ``wo`` (experts, mlp, emb). With ``scan_layers`` (the
  default) every one of them has a layer axis inserted at ``param_scan_axis`` (1 by
  default, 0 optionally; the experts' is at 1 either way), which the pairs take as their
  copy axis, so that every layer (and expert) has factors of its own. Unscanned trees
  (``decoder/layers_0/...``) match as well.

  * Q/K per KV head group (``groups=num_kv_heads``): exact with RoPE, each query head
    reading KV head ``h // (heads // kv_heads)``. Left out for ``qwen3`` and
    ``gemma3``, whose per-head QK-norm makes Q and K each scale-invariant (the pair is
    exact but moot).
  * V/O per KV head.
  * ``wi_1``/``wo`` per channel: in ``act(x wi_0) * (x wi_1) wo`` only the linear
    ``wi_1`` pairs with ``wo`` (scaling the gate ``wi_0`` goes through the activation);
    per expert and layer in a MoE block (``num_experts > 1``, which replaces the dense
    MLP).
  * ``deepseek`` (MLA): its ``wkv_b`` (kv_lora, heads, qk_nope + v) holds each head's
    non-rotary key and its value; Q/K pairs the non-rotary part of the query
    (``query``, or ``wq_b`` with ``q_lora_rank > 0``; (…, heads, qk_nope + qk_rope))
    with the key's, per head (the rotary part is shared by all heads through
    ``wkv_a``, so it cannot move), and V/O the value part with ``out``; ``wi_1``/``wo`` of
    its ``first_num_dense_layers`` dense MLPs and, in its MoE layers
    (``num_experts > 1``), of ``shared_experts`` and of the routed experts.
  * ``gemma2``: ``self_attention_local``/``_global`` and ``mlp_local``/``_global`` each.
    ``gemma3``: scanned in blocks of its 6-layer attention pattern
    (``layers/layers_<j>``), the remaining layers unscanned (``layers_remainder``), from
    ``num_decoder_layers``. Their post-norms make V/O and the MLP moot for one factor
    common to all heads (channels), not for factors that differ per head (channel).

  Norm gains and the router are not declared. Each pair checks the rank of its
  leaves, so that another layout is an error naming the path rather than a
  declaration along the wrong axes.

  Args:
    config: MaxText's config (``pyconfig.initialize(...)``) or a mapping with its keys;
      the keywords below override it. MLA's (deepseek) ``qk_nope_head_dim``,
      ``qk_rope_head_dim``, ``v_head_dim`` and ``q_lora_rank`` are read from it.
    num_kv_heads: KV heads.
    decoder_block: one of ``llama2``, ``mistral``, ``mixtral``, ``gemma``, ``gemma2``,
      ``gemma3``, ``qwen3``, ``deepseek``; default ``llama2``.
    scan_layers: whether the layers are scanned (default True).
    param_scan_axis: the layer axis of scanned parameters (default 1).
    num_experts: experts per MoE layer (default 1: a dense MLP).
    prefix: restricts the patterns to part of the tree.

  Example:
    >>> import saggs_jax as saggs
    >>> pairs = saggs.presets.maxtext({"num_kv_heads": 2, "decoder_block": "llama2"})
    >>> [(pair.name, pair.stacked) for pair in pairs]
    [('attention Q/K', (1,)), ('attention V/O', (1,)), ('MLP wi_1/wo', (1,))]
  """
  block = str(_setting(config, "decoder_block", decoder_block, "llama2")).lower()
  if block not in _MAXTEXT_BLOCKS:
    raise ValueError(
      f"presets.maxtext: decoder_block {block!r} is not covered; expected one of"
      f" {sorted(_MAXTEXT_BLOCKS)}."
    )
  qk_exact = _MAXTEXT_BLOCKS[block]
  scanned = bool(_setting(config, "scan_layers", scan_layers, True))
  axis = int(_setting(config, "param_scan_axis", param_scan_axis, 1))
  if axis not in (0, 1):
    raise ValueError(f"presets.maxtext: param_scan_axis must be 0 or 1, got {axis}.")
  experts = int(_setting(config, "num_experts", num_experts, 1))
  layer: tuple[int, ...] = (axis,) if scanned else ()
  expert = (0, 1) if scanned else (0,)  # (experts, layers, ...) or (layers, experts, ...)

  def p(module, leaf="kernel"):
    return _join(prefix, f"{module}/{leaf}")

  if block == "deepseek":
    mla = _maxtext_mla(config, p, "self_attention", layer)
    return mla + _maxtext_deepseek_mlps(config, p, layer, expert, experts, prefix)
  kv = int(_setting(config, "num_kv_heads", num_kv_heads, 0))
  if kv < 1:
    raise ValueError("presets.maxtext: pass num_kv_heads (or a config with it).")
  if block == "gemma3" and scanned:  # see _gemma3_stacks
    return [
      pair
      for scope, stacked in _gemma3_stacks(config, layer)
      for pair in _maxtext_attention_mlp(
        lambda m, leaf="kernel", scope=scope: p(scope + m, leaf), qk_exact, kv, stacked
      )
    ]
  pairs = _maxtext_attention_mlp(p, qk_exact, kv, layer)
  return (pairs[:-1] + [_moe(prefix, expert)]) if experts > 1 else pairs  # MoE replaces the MLP


# MaxText scans gemma3's layers in blocks of its 6-layer attention pattern (5 local, 1 global):
# decoder/layers/layers_<0..5> with the layer axis, the remaining layers unscanned in
# decoder/layers_remainder/layers_<i>.
_GEMMA3_PATTERN = 6


def _gemma3_stacks(config, layer) -> list[tuple[str, tuple[int, ...]]]:
  """The scopes of gemma3's scanned and unscanned layers that the config has, with their
  copy axes."""
  layers = _setting(config, "num_decoder_layers", None, None)
  if layers is None:
    raise ValueError(
      "presets.maxtext: gemma3 with scan_layers needs num_decoder_layers (or a config with"
      " it): MaxText scans its layers in blocks of 6 and leaves the rest in layers_remainder."
    )
  blocks, rest = divmod(int(layers), _GEMMA3_PATTERN)
  return [("layers/layers_*/", layer)] * bool(blocks) + [("layers_remainder/layers_*/", ())] * bool(
    rest
  )


def _maxtext_attention_mlp(p, qk: bool, kv: int, layer) -> list[Pair]:
  """Q/K (if ``qk``) and V/O per KV head, the dense MLP's wi_1/wo per channel."""
  attn = "self_attention*"  # gemma2's self_attention_local and _global too
  pairs = [
    Pair(
      p(f"{attn}/{a}"),
      p(f"{attn}/{b}"),
      axes=axes,
      groups=kv,
      stacked=layer,
      name=f"attention {name}",
      ndim=(3, 3),
    )
    for a, b, axes, name in (("query", "key", (1, 1), "Q/K"), ("value", "out", (1, 0), "V/O"))
    if qk or name == "V/O"
  ]
  return pairs + [_mlp(p, "mlp*", layer, "MLP wi_1/wo")]


def _mlp(p, module, layer, name) -> Pair:
  """``wi_1``/``wo`` of a gated MLP per channel (gemma2's ``mlp_local``, ``mlp_global`` too)."""
  return Pair(
    p(f"{module}/wi_1"), p(f"{module}/wo"), axes=(1, 0), stacked=layer, name=name, ndim=(2, 2)
  )


def _moe(prefix, expert) -> Pair:
  """``wi_1``/``wo`` per expert (and layer); MaxText's experts are bare leaves, no kernel."""
  return Pair(
    _join(prefix, "MoeBlock_0/wi_1"),
    _join(prefix, "MoeBlock_0/wo"),
    axes=(1, 0),
    stacked=expert,
    name="MoE wi_1/wo",
    ndim=(2, 2),
  )


def _maxtext_deepseek_mlps(config, p, layer, expert, experts, prefix) -> list[Pair]:
  """DeepSeek's ``first_num_dense_layers`` dense MLPs, then per MoE layer its shared experts
  (one gated MLP) and routed experts, where the config has them."""
  dense = int(_setting(config, "first_num_dense_layers", None, 0))
  layers = _setting(config, "num_decoder_layers", None, None)
  pairs = [_mlp(p, "mlp", layer, "MLP wi_1/wo")] if dense > 0 else []
  if experts > 1 and (layers is None or int(layers) > dense):
    pairs += [_mlp(p, "shared_experts", layer, "shared experts wi_1/wo"), _moe(prefix, expert)]
  return pairs


def _maxtext_mla(config, p, attn, layer) -> list[Pair]:
  """MLA's Q/K (non-rotary parts) and V/O per head (see :func:`maxtext`)."""
  nope = int(_setting(config, "qk_nope_head_dim", None, 0))
  rope = int(_setting(config, "qk_rope_head_dim", None, 0))
  v = int(_setting(config, "v_head_dim", None, 0))
  if min(nope, rope, v) < 1:
    raise ValueError(
      "presets.maxtext: deepseek (MLA) needs qk_nope_head_dim, qk_rope_head_dim and"
      " v_head_dim in its config (MaxText's, or a mapping with them)."
    )
  query = "wq_b" if int(_setting(config, "q_lora_rank", None, 0)) > 0 else "query"
  kv_parts = ("k_nope", "v")
  return [
    Pair(
      Block(p(f"{attn}/{query}"), axis=2, parts=("nope", "rope"), part="nope", sizes=(nope, rope)),
      Block(p(f"{attn}/wkv_b"), axis=2, parts=kv_parts, part="k_nope", sizes=(nope, v)),
      axes=(1, 1),
      stacked=layer,
      name="MLA Q/K (non-rotary)",
      ndim=(3, 3),
    ),
    Pair(
      Block(p(f"{attn}/wkv_b"), axis=2, parts=kv_parts, part="v", sizes=(nope, v)),
      p(f"{attn}/out"),
      axes=(1, 0),
      stacked=layer,
      name="MLA V/O",
      ndim=(3, 3),
    ),
  ]
