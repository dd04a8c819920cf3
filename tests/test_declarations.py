"""saggs_jax._src.discovery.declarations: the path patterns a discovery declares its pairs with."""

from saggs_jax._src.discovery import declarations
from saggs_jax._src.discovery.candidates import Rejection
from saggs_jax.discovery import Rejected


def test_patterns_drop_the_enclosing_module_and_number_wildcards():
  names = ["layers/0/attn/q", "layers/0/attn/k"]
  assert declarations.patterns(names, 0) == ["q", "k"]
  assert declarations.patterns(names, 1) == ["attn/q", "attn/k"]
  assert declarations.patterns(names, 2) == ["*/attn/q", "*/attn/k"]
  assert declarations.patterns(["h_1/mlp/up", "h_1/mlp/down"], 2) == ["h_*/mlp/up", "h_*/mlp/down"]


def test_rejections_are_named_relative_to_their_module_once_each():
  a, b = ["layers/0/up", "layers/0/down"], ["layers/1/up", "layers/1/down"]
  rejections = [Rejection(a[:1], a[1:], "why"), Rejection(b[:1], b[1:], "why")]
  assert declarations.rejected(rejections) == [Rejected("up", "down", "why")]
  fused = Rejection(["h/q", "h/k"], ["h/o"], "why")  # a side of several members: a tuple
  assert declarations.rejected([fused]) == [Rejected(("q", "k"), "o", "why")]
