"""saggs_jax._src.jaxpr_params against the jaxprs of the running jax.

Each primitive whose parameters the discovery reads is traced here from the
public API, and each read is compared with the value the trace was built with:
a jax release that renames a parameter, or a primitive, fails here first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from saggs_jax._src import jaxpr_params


def eqns_of(fn, *args):
  """The top-level equations of ``fn``'s jaxpr, by primitive name (the last of each)."""
  return {e.primitive.name: e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns}


X = jnp.ones((2, 3, 4))
TAKE = jax.lax.GatherDimensionNumbers(
  offset_dims=(1, 2), collapsed_slice_dims=(0,), start_index_map=(0,)
)

RAGGED = jax.lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), (0,), (0,))

# primitive -> (a function of X that emits it, the parameters as the function asked for them)
READ_CASES = {
  "transpose": (lambda x: jnp.transpose(x, (2, 0, 1)), {"permutation": (2, 0, 1)}),
  "broadcast_in_dim": (
    lambda x: jax.lax.broadcast_in_dim(x, (5, 2, 3, 4), (1, 2, 3)),
    {"broadcast_dimensions": (1, 2, 3)},
  ),
  "squeeze": (lambda x: jnp.squeeze(x[:1], 0), {"dimensions": (0,)}),
  "split": (lambda x: jnp.split(x, [1, 3], axis=2), {"axis": 2, "sizes": (1, 2, 1)}),
  "slice": (
    lambda x: jax.lax.slice(x, (0, 1, 0), (2, 3, 4), (1, 1, 2)),
    {"start_indices": (0, 1, 0), "limit_indices": (2, 3, 4), "strides": (1, 1, 2)},
  ),
  "dot_general": (
    lambda x: jnp.einsum("abc,adc->abd", x, x),
    {"dimension_numbers": (((2,), (2,)), ((0,), (0,)))},
  ),
  "reduce_sum": (lambda x: x.sum((0, 2)), {"axes": (0, 2)}),
  "reduce_max": (lambda x: x.max(1), {"axes": (1,)}),
  "reduce_min": (lambda x: x.min(2), {"axes": (2,)}),
  "reduce_prod": (lambda x: x.prod(0), {"axes": (0,)}),
  "argmax": (lambda x: jnp.argmax(x, 1), {"axes": (1,)}),
  "argmin": (lambda x: jnp.argmin(x, 2), {"axes": (2,)}),
  "gather": (  # jnp.take(x, idx, axis=0), as an MoE gathers its chosen experts
    lambda x: jax.lax.gather(x, jnp.zeros((5, 1), jnp.int32), TAKE, (1, 3, 4)),
    {"dimension_numbers": TAKE, "slice_sizes": (1, 3, 4)},
  ),
  "ragged_dot_general": (  # lax.ragged_dot: rows 0 | 1..3 through matrices x[0] | x[1]
    lambda x: jax.lax.ragged_dot(x[0].T, x, jnp.array([1, 3], jnp.int32)),
    {"ragged_dot_dimension_numbers": RAGGED},
  ),
}


if jax.__version_info__ >= (0, 12):  # older jaxes unpack with slice and squeeze
  READ_CASES["unstack"] = (lambda x: list(x), {"axis": 0})


def test_every_listed_read_is_traced_here():
  assert set(READ_CASES) == set(jaxpr_params.READS) - ({"unstack"} - set(READ_CASES))


@pytest.mark.parametrize("prim", sorted(READ_CASES))
def test_the_parameters_read_are_the_ones_asked_for(prim):
  fn, wanted = READ_CASES[prim]
  eqn = eqns_of(fn, X)[prim]
  jaxpr_params.check(eqn)
  assert set(wanted) == set(jaxpr_params.READS[prim])
  for name, value in wanted.items():
    got = jaxpr_params.param(eqn, name)
    assert np.array_equal(np.asarray(got, dtype=object), np.asarray(value, dtype=object)), name


