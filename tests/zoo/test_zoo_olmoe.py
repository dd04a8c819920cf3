"""The zoo, an OLMoE-style MoE in plain JAX (``zoo_olmoe``: QK-norm, a softmax router feeding
top-k, stacked SwiGLU experts): every check of ``zoo_oracle.CHECKS``, its roles as
``found.roles`` and the symmetry-compatible stack they route, rule by rule against NumPy."""

import functools

import pytest

import zoo_olmoe
import zoo_oracle
import zoo_roles

pytestmark = pytest.mark.heavy  # run by .ci/run (pytest -m heavy), not by default


@functools.cache
def model():
  return zoo_olmoe.zoo()


@pytest.mark.parametrize("check", list(zoo_oracle.CHECKS))
def test_olmoe(check, tmp_path):
  zoo_oracle.CHECKS[check](model(), tmp_path)


def test_olmoe_roles():
  zoo_roles.check_roles(model(), zoo_olmoe.ROLES)


def test_olmoe_stack_rules():
  zoo_roles.check_stack_rules(model(), zoo_olmoe.ROLES, head_dim=zoo_olmoe.HD)


def test_olmoe_expert_pair_is_named_by_what_it_is():
  """The experts' up/down pair passes the router's weights (a product with another activation,
  as attention's V/O) after its GLU: its name says it is an expert MLP, not attention."""
  names = {p.name: p for p in zoo_oracle.found(model())}
  assert (names["expert up/down"].a, names["expert up/down"].b) == ("up_proj", "down_proj")
  assert (names["attention V/O"].a, names["attention V/O"].b) == ("v_proj/kernel", "o_proj/kernel")
