"""Small models and harnesses for saggs-jax's own examples, tests and benchmarks.

Not part of the stable API, and not imported by ``import saggs_jax``. Tests and
benchmarks import these modules, never ``examples/``:

* :mod:`saggs_jax.testing.lm`: the example byte-level LLaMA-style LM;
* :mod:`saggs_jax.testing.optimizers`: the optimizers that ``examples/compare_optimizers.py``
  and the study compare;
* :mod:`saggs_jax.testing.stats`: paired statistics and verdicts over seeds;
* :mod:`saggs_jax.testing.study`: the study that ``examples/study.py`` and
  ``examples/gpu_study.py`` run.
"""
