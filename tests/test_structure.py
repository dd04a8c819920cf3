"""The package's own structure: what ``import saggs_jax`` loads, and how its modules import each
other (no cycles, no module reading another's private names)."""

import pathlib

import saggs_jax

PACKAGE = pathlib.Path(saggs_jax.__file__).parent


def test_the_harness_is_not_in_the_package():
  assert not (PACKAGE / "testing").exists()  # the wheel carries what is under PACKAGE
  assert (PACKAGE.parent / "harness" / "lm.py").exists()  # the repository's folder instead
