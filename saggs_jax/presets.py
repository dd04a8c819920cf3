"""Ready-made pair declarations for common Flax attention, LLaMA-style, GPT-2 and MaxText layouts.

Patterns are anchored at the end of a path and pair up within one module, so
they apply to every layer of a model at once; ``prefix`` restricts them to
part of the tree (e.g. ``"decoder/**"``). :func:`saggs_jax.equivariant.muon_dimension_numbers`
declares the same layouts' matrices for ``optax.contrib.muon`` (``layouts="llama"``, ...).

Example:
  >>> import saggs_jax as saggs
  >>> [pair.name for pair in saggs.presets.llama(num_kv_heads=2)]
  ['attention Q/K', 'attention V/O', 'SwiGLU up/down']
"""

from saggs_jax._src.presets import LlamaNames, flax_mha, gpt2, llama, maxtext

__all__ = ["LlamaNames", "flax_mha", "gpt2", "llama", "maxtext"]
