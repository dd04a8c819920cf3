"""The zoo, MaxText 0.2.5: tiny llama2, mistral, mixtral, qwen3 and deepseek configs with random
weights (``zoo_maxtext``), scanned with MaxText's default ``param_scan_axis=1``, plus llama2
with ``param_scan_axis=0`` and unscanned.

Every check of ``zoo_oracle.CHECKS``; the hand-written per-layer declarations
(``stacked=(1,)``) balanced one layer at a time; ``saggs.presets.maxtext``; and discover's
Muon dimension numbers against MaxText's own. Needs .ci/zoo's venv
(``.ci/zoo-maxtext-requirements.txt``): skipped where MaxText is not installed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytestmark = [
  pytest.mark.heavy,  # run by .ci/zoo (pytest -m heavy), not by default
  # MaxText 0.2.5 calls what jax 0.11.1 and flax 0.12.12 deprecate (jax.random's `sharding=`,
  # nnx.Rngs.fork's `split=`, `with mesh:`): MaxText's warnings, not ours
  pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

pytest.importorskip("maxtext", reason="MaxText is not installed: see .ci/zoo maxtext")

import saggs_jax as saggs  # noqa: E402
import zoo_maxtext  # noqa: E402
import zoo_oracle  # noqa: E402

SCANNED = ["llama2", "mistral", "mixtral", "qwen3", "deepseek"]
VARIANTS = {
  "param_scan_axis=0": dict(param_scan_axis=0),
  "scan_layers=False": dict(scan_layers=False),
}


@pytest.mark.parametrize("check", list(zoo_oracle.CHECKS))
@pytest.mark.parametrize("name", SCANNED)
def test_maxtext(name, check, tmp_path):
  zoo_oracle.CHECKS[check](zoo_maxtext.zoo(name), tmp_path)


@pytest.mark.parametrize("check", list(zoo_oracle.CHECKS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_maxtext_llama2_layouts(variant, check, tmp_path):
  zoo_oracle.CHECKS[check](zoo_maxtext.zoo("llama2", **VARIANTS[variant]), tmp_path)


def _per_layer_imbalance(zoo, pairs, params):
  """|log(||A||/||B||)| per atom of ``pairs`` on ``params`` (the oracle's atoms: one per layer,
  group and expert)."""
  values = zoo_oracle.leaves(params)
  return np.abs(zoo_oracle.log_imbalance(values, zoo_oracle.atoms(pairs, values)))


@pytest.mark.parametrize("name", ["llama2", "mixtral"])
def test_maxtext_hand_written_per_layer(name):
  """The architecture's declarations with the layer axis at 1 (``stacked=(1,)``; exact: see
  ``expected_list_is_exact``): one hard update balances an imbalance that differs per layer and
  group (atoms moved alternately by 4 and 1/4) to 1e-4 per atom, which a factor shared across
  layers cannot, and keeps the logits."""
  zoo = zoo_maxtext.zoo(name)
  pairs = zoo.expected()
  values = zoo_oracle.leaves(zoo.params)
  atom_list = zoo_oracle.atoms(pairs, values)
  factors = np.array([4.0 if i % 2 == 0 else 1 / 4 for i in range(len(atom_list))])
  params = zoo_oracle.rebuild(zoo.params, zoo_oracle.orbit_move(values, atom_list, factors))
  assert _per_layer_imbalance(zoo, pairs, params).max() > 1.0
  tx = saggs.chain(optax.sgd(0.0), saggs.saggs(pairs))
  updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  new = optax.apply_updates(params, updates)
  after = _per_layer_imbalance(zoo, pairs, new)
  assert after.max() < zoo_oracle.BALANCED, after
  assert zoo_oracle.deviation(zoo, new) < zoo_oracle.EXACT


@pytest.mark.parametrize("name", ["llama2", "mixtral", "qwen3"])
def test_maxtext_preset(name):
  """``saggs.presets.maxtext(config)`` declares what the architecture has (every atom of the
  expected list but the norm gains, which no preset declares) and nothing that moves the
  logits."""
  zoo = zoo_maxtext.zoo(name)
  pairs = saggs.presets.maxtext(zoo_maxtext.config(name))
  assert zoo_oracle.deviation(zoo, zoo_oracle.random_move(zoo, pairs, seed=5)) < zoo_oracle.EXACT
  values = zoo_oracle.leaves(zoo.params)
  keys = {zoo_oracle.key(a) for a in zoo_oracle.atoms(pairs, values)}
  # Presets declare no norm gains (as presets.llama): the expected list's gain atoms aside.
  gains = lambda a: any(path.endswith("norm/scale") for path, *_ in a.members)  # noqa: E731
  expected = [a for a in zoo_oracle.atoms(zoo.expected(), values) if not gains(a)]
  lost = [a for a in expected if zoo_oracle.key(a) not in keys]
  assert not lost, f"{zoo.name}: the preset misses {zoo_oracle.describe_atom(lost[0])}"


@pytest.mark.parametrize("name", ["llama2", "mixtral", "qwen3"])
def test_maxtext_muon_dimension_numbers(name):
  """discover's Muon dimension numbers equal MaxText's own (``utils/muon_utils``, which is right
  with ``param_scan_axis=1``) on every leaf MaxText orthogonalises, as the same axes (MaxText
  writes some negative, ``(0,), (-2, -1)``; discover ``(0,), (2, 3)``). But the MoE router
  (``gate/kernel``): MaxText orthogonalises it, while discover's roles give routers None (the
  paper's stack gives them their own centred row-norm rule; Muon leaves them to AdamW)."""
  from maxtext.utils import muon_utils

  def absolute(dims, ndim):  # (reduction, output) as sorted non-negative axes
    return dims and tuple(
      tuple(sorted(a % ndim for a in ((axes,) if isinstance(axes, int) else axes))) for axes in dims
    )

  zoo = zoo_maxtext.zoo(name)
  ours = zoo_oracle.found(zoo).muon_dimension_numbers(zoo.params)
  is_dn = lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)
  ours = {
    zoo_oracle.path_str(k): v
    for k, v in jax.tree_util.tree_flatten_with_path(ours, is_leaf=is_dn)[0]
  }
  differ = []
  for kp, x in jax.tree_util.tree_flatten_with_path(zoo.params)[0]:
    path = tuple(str(getattr(k, "key", k)) for k in kp)
    theirs = muon_utils.transform_logic(path, shape=x.shape)
    if path[-2:] == ("gate", "kernel"):  # the MoE router: see above
      continue
    mine = ours.get("/".join(path))
    if theirs is not None and absolute(mine, x.ndim) != absolute(theirs, x.ndim):
      differ.append(
        f"{'/'.join(path)} {x.shape}: ours {ours.get('/'.join(path))}, MaxText {theirs}"
      )
  assert not differ, "\n".join(differ)
