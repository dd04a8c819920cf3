"""saggs_jax._src.discovery.propagation: a factor followed to the next linear, against
hand-computed expectations. tests/test_discover*.py check the whole pipeline on models."""

import jax
import jax.numpy as jnp

from saggs_jax._src.discovery import propagation, tags
from saggs_jax._src.discovery.program import Program


def _trace(forward, params, x, leaf):
  """The trace of ``leaf``'s factor from its first use in ``forward(params, x)``."""
  leaves = list(params.values())
  closed = jax.make_jaxpr(lambda p, x: forward(dict(zip(params, p)), x))(leaves, x)
  flow = propagation.flow(Program(closed, len(leaves)))
  (use,) = flow.uses[leaf]
  eqn = flow.prog.eqns[use.eqn]
  start = tags.tag({1: use.view.axes[1]})  # the kernel's output columns
  assert start is not None
  return propagation.follow(flow, use.eqn, eqn.outs[0], start, leaves[leaf].shape)


def test_follow_reaches_the_next_linear_with_what_it_passed_through():
  params = {"up": jnp.ones((3, 4)), "down": jnp.ones((4, 2))}
  x = jnp.ones((2, 3))
  relu = _trace(lambda p, x: jax.nn.relu(x @ p["up"]) @ p["down"], params, x, 0)
  (reach,) = relu.reaches
  assert reach.leaf == 1 and reach.amap == {1: {0}}  # up's columns meet down's rows
  assert not reach.reasons and reach.positive and tags.Via.RELU in relu.through
  tanh = _trace(lambda p, x: jnp.tanh(x @ p["up"]) @ p["down"], params, x, 0)
  (reach,) = tanh.reaches
  assert reach.reasons == {tags.nonlinear("tanh")} and not reach.positive
  residual = _trace(
    lambda p, x: (x @ p["up"] + x @ p["skip"]) @ p["down"],
    {**params, "skip": jnp.ones((3, 4))},
    x,
    0,
  )
  assert residual.breaks == {tags.RESIDUAL} and not residual.reaches


def _block_of_concat(after, axis=-1):
  """The trace of ``q``'s columns concatenated (along ``axis``) with an activation that the
  factor does not reach (MLA's query: its non-rotary dims, then rotary ones), then
  ``after(q, k, params)``, ``k`` concatenated alike."""
  params = {"q": jnp.ones((3, 4)), "k": jnp.ones((3, 4)), "o": jnp.ones((6, 2))}
  x = jnp.ones((2, 3))

  def forward(p, x):
    rest = jnp.tanh(x[:, :2] if axis else x[:, :1] * jnp.ones((2, 4)))  # not reached
    q = jnp.concatenate([x @ p["q"], rest], axis)
    k = jnp.concatenate([x @ p["k"], rest], axis)
    return after(q, k, p)

  return _trace(forward, params, x, 0)


def test_a_concatenated_block_scales_its_span_only_and_meets_the_same_span():
  (meet,) = _block_of_concat(lambda q, k, p: q @ k.T).meets
  assert meet.span == (0, 0, 4) and not meet.reasons  # contracted dim 0, entries 0:4
  (meet,) = _block_of_concat(lambda q, k, p: (2.0 * q).T.T @ k.T).meets  # moved, scaled
  assert meet.span == (0, 0, 4) and not meet.reasons
  unlike = tags.UNLIKE
  (meet,) = _block_of_concat(lambda q, k, p: jnp.flip(q, -1) @ k.T).meets  # entries moved
  assert unlike in meet.reasons
  (meet,) = _block_of_concat(lambda q, k, p: jnp.maximum(q, 0.0) @ k.T).meets  # no span rule
  assert unlike in meet.reasons
  (reach,) = _block_of_concat(lambda q, k, p: q @ p["o"]).reaches  # rows 0:4 of o only
  assert unlike in reach.reasons
  # a block of the tokens: o's rows would compensate the other tokens too
  (reach,) = _block_of_concat(lambda q, k, p: q @ p["o"][:4], axis=0).reaches
  assert unlike in reach.reasons
