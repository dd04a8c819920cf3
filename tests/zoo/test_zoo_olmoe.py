"""The zoo, an OLMoE-style MoE in plain JAX (``zoo_olmoe``: QK-norm, a softmax router feeding
top-k, stacked SwiGLU experts): every check of ``zoo_oracle.CHECKS``, its roles as
``found.roles`` and the symmetry-compatible stack they route, rule by rule against NumPy."""

import functools

import pytest

import saggs_jax as saggs
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


def test_olmoe_llama_preset():
  """presets.llama(qk_norm="all", experts=...) declares the V/O, QK-norm gain and expert pairs
  of the hand-written list, atom for atom (zoo_oracle's own resolution), and they are exact."""
  zoo = model()
  preset = saggs.presets.llama(
    zoo_olmoe.KV, qk_norm="all", mlp=False, experts="mlp/experts", expert_leaf=None
  )
  values = zoo_oracle.leaves(zoo.params)
  atoms = lambda pairs: sorted(map(zoo_oracle.key, zoo_oracle.atoms(pairs, values)))  # noqa: E731
  assert atoms(preset) == atoms(zoo_olmoe.expected()[:3])
  assert zoo_oracle.deviation(zoo, zoo_oracle.random_move(zoo, preset)) < zoo_oracle.EXACT


def test_olmoe_expert_pair_is_named_by_what_it_is():
  """The experts' up/down pair passes the router's weights (a product with another activation,
  as attention's V/O) after its GLU: its name says it is an expert MLP, not attention."""
  names = {p.name: p for p in zoo_oracle.found(model())}
  assert (names["expert up/down"].a, names["expert up/down"].b) == ("up_proj", "down_proj")
  assert (names["attention V/O"].a, names["attention V/O"].b) == ("v_proj/kernel", "o_proj/kernel")
