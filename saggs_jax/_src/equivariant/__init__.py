"""The implementation of :mod:`saggs_jax.equivariant`."""
