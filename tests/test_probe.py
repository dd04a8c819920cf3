"""The degree probe's program, compiled with XLA's cheapest code generation on CPU."""

import jax
import jax.numpy as jnp
import optax

import saggs_jax as saggs
from saggs_jax._src import degrees, probe
from saggs_jax._src.plan import resolve


def test_the_probe_compiles_without_the_options_this_jaxlib_does_not_know(monkeypatch):
  """An option of FAST_COMPILE_IF_KNOWN that the CPU compiler lacks (jaxlib 0.11+ has no
  xla_cpu_use_fusion_emitters) is dropped, and the probe still reads adamax's nu degree."""
  monkeypatch.setattr(probe, "FAST_COMPILE_IF_KNOWN", {"xla_cpu_no_such_option": True})
  monkeypatch.setattr(probe, "_OPTIONS", {})
  params = {n: jax.ShapeDtypeStruct((3, 8), jnp.float32) for n in ("q", "k")}
  found = degrees.measure(optax.adamax(1e-3), params, resolve(saggs.Pair("q", "k"), params))
  assert found[0].nu["q"] == 1 and dict(probe._OPTIONS) == dict(probe.FAST_COMPILE)
