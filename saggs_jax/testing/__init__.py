"""Small models and harnesses for saggs-jax's own examples, tests and benchmarks.

Not part of the stable API, and not imported by ``import saggs_jax``:
:mod:`saggs_jax.testing.lm` is the example byte-level LLaMA-style LM.
"""
