"""Finding a model's exact rescaling symmetries from its jaxpr.

:func:`discover` reads ``jax.make_jaxpr(apply_fn)(params, *inputs)`` and
follows, for every parameter used as a linear map (a ``dot_general`` operand)
or as an elementwise gain, how a per-channel factor ``c`` on that parameter
travels through the program:

* reshapes, transposes, broadcasts, slices, stacks and concatenations carry
  the channel axes (a reshape that splits a channel axis proposes head groups);
* a slice or split that cuts a whole leaf axis into blocks (GPT-2's fused
  q|k|v columns, gemma's K and V on a leading axis of 2) makes each block a
  source of its own (a :class:`~saggs_jax.Block`), the other blocks then
  values that do not scale; blocks that are added back together (the halves
  of rotate-half RoPE) stay one channel;
* multiplying by a value that does not depend on the parameter (a constant,
  RoPE's cos/sin, a SwiGLU gate, attention probabilities, a dropout mask) keeps
  ``c``; ``max(x, 0)``, ``min(x, 0)`` and a choice on the sign of ``x`` keep
  positive ``c`` (ReLU, leaky ReLU), a clip at any other constant does not
  (ReLU6); ``jnp.where`` and ``lax.cond`` keep ``c`` when every case scales
  alike or is zero;
* adding a bias keeps ``c`` if the bias is scaled along (a follower: a bias
  vector of the channel axis, or a tensor sharing it as a trailing axis);
  adding zero changes nothing; adding anything else loses it (the residual
  stream) or makes it inexact (a constant, a bias broadcast over the channels);
* a nonlinearity (``exp``, ``tanh``, ``logistic``, ``erf``, ...) or a
  reduction over the channel (a normalisation) breaks it, and the reason is
  kept for the report;
* a ``dot_general`` contracting the channel against another parameter (B)
  cancels ``c`` when B is scaled by ``1/c`` along the contracted axis: a
  candidate ``A -> B`` (V/O, up/down, a norm gain against the rows of every
  linear that reads it);
* a ``dot_general`` contracting the channel against another parameter's
  channel (Q.K) cancels it when that parameter is scaled by ``1/c``; a head
  axis may carry the factor on one side only (one KV head read by every
  query head, MQA), and the check then finds the grouping.

Every candidate is then confirmed numerically: all its instances (every layer)
get random factors at once and the outputs must agree to ``rtol`` (float32,
full-precision matmuls), and so must their tangent along the rescaling, relative
to the change side a makes alone, which keeps the check's power where a
candidate moves the outputs little; the finest exact grouping wins. The check runs where
every path is live: all-zero leaves (a zero-initialised output projection)
are drawn at random first, and a candidate counts as confirmed only if the
check could have failed: a finer grouping failed, or side a rescaled alone
moves the outputs past the tolerance. Nothing unconfirmed is returned; what
could not be tested is rejected as unconfirmed (all of it with abstract
parameters, ``jax.ShapeDtypeStruct`` leaves, which are traced only, unless a
width-reduced copy of the model is given to confirm on: ``reduced=``), and a factor that reaches
another parameter but is no longer exact there (whatever made it so, an
unknown primitive included) is rejected with the reason. Declarations use path
patterns relative to each instance's enclosing module, so one
:class:`~saggs_jax.Pair` covers every layer.

The stages, one module each (``docs/discover_pipeline.md`` describes them):
``program`` (the jaxpr flattened), ``propagation`` (a factor followed, with
the rule table of every primitive), ``candidates``, ``confirmation``,
``declarations`` and ``result``; ``pipeline`` runs them.
"""

from saggs_jax._src.discovery.pipeline import discover
from saggs_jax._src.discovery.result import Discovery, Rejected

__all__ = ["Discovery", "Rejected", "discover"]
