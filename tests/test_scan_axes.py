"""saggs_jax._src.scan_axes: copy axes read off the axis names of Flax's boxes (linen's
Partitioned, nnx Variables), as a scan over layers and an MoE expert axis leave them; what they
then balance is checked by tests/test_copy_axes.py."""

import jax
import jax.numpy as jnp
import pytest

import saggs_jax as saggs

E, L, M = 8, 2, 6  # width, layers, hidden


def test_copy_axes_are_the_positions_of_the_named_axes_in_boxed_leaves():
  nn = pytest.importorskip("flax.linen")
  tree = {
    "experts": {"wi": nn.Partitioned(jnp.ones((E, L, 3, M)), ("embed", "layers", "exp", "mlp"))},
    "norm": {"scale": nn.Partitioned(jnp.ones((E,)), ("embed",))},  # no copy axis: left out
    "bias": jnp.ones(M),  # unboxed: no names to read
  }
  assert saggs.copy_axes(tree) == {"experts/wi": (1,)}
  assert saggs.copy_axes(tree, ("exp", "layers")) == {"experts/wi": (1, 2)}  # increasing
  assert saggs.copy_axes(tree, "exp") == {"experts/wi": (2,)}  # one name as a string
  assert saggs.copy_axes({"params": tree}, "absent") == {}


def test_copy_axes_read_from_linen_scan_metadata():
  nn = pytest.importorskip("flax.linen")

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      part = lambda *names: nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
      h = nn.Dense(M, kernel_init=part("embed", "mlp"), name="wi_1")(x)
      return nn.Dense(E, kernel_init=part("mlp", "embed"), name="wo")(h), None

  scan = nn.scan(
    Block,
    variable_axes={"params": 1},
    split_rngs={"params": True},
    length=L,
    metadata_params={nn.PARTITION_NAME: "layers"},
  )
  boxed = scan(name="layers").init(jax.random.key(0), jnp.ones((1, E)), None)
  axes = saggs.copy_axes(boxed)
  assert axes == {"params/wi_1/kernel": (1,), "params/wo/kernel": (1,)}
  params = nn.unbox(boxed)
  pair = saggs.Pair("wi_1/kernel", "wo/kernel", axes=(1, 0), stacked=axes["params/wi_1/kernel"])
  assert saggs._src.plan.resolve([pair], params).instances[0].factor_shape == (L, M)


def test_copy_axes_read_from_nnx_scan_metadata():
  nnx = pytest.importorskip("flax.nnx")
  import flax

  class Block(nnx.Module):
    def __init__(self, rngs):
      init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
      self.up = nnx.Linear(E, M, kernel_init=init, rngs=rngs)

  @nnx.split_rngs(splits=L)
  @nnx.vmap(in_axes=(0,), out_axes=1, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def make(rngs):
    return Block(rngs)

  always = flax.config.flax_always_shard_variable
  flax.config.update("flax_always_shard_variable", False)  # no mesh here
  try:
    state = nnx.state(make(nnx.Rngs(0)), nnx.Param)
  finally:
    flax.config.update("flax_always_shard_variable", always)
  assert saggs.copy_axes(state) == {"up/kernel": (1,)}
