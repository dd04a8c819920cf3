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
  """Q/K and V/O per KV head (GQA) and SwiGLU up/down per channel, LLaMA naming.

  Flax Dense kernels (in, out): ``q·c`` with ``k/c`` and ``v·c`` with ``o/c`` per block of
  query heads sharing a KV head, ``up·c`` with ``down/c`` per hidden channel; exact with
  RoPE. QK-norm models pair the norms' gains instead; stacked MoE experts pair up/down per
  expert (the layouts and caveats: ``docs/declaring.md``).

  Args:
    num_kv_heads: number of KV heads (= heads without GQA).
    mlp: include the dense SwiGLU up/down pair (default True; False when every MLP is
      experts, whose kernels the dense pattern would match and refuse).
    bias: the q/k/v projections have biases that move with their kernels (default False).
    stacked: the copy axes of scanned layers (see :class:`~saggs_jax.Pair`); default 0.
    prefix: restricts the patterns to part of the tree; default the whole tree.
    names: the module names, and the QK norms' leaf names (:class:`LlamaNames`).
    qk_norm: ``"head"`` (Qwen3, Gemma 3) or ``"all"`` (OLMoE), the QK-norm's extent;
      default None: no QK-norm.
    experts: the module holding the stacked experts, e.g. ``"mlp/experts"``; default None.
    expert_leaf: the leaf name of the experts' kernels (default ``"kernel"``), or None
      for bare leaves.

  Returns:
    The list of :class:`~saggs_jax.Pair`.

  Raises:
    TypeError: ``names`` is not a :class:`LlamaNames`.
    ValueError: an unknown ``qk_norm``; where the pairs meet the parameters, a leaf of
      the wrong rank or a QK-norm bias paired on its own, naming the path.

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

  Q/K and V/O per KV head, MLP ``wi_1``/``wo`` per channel (per expert and layer in a MoE
  block), MLA's non-rotary Q/K and V/O per head for ``deepseek``; each scanned leaf's layer
  axis is a copy axis, so every layer has factors of its own. Norm gains and the router are
  not declared. The layouts and each block's pairs: ``docs/maxtext.md``.

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
    prefix: restricts the patterns to part of the tree; default the whole tree.

  Returns:
    The list of :class:`~saggs_jax.Pair`.

  Raises:
    ValueError: a ``decoder_block`` not covered, a ``param_scan_axis`` other than 0 or 1,
      no ``num_kv_heads``; where the pairs meet the parameters, a leaf of another rank.

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
