"""The zoo, EasyDeL 0.3.0: Qwen3, Gemma 3 and gpt-oss from tiny configs with random weights
(``zoo_easydel``): every check of ``zoo_oracle.CHECKS``, ``found.roles`` against each
architecture's leaves, and the symmetry-compatible stack they route, rule by rule against
NumPy. Needs .ci/zoo's EasyDeL venv (``.ci/zoo-easydel-requirements.txt``): skipped where
EasyDeL is not installed."""

import os

import pytest

# before easydel is first imported (by importorskip): see zoo_easydel
os.environ.setdefault("EASYDEL_AUTO", "0")

pytestmark = [
  pytest.mark.heavy,  # run by .ci/zoo (pytest -m heavy), not by default
  # EasyDeL 0.3.0 (written for flax 0.12.3) reads nnx variables' `.value`, which newer flax
  # deprecates
  pytest.mark.filterwarnings("ignore:'.value' access is now deprecated:DeprecationWarning"),
]

pytest.importorskip(
  "easydel", reason="EasyDeL is not installed: see .ci/zoo-easydel-requirements.txt"
)

import zoo_easydel  # noqa: E402
import zoo_oracle  # noqa: E402
import zoo_roles  # noqa: E402

NAMES = ["qwen3", "gemma3", "gpt_oss"]


@pytest.mark.parametrize("check", list(zoo_oracle.CHECKS))
@pytest.mark.parametrize("name", NAMES)
def test_easydel(name, check, tmp_path):
  zoo_oracle.CHECKS[check](zoo_easydel.zoo(name), tmp_path)


@pytest.mark.parametrize("name", NAMES)
def test_easydel_roles(name):
  zoo_roles.check_roles(zoo_easydel.zoo(name), zoo_easydel.ROLES[name])


@pytest.mark.parametrize("name", NAMES)
def test_easydel_stack_rules(name):
  zoo_roles.check_stack_rules(zoo_easydel.zoo(name), zoo_easydel.ROLES[name], zoo_easydel.HD)
