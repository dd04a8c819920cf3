"""The implementation of saggs_jax: not an API. Import from ``saggs_jax`` and its public
subpackages (``equivariant``, ``discovery``, ``checkpoint``, ``presets``) instead."""
