"""``saggs.presets.maxtext`` and ``saggs.equivariant.muon_dimension_numbers(..., "maxtext")`` on MaxText
0.2.5's own deepseek (MLA, dense layers, shared and routed experts) and gemma, gemma2, gemma3
decoders (``zoo_maxtext``, random weights): every pair instance exact on the logits, the
non-symmetries next to them not, and the Muon numbers against MaxText's ``muon_utils``.
Needs .ci/zoo's venv: skipped where MaxText is not installed."""

import functools
import warnings

import jax
import optax
import pytest

pytestmark = [
  pytest.mark.heavy,
  pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # MaxText's: see test_zoo_maxtext
]

pytest.importorskip("maxtext", reason="MaxText is not installed: see .ci/zoo maxtext")

import saggs_jax as saggs  # noqa: E402
import zoo_maxtext  # noqa: E402
from saggs_jax._src import paths  # noqa: E402
from saggs_jax._src.plan import resolve  # noqa: E402
from zoo_models import tokens  # noqa: E402

# gemma3 with 7 layers: one scanned block of its 6-layer pattern and one unscanned remainder
MODELS = {"deepseek": {}, "gemma": {}, "gemma2": {}, "gemma3": dict(base_num_decoder_layers=7)}
NAMES = {
  "deepseek": [
    "MLA Q/K (non-rotary)",
    "MLA V/O",
    "MLP wi_1/wo",
    "shared experts wi_1/wo",
    "MoE wi_1/wo",
  ],
  "gemma": ["attention Q/K", "attention V/O", "MLP wi_1/wo"],
  "gemma2": ["attention Q/K", "attention V/O", "MLP wi_1/wo"],
  "gemma3": ["attention V/O", "MLP wi_1/wo"] * 2,  # QK-norm: no Q/K
}


@functools.cache
def model(name):
  cfg, params, apply = zoo_maxtext.build(name, **MODELS[name])
  return cfg, params, jax.jit(apply)


def not_symmetries(name):
  """The gate against the down projection (the activation is between them): in deepseek's
  dense MLPs, shared experts and routed experts too."""
  if name != "deepseek":  # gemma3's scanned block: layers/layers_<j>
    mlp = "layers/layers_*/mlp" if name == "gemma3" else "mlp*"
    return [saggs.Pair(f"{mlp}/wi_0/kernel", f"{mlp}/wo/kernel", axes=(1, 0), stacked=(1,))]
  return [
    saggs.Pair(f"{m}/wi_0/kernel", f"{m}/wo/kernel", axes=(1, 0), stacked=(1,))
    for m in ("mlp", "shared_experts")
  ] + [saggs.Pair("MoeBlock_0/wi_0", "MoeBlock_0/wo", axes=(1, 0), stacked=(0, 1))]


@pytest.mark.parametrize("name", list(MODELS))
def test_maxtext_preset_is_exact_pair_by_pair(name):
  cfg, params, apply = model(name)
  pairs = saggs.presets.maxtext(cfg)
  assert [p.name for p in pairs] == NAMES[name]
  x = tokens()
  with warnings.catch_warnings(record=True) as moot:
    warnings.simplefilter("always", saggs.MootPairWarning)
    deviations = saggs.check_symmetry(apply, params, pairs, x)  # each instance on its own
  # gemma2/3 normalize the attention's and the MLP's outputs (post_self_attention_norm,
  # post_ffw_norm): one factor common to every head (channel) is invisible on either side, but
  # factors that differ per head (channel) are not, so no pair is moot.
  assert [str(w.message) for w in moot] == []
  assert len(deviations) == len(resolve(pairs, params).instances)
  for bad in not_symmetries(name):
    with pytest.raises(ValueError, match="is not a symmetry of the model"):
      saggs.check_symmetry(apply, params, [bad], x)


def differences(name):
  """Leaves where saggs.equivariant.muon_dimension_numbers(..., "maxtext") and MaxText's
  ``muon_utils.transform_logic`` differ, as the same axes made non-negative."""
  from maxtext.utils import muon_utils

  def absolute(dims, ndim):
    as_tuple = lambda axes: (axes,) if isinstance(axes, int) else axes  # noqa: E731
    return dims and tuple(tuple(sorted(a % ndim for a in as_tuple(axes))) for axes in dims)

  _, params, _ = model(name)
  ours = saggs.equivariant.muon_dimension_numbers(params, "maxtext")
  is_dn = lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)  # noqa: E731
  flat = jax.tree_util.tree_flatten_with_path(ours, is_leaf=is_dn)[0]
  ours = {paths.path_str(k): v for k, v in flat}
  differ = {}
  for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    path = tuple(str(getattr(k, "key", k)) for k in kp)
    theirs, mine = muon_utils.transform_logic(path, shape=x.shape), ours["/".join(path)]
    if absolute(mine, x.ndim) != absolute(theirs, x.ndim):
      differ["/".join(path)] = (x.shape, mine, theirs)
  return differ


# MaxText's transform_logic knows attention by the module name ``self_attention``: gemma2's
# self_attention_local/_global get its default ((0,), (-1,)), which for query/key/value is one
# (emb, head_dim) matrix per head and for out reduces over the heads axis alone.
GEMMA2_ATTENTION = {
  f"decoder/layers/self_attention_{kind}/{name}/kernel"
  for kind in ("local", "global")
  for name in ("query", "key", "value", "out")
}
EXPECTED_DIFFERENCES = {
  "deepseek": set(),
  "gemma": set(),
  "gemma2": GEMMA2_ATTENTION,
  "gemma3": set(),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_maxtext_muon_dimension_numbers_against_maxtexts_own(name):
  differ = differences(name)
  assert set(differ) == EXPECTED_DIFFERENCES[name], "\n".join(f"{p} {v}" for p, v in differ.items())
