"""Finding a model's exact rescaling symmetries from its jaxpr.

:func:`discover` reads ``jax.make_jaxpr(apply_fn)(params, *inputs)`` and follows, for
every parameter used as a linear map or as an elementwise gain, how a per-channel factor
``c`` on it travels through the program: reshapes, transposes and slices carry it,
multiplying by a value that does not depend on the parameter keeps it, a nonlinearity or a
normalisation breaks it (the reason is kept), and a ``dot_general`` that contracts it
against another parameter scaled by ``1/c`` cancels it: a candidate pair. Every candidate
is then confirmed numerically, all its instances (every layer) at once, at the finest
exact grouping; nothing unconfirmed is returned, and what could not be tested is rejected
with the reason. docs/discover.md is the guide, docs/discover_pipeline.md the rule table.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from saggs_jax.discovery import discover
  >>> def mlp(p, x): return jax.nn.relu(x @ p["up"]) @ p["down"]
  >>> found = discover(mlp, {"up": jnp.ones((3, 4)), "down": jnp.ones((4, 2))}, jnp.ones((2, 3)))
  >>> [(pair.a, pair.b) for pair in found], found.roles["down"]
  ([('up', 'down')], ('down',))
"""

from saggs_jax._src.discovery.pipeline import discover
from saggs_jax._src.discovery.result import Discovery, Rejected

__all__ = ["Discovery", "Rejected", "discover"]
