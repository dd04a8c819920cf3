"""saggs-jax: optimisation that respects a Transformer's own symmetries.

* SAGGS (:func:`saggs`, :func:`soft`, :func:`scale_by_saggs`) balances the norms
  inside exact symmetry pairs and, through :func:`chain`, transports the moments
  of the optimizer before it.
* :func:`reparameterize` and :func:`canonicalize` move whole training states
  along and onto their symmetry orbits.
* :func:`qk_clip` bounds attention logits (MuonClip) per head, its split a
  Q/K gauge; :func:`max_logits` measures them in the attention code.
* :func:`discover` finds a model's exact rescaling symmetries from its jaxpr.
* :mod:`saggs_jax.equivariant` holds symmetry-compatible update rules.
"""

from saggs_jax import checkpoint, discovery, equivariant, presets
from saggs_jax._src.canonical import canonicalize, reparameterize
from saggs_jax._src.chain import SymmetryState, chain, wrap
from saggs_jax._src.diagnostics import MootPairWarning, check_symmetry, imbalance
from saggs_jax._src.pairs import Block, Pair
from saggs_jax._src.plan import describe
from saggs_jax._src.qk_clip import max_logits, qk_clip
from saggs_jax._src.scan_axes import copy_axes
from saggs_jax._src.stage import SymmetryTransformation
from saggs_jax._src.transform import SaggsState, saggs, scale_by_saggs, soft
from saggs_jax._src.transport import NESTED, register_transport
from saggs_jax.discovery import discover

__all__ = [
  "NESTED",
  "MootPairWarning",
  "Block",
  "Pair",
  "SaggsState",
  "SymmetryState",
  "SymmetryTransformation",
  "canonicalize",
  "chain",
  "checkpoint",
  "check_symmetry",
  "copy_axes",
  "describe",
  "discover",
  "discovery",
  "equivariant",
  "imbalance",
  "max_logits",
  "presets",
  "qk_clip",
  "register_transport",
  "reparameterize",
  "saggs",
  "scale_by_saggs",
  "soft",
  "wrap",
]
__version__ = "0.1.0"
