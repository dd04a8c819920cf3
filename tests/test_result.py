"""saggs_jax._src.discovery.result: a Discovery as a declaration, a sequence of pairs, and its
report."""

import pytest

from saggs_jax import Block, Pair
from saggs_jax._src.discovery.result import CONFIRMATIONS
from saggs_jax.discovery import Discovery, Rejected


def test_report_names_block_sides():
  # A fused QKV kernel's q and k columns pair as Blocks: one member per side, not iterated.
  q, k = (Block("c_attn/kernel", axis=1, parts=3, part=i) for i in (0, 1))
  assert Discovery([Pair(q, k, axes=(1, 1), groups=2, name="attention Q/K")]).report() == (
    "Found 1 symmetry:\n"
    f"  attention Q/K: {q!r} (axis 1) x c  against  {k!r} (axis 1) x 1/c; 2 groups\n"
    "Rejected 0:\n"
    "Confirmation: numerically, on the given parameters and example inputs (finite moves and"
    " first order)."
  )


def test_a_discovery_is_the_sequence_of_its_pairs_and_rebuilds_from_its_repr():
  pairs = [Pair("up/kernel", "down/kernel", axes=(1, 0)), Pair("v", "o", axes=(1, 0), groups=2)]
  rejected = [Rejected("norm/scale", "q", "a normalization between them")]
  d = Discovery(pairs, rejected, roles={"down": ("down/kernel",)}, copy_axes={"o": (1,)})
  assert len(d) == 2 and list(d) == pairs and d[1] is d.pairs[1] and d[-1:] == tuple(pairs[1:])
  namespace = {"Discovery": Discovery, "Pair": Pair, "Rejected": Rejected}
  assert eval(repr(d), namespace) == d  # pylint: disable=eval-used
  assert d != pairs and d != Discovery(pairs, rejected, roles=d.roles)  # the copy axes count
  assert d != Discovery(pairs, rejected, copy_axes=d.copy_axes)  # and so do the roles


def test_confirmation_is_one_of_the_reported_kinds():
  for kind, text in CONFIRMATIONS.items():
    assert Discovery(confirmation=kind).report().endswith(f"Confirmation: {text}.")
  with pytest.raises(ValueError, match=r"confirmation must be one of \['parameters'"):
    Discovery(confirmation="by eye")
