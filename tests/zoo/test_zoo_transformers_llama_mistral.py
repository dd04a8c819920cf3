"""The zoo, transformers 4.x Flax: LLaMA (GQA) and Mistral, tiny configs with random weights.

Every check of ``zoo_oracle.CHECKS`` on each model; the models are built once per process.
"""

import functools

import pytest

pytestmark = pytest.mark.heavy  # run by .ci/run (pytest -m heavy), not by default

pytest.importorskip(
  "transformers", reason="the zoo extra is not installed: pip install -e '.[zoo]'"
)

import zoo_models  # noqa: E402
import zoo_oracle  # noqa: E402


@functools.cache
def model(name):
  return zoo_models.transformers_model(name)


@pytest.mark.parametrize("check", list(zoo_oracle.CHECKS))
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_transformers(name, check, tmp_path):
  zoo_oracle.CHECKS[check](model(name), tmp_path)