def test_a_renamed_parameter_fails_in_one_place_with_its_names():
  eqn = eqns_of(READ_CASES["transpose"][0], X)["transpose"]
  renamed = eqn.replace(params={"perm": eqn.params["permutation"]})
  with pytest.raises(KeyError, match=rf"'transpose'.*jax {jax.__version__}.*'permutation'.*'perm'"):
    jaxpr_params.check(renamed)


def test_scan_counts_its_consts_carry_and_xs():
  def fn(a, b, c0, c1, c2, xs, ys):
    def body(carry, x):
      c0, c1, c2 = carry
      return (c0 * a, c1 + b, c2 + x[0].sum()), x[1] * a

    return jax.lax.scan(body, (c0, c1, c2), (xs, ys))

  s = jnp.ones(())
  eqn = eqns_of(fn, s, s, jnp.ones(3), jnp.ones(3), s, jnp.ones((5, 2)), jnp.ones((5, 4)))["scan"]
  scan = jaxpr_params.scan(eqn)
  assert (scan.num_consts, scan.num_carry) == (2, 3)
  assert len(scan.body.invars) == len(eqn.invars) == 2 + 3 + 2
  # The body's carry inputs are the carry's shapes; its xs inputs lose the scanned axis.
  body_shapes = [tuple(v.aval.shape) for v in scan.body.invars]
  assert body_shapes[2:] == [(3,), (3,), (), (2,), (4,)]


def test_cond_branches_take_the_operands():
  def fn(i, x, y):
    return jax.lax.switch(
      i, [lambda x, y: x * y, lambda x, y: x + y, lambda x, y: jnp.sin(x)], x, y
    )

  eqn = eqns_of(fn, 1, X, X)["cond"]
  branches = jaxpr_params.cond_branches(eqn)
  assert len(branches) == 3
  assert all(len(b.invars) == len(eqn.invars) - 1 for b, _ in branches)
  assert [[e.primitive.name for e in b.eqns] for b, _ in branches] == [["mul"], ["add"], ["sin"]]


def _custom_jvp_sin(x):
  f = jax.custom_jvp(jnp.sin)
  f.defjvp(lambda primals, tangents: (jnp.sin(*primals), jnp.cos(*primals) * tangents[0]))
  return f(x)


def _custom_vjp_sin(x):
  f = jax.custom_vjp(jnp.sin)
  f.defvjp(lambda x: (jnp.sin(x), x), lambda x, ct: (ct * jnp.cos(x),))
  return f(x)


CALL_CASES = {
  "jit": lambda x: jax.jit(jnp.sin)(x),
  "remat2": lambda x: jax.checkpoint(jnp.sin)(x),
  "custom_jvp_call": _custom_jvp_sin,
  "custom_vjp_call": _custom_vjp_sin,
  "shard_map": lambda x: jax.shard_map(
    jnp.sin, mesh=jax.make_mesh((1,), ("m",)), in_specs=P(), out_specs=P()
  )(x),
}


def test_every_listed_call_is_traced_here():
  assert set(CALL_CASES) == set(jaxpr_params.CALLS)


@pytest.mark.parametrize("prim", sorted(CALL_CASES))
def test_call_bodies_are_found_and_take_the_inputs(prim):
  eqn = eqns_of(CALL_CASES[prim], X)[prim]
  body, _ = jaxpr_params.call_body(eqn)
  assert len(body.invars) == len(eqn.invars)
  assert "sin" in {e.primitive.name for e in body.eqns}


def test_other_equations_have_no_body():
  assert jaxpr_params.call_body(eqns_of(jnp.sin, X)["sin"]) is None


def test_ragged_groups_are_the_right_operands_group_axes():
  eqn = eqns_of(READ_CASES["ragged_dot_general"][0], X)["ragged_dot_general"]
  assert jaxpr_params.ragged_groups(eqn) == (0,)


def test_gather_reads_a_take():
  eqn = eqns_of(READ_CASES["gather"][0], X)["gather"]
  assert jaxpr_params.gather(eqn) == jaxpr_params.Gather((1, 2), (0,), (0,), (), (1, 3, 4))
