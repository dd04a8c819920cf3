"""The implementation of :mod:`saggs_jax.discovery`: its stages, one module each (docs/discover_pipeline.md)."""
