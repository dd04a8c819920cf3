"""The zoo, equinox: a LLaMA-style model written with eqx.nn.Linear/Embedding/RMSNorm whose
modules hold non-array fields (the activation function, dropout, head counts); discover gets
the whole module."""

import functools

import pytest

pytestmark = pytest.mark.heavy  # run by .ci/run (pytest -m heavy), not by default

pytest.importorskip("equinox", reason="the zoo extra is not installed: pip install -e '.[zoo]'")

import zoo_models  # noqa: E402
import zoo_oracle  # noqa: E402


@functools.cache
def model():
  return zoo_models.equinox_model()


@pytest.mark.parametrize("check", list(zoo_oracle.CHECKS))
def test_equinox(check, tmp_path):
  zoo_oracle.CHECKS[check](model(), tmp_path)
