"""saggs_jax._src.equivariant.roles: the role tables and the Muon dimension numbers per role."""

import jax.numpy as jnp
import pytest
from optax.contrib import MuonDimensionNumbers

from saggs_jax._src.equivariant import roles


def test_every_role_has_patterns_and_dimension_numbers():
  assert set(roles.ROLE_PATTERNS) == set(roles.ROLE_DIMENSION_NUMBERS)
  assert all(isinstance(p, tuple) and p for p in roles.ROLE_PATTERNS.values())


def test_role_dimension_numbers_by_role_and_by_given_patterns():
  params = {"wq": jnp.ones((4, 8, 8)), "tok": jnp.ones((16, 8)), "norm": jnp.ones(8)}
  dims = roles.role_dimension_numbers(params, {"query": "wq", "embedding": ("tok",)})
  assert dims == {"wq": MuonDimensionNumbers(-2, -1), "tok": None, "norm": None}
  with pytest.raises(ValueError, match=r"Unknown roles \['attention'\]"):
    roles.role_dimension_numbers(params, {"attention": "wq"})


def test_the_tables_are_read_only():
  with pytest.raises(TypeError):
    roles.ROLE_PATTERNS["query"] = ("wq",)  # pyright: ignore[reportIndexIssue]
  assert roles.as_patterns("a") == ("a",) and roles.as_patterns(["a", "b"]) == ("a", "b")
