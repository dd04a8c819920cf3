"""Small models and harnesses for saggs-jax's own examples, tests and benchmarks.

A folder of the repository, not of the installed package: the wheel carries ``saggs_jax``
alone, and no module of it imports this one. Tests and benchmarks import these modules, never
``examples/``; pytest, ``examples/common.py`` and ``bench/common.py`` put the repository root
on ``sys.path`` for them. They need flax (the ``test`` or ``examples`` extra):

* :mod:`harness.lm`: the example byte-level LLaMA-style LM;
* :mod:`harness.optimizers`: the optimizers that ``examples/compare_optimizers.py``
  and the study compare;
* :mod:`harness.moe`: the OLMoE-style MoE LM of the study's ``moe`` experiment and its
  routing and logit measures;
* :mod:`harness.stats`: paired statistics and verdicts over seeds;
* :mod:`harness.study`: the study that ``examples/study.py`` and
  ``examples/gpu_study.py`` run.
"""
