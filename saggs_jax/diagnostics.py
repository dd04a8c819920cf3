"""Watching and checking symmetries: imbalance metrics and an invariance check."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from saggs_jax.balance import log_norms, scale_tree
from saggs_jax.pairs import Pair, resolve


def imbalance(params: Any, pairs: Sequence[Pair]) -> dict[str, jax.Array]:
  """``log(||A_g|| / ||B_g||)`` for every pair instance and group.

  Keys are pair instances (``"a_path|b_path"``), values have shape
  ``stacked_shape + (groups,)``. Zero after hard SAGGS; ``log 64 ~ 4.16`` for
  Q scaled by 8 and K by 1/8 from a balanced start. Jit-friendly.

  Example::

    >>> import jax.numpy as jnp, saggs_jax as saggs
    >>> params = {"q": jnp.full((4, 2), 8.0), "k": jnp.ones((4, 2))}
    >>> float(saggs.imbalance(params, [saggs.Pair("q", "k")])["q|k"])  # log 8
    2.079441...
  """
  plan = resolve(pairs, params)
  return {k: a - b for k, (a, b) in log_norms(plan, params).items()}


def check_symmetry(apply_fn: Callable[..., Any], params: Any, pairs: Sequence[Pair], *inputs,
                   key: jax.Array | None = None, rtol: float | None = None, atol: float = 0.0,
                   low: float = 0.25, high: float = 4.0) -> dict[str, float]:
  """Checks that every declared pair is an exact symmetry of ``apply_fn``.

  Each pair instance in turn gets random factors in ``[low, high]`` (the
  others left alone); the outputs ``apply_fn(params, *inputs)`` before and
  after must agree within ``atol + rtol * max|output|``, with matmuls at full
  precision on every backend. A Q/K pair in a model
  with QK-norm, or an up/down pair in a GELU MLP, fails here.

  Args:
    apply_fn: ``apply_fn(params, *inputs)`` returning an array or a pytree.
    params: the parameter tree the pairs are declared on.
    pairs: the :class:`~saggs_jax.Pair` declarations.
    *inputs: the model inputs.
    key: PRNG key for the factors (default ``PRNGKey(0)``).
    rtol: relative tolerance; default 1e-4 for float32 outputs, 3e-2 for
      16-bit ones.
    atol: absolute tolerance.
    low, high: range of the random factors.

  Returns:
    The relative deviation measured for each pair instance.

  Raises:
    ValueError: naming the first pair instance whose transform changes the
      output beyond tolerance.

  Example::

    >>> import jax.numpy as jnp, saggs_jax as saggs
    >>> def f(p, x): return (x @ p["up"]) @ p["down"]  # linear: any rescaling is exact
    >>> params = {"up": jnp.ones((3, 5)), "down": jnp.ones((5, 2))}
    >>> _ = saggs.check_symmetry(f, params, [saggs.Pair("up", "down", axes=(1, 0))], jnp.ones((1, 3)))
  """
  plan = resolve(pairs, params)
  jitted = jax.jit(apply_fn)

  def fn(*args):
    # Full float32 matmuls: TF32 (GPU) or bf16 passes (TPU) would show up as
    # deviations of a symmetry that is exact.
    with jax.default_matmul_precision("highest"):
      return jitted(*args)

  reference = jax.tree.leaves(fn(params, *inputs))
  ref_dtype = jnp.result_type(*reference)
  if rtol is None:
    rtol = 3e-2 if jnp.finfo(ref_dtype).bits <= 16 else 1e-4
  scale = max(float(jnp.max(jnp.abs(r.astype(jnp.float32)))) for r in reference)
  key = jax.random.PRNGKey(0) if key is None else key
  deviations = {}
  for inst in plan.instances:
    key, sub = jax.random.split(key)
    factors = {i.key: jnp.ones(i.factor_shape, jnp.float32) for i in plan.instances}
    factors[inst.key] = jax.random.uniform(sub, inst.factor_shape, jnp.float32, low, high)
    out = jax.tree.leaves(fn(scale_tree(plan, params, factors, 1.0), *inputs))
    err = max(float(jnp.max(jnp.abs(o.astype(jnp.float32) - r.astype(jnp.float32))))
              for o, r in zip(out, reference))
    deviations[inst.key] = err / max(scale, np.finfo(np.float32).tiny)
    if not err <= atol + rtol * scale:
      raise ValueError(
          f"{inst.pair.label} is not a symmetry of the model: rescaling {inst.a!r} by c and"
          f" {inst.b!r} by 1/c (c in [{low}, {high}]) changed the output by {err:.3g}"
          f" (relative {deviations[inst.key]:.3g}, tolerance {rtol:g}). Check for QK-norm,"
          " a non-homogeneous activation (GELU, SiLU) or a bias declared on the wrong side.")
  return deviations
