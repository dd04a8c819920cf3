"""``saggs.discover`` on MaxText 0.2.5's own gemma3 (3 layers unscanned, and 13: two scanned
blocks of its 6-layer pattern and one remainder layer) and deepseek (MLA) decoders
(``zoo_maxtext``, random weights): every pair instance that ``presets.maxtext`` declares, and
that ``test_zoo_maxtext_presets`` checks exact on the logits, is found, with the same members
on the same axes at the same grouping or a finer one; and ``check_symmetry`` accepts every
pair found. Needs .ci/zoo's venv: skipped where MaxText is not installed."""

import functools
import warnings

import pytest

pytestmark = [
  pytest.mark.heavy,
  pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # MaxText's: see test_zoo_maxtext
]

pytest.importorskip("maxtext", reason="MaxText is not installed: see .ci/zoo maxtext")

import saggs_jax as saggs  # noqa: E402
import zoo_maxtext  # noqa: E402
from saggs_jax._src.plan import resolve  # noqa: E402
from zoo_models import tokens  # noqa: E402

MODELS = {
  "gemma3-3": ("gemma3", dict(base_num_decoder_layers=3)),
  "gemma3-13": ("gemma3", dict(base_num_decoder_layers=13)),
  "deepseek": ("deepseek", {}),
}


@functools.cache
def found(name):
  model, overrides = MODELS[name]
  cfg, params, apply = zoo_maxtext.build(model, **overrides)
  return cfg, params, apply, saggs.discover(apply, params, tokens())


def instances(pairs, params) -> list[tuple]:
  """Each resolved instance as ``(sides, groups, copy axes, name)``: a side is the set of its
  members' ``(path, block, group axis)``, so that a pair and its mirror image compare equal."""
  plan = resolve(pairs, params)
  out = []
  for inst in plan.instances:
    sides = frozenset(
      frozenset((plan.part(n).path, plan.part(n).block, plan.slot(n, inst.key).axis) for n in names)
      for names in (inst.members_a, inst.members_b)
    )
    slot = plan.slot(inst.members_a[0], inst.key)
    out.append((sides, slot.groups, slot.stacked, inst.pair.name))
  return out


@pytest.mark.parametrize("name", list(MODELS))
def test_discover_finds_every_pair_the_maxtext_preset_declares(name):
  cfg, params, apply, discovered = found(name)
  assert discovered.confirmation == "parameters"  # the first-order count ran
  got = instances(list(discovered), params)
  missing = [
    (pair, groups)
    for sides, groups, stacked, pair in instances(saggs.presets.maxtext(cfg), params)
    if not any(s == sides and g % groups == 0 and c == stacked for s, g, c, _ in got)
  ]
  assert not missing, discovered.report()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", saggs.MootPairWarning)  # the QK-norm gains' one group
    saggs.check_symmetry(apply, params, list(discovered), tokens())  # raises if one is not
