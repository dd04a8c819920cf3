"""saggs_jax._src.discovery.program: a jaxpr flattened into equations on value ids, with scans,
conds and calls inlined, and its all-zero constants known."""

import jax
import jax.numpy as jnp

from saggs_jax._src.discovery.program import Program


def program(fn, *args, num_leaves=1):
  return Program(jax.make_jaxpr(fn)(*args), num_leaves)


def test_leaves_inputs_outputs_and_zero_constants():
  prog = program(lambda w, x: (x @ w + 0.0) * 2.0, jnp.ones((3, 4)), jnp.ones((2, 3)))
  assert [prog.shapes[i] for i in prog.leaf_ids + prog.input_ids] == [(3, 4), (2, 3)]
  (dot,) = [e for e in prog.eqns if e.prim == "dot_general"]
  assert dot.ins == [prog.input_ids[0], prog.leaf_ids[0]] and prog.shapes[dot.outs[0]] == (2, 4)
  (add,) = [e for e in prog.eqns if e.prim == "add"]
  assert add.ins[1] in prog.zeros  # the literal 0.0; 2.0 is no zero
  (mul,) = [e for e in prog.eqns if e.prim == "mul"]
  assert mul.ins[1] not in prog.zeros and prog.outputs == set(mul.outs)


def test_a_scan_is_one_iteration_between_slices_and_stacks():
  def scanned(ws, x):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), h.sum()), x, ws)

  prog = program(scanned, jnp.ones((5, 3, 3)), jnp.ones((2, 3)))
  prims = [e.prim for e in prog.eqns]
  assert prims.count("dot_general") == 1 and "scan" not in prims  # inlined once
  (sliced,) = [e for e in prog.eqns if e.prim == "scan_slice"]
  assert sliced.ins == prog.leaf_ids and prog.shapes[sliced.outs[0]] == (3, 3)
  (stacked,) = [e for e in prog.eqns if e.prim == "scan_stack"]
  assert prog.shapes[stacked.outs[0]] == (5,)


def test_a_cond_inlines_every_branch_and_selects_on_the_index():
  def branchy(w, x, i):
    return jax.lax.switch(i, [lambda: x @ w, lambda: jnp.tanh(x @ w)])

  prog = program(branchy, jnp.ones((3, 3)), jnp.ones((2, 3)), 0)
  prims = [e.prim for e in prog.eqns]
  assert prims.count("dot_general") == 2 and "tanh" in prims and "cond" not in prims
  (select,) = [e for e in prog.eqns if e.prim == "select_n"]
  assert len(select.ins) == 3 and prog.outputs == set(select.outs)
