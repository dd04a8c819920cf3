"""saggs_jax._src.discovery.confirmation: the leaves the numeric check runs on, and the bisection
that confirms instances at their finest exact grouping; the check itself on models is in
tests/test_discover_guards.py."""

import jax.numpy as jnp
import numpy as np

from saggs_jax._src.discovery.confirmation import Verdict, confirm, live


def test_live_draws_only_all_zero_floating_leaves_at_their_ranks_rms():
  kernel = np.full((4, 4), 3.0, np.float32)  # RMS 3
  zero_kernel, zero_gain = np.zeros((64, 64), np.float32), np.zeros(8, jnp.bfloat16)
  ids, empty = np.zeros(5, np.int32), np.zeros((0, 3), np.float32)
  out = live([kernel, zero_kernel, zero_gain, ids, empty], np.random.default_rng(0))
  np.testing.assert_array_equal(out[0], kernel)
  assert abs(float(jnp.std(out[1])) - 3.0) < 0.1  # N(0, 3^2), of the rank-2 leaves' RMS
  assert out[2].dtype == jnp.bfloat16 and bool(jnp.all(out[2] != 0))  # no rank-1 RMS: s = 1
  np.testing.assert_array_equal(out[3], ids)  # integers and empty leaves stay as they are
  assert out[4].shape == (0, 3)


class Checker:
  """Exact at ``groups`` unless the instances include a ``bad`` one; records its calls."""

  def __init__(self, bad, exact_from):
    self.bad, self.exact_from, self.calls = set(bad), exact_from, []

  def check(self, instances, groups):
    self.calls.append((tuple(instances), groups))
    exact = not self.bad & set(instances) and groups <= self.exact_from
    return Verdict(exact=exact, live=False)


def test_confirm_takes_the_finest_exact_grouping_and_bisects_out_the_refuted():
  checker = Checker(bad={"c"}, exact_from=2)
  confirmed, refuted = confirm(checker, list("abcd"), [4, 2, 1])  # type: ignore[arg-type]
  assert refuted == ["c"]
  assert [(c.instances, c.groups, c.tested) for c in confirmed] == [
    (["a", "b"], 2, True),  # 4 groups failed first: the check could fail
    (["d"], 2, True),
  ]
  assert checker.calls[:3] == [(tuple("abcd"), 4), (tuple("abcd"), 2), (tuple("abcd"), 1)]
  untested, _ = confirm(Checker((), 4), ["a"], [4, 1])  # type: ignore[arg-type]
  assert [(c.groups, c.tested) for c in untested] == [(4, False)]  # nothing refuted it
