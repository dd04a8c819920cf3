"""How far the equivariant rules' library defaults are from Lau & Su's
reference code (timlautk/equivariant_optimizers), measured on the golden
vectors of ``tests/data/equivariant_reference.npz``.

Each row swaps one setting of ``eqv.REFERENCE`` (which reproduces the
reference, see ``tests/test_equivariant_reference.py``) for the library's
default, runs the affected cases (scenario ``zero``, float32 Newton-Schulz,
three steps) and reports, over every step and tensor, the largest relative
difference ``||u - u_ref|| / ||u_ref||``, the smallest cosine and the range of
``||u|| / ||u_ref||``. The first row takes every default at once; the last
compares the library's bfloat16 Newton-Schulz with the reference as shipped,
the one before it the library stack's joint gate/up unit with the
reference's separate gate and up (dense SwiGLU, row-norm).

  python bench/reference_differences.py               # ~10 min on 2 CPU cores
  python bench/reference_differences.py --only hybrid # rows whose label has "hybrid"
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import test_equivariant_reference as golden  # noqa: E402
from saggs_jax import equivariant as eqv  # noqa: E402


def without(**drop):
  """``eqv.REFERENCE`` with the named keys of each rule's settings dropped (library defaults);
  ``"group.field"`` resets one field of a settings group (``"inverse_sqrt.method"``)."""

  def keep(rule, key, value):
    fields = [d.partition(".")[2] for d in drop.get(rule, ()) if d.startswith(key + ".")]
    default = type(value)()
    return value._replace(**{f: getattr(default, f) for f in fields}) if fields else value

  return {
    rule: {k: keep(rule, k, v) for k, v in kw.items() if k not in drop.get(rule, ())}
    for rule, kw in eqv.REFERENCE.items()
  }


def cases(*prefixes):
  return [c for c in golden.CASES if c.startswith(prefixes)]


SPECTRAL = ("scale_by_right_spectral", "scale_by_left_spectral")
ROWS = [
  (
    "none: eqv.REFERENCE itself (float32 rounding; the rank-deficient cases amplify it)",
    golden.CASES,
    {},
  ),
  (
    "every library default",
    golden.CASES,
    dict(settings={r: {} for r in eqv.REFERENCE}, shared_nuclear_norm=False),
  ),
  (
    "Muon: Polar Express set and normaliser max(1.01 ||X||, 1e-7), not the cushioned set "
    "and 1.02 ||X|| + 1e-6",
    cases("muon_"),
    dict(settings=without(scale_by_polar=("newton_schulz.coeffs", "eps", "eps_form"))),
  ),
  (
    "Muon: EMA momentum, not b <- beta b + g",
    cases("muon_"),
    dict(settings=without(scale_by_polar=("ema",))),
  ),
  (
    "row-norm: x / max(||x||, 1e-8), not x / (||x|| + 1e-8)",
    cases("rownorm_", "swiglu_dense_rownorm", "swiglu_gptoss_rownorm"),
    dict(settings=without(scale_by_row_norm=("eps_form",))),
  ),
  (
    "spectral: exact eigh, not 5 damped Polar-Express steps",
    cases("right_polar", "left_polar"),
    dict(settings=without(**dict.fromkeys(SPECTRAL, ("inverse_sqrt.method",)))),
  ),
  (
    "spectral: floor 1e-6 ||X||^2, not 1e-8 (with the iteration)",
    cases("right_polar", "left_polar"),
    dict(settings=without(**dict.fromkeys(SPECTRAL, ("eps", "inverse_sqrt.relative_eps")))),
  ),
  (
    "spectral: exact eigh and floor 1e-6 ||X||^2 (both defaults)",
    cases("right_polar", "left_polar"),
    dict(
      settings=without(
        **dict.fromkeys(SPECTRAL, ("inverse_sqrt.method", "eps", "inverse_sqrt.relative_eps"))
      )
    ),
  ),
  (
    "hybrid: Newton-Schulz polar factor, not the damped Gram inverse square root",
    cases("hybrid_", "swiglu_dense_hybrid", "swiglu_gptoss_hybrid"),
    dict(settings=without(scale_by_hybrid=("polar",))),
  ),
  (
    "hybrid: row scaling x / max(||x||, eps)",
    cases("hybrid_", "swiglu_dense_hybrid", "swiglu_gptoss_hybrid"),
    dict(settings=without(scale_by_hybrid=("eps_form",))),
  ),
  (
    "batched-expert hybrid: nuclear norm per expert, not summed over experts",
    cases("hybrid_experts", "swiglu_gptoss_hybrid"),
    dict(shared_nuclear_norm=False),
  ),
]


def measure(selected, mode="fp32", **kw):
  """Largest relative difference (and its case), smallest cosine, norm-ratio range."""
  rel, cos, ratio = {}, [], []
  for case in selected:
    for _, _, _, ours, theirs in golden.runs(case, mode, scenarios=("zero",), **kw):
      rel[case] = max(rel.get(case, 0.0), np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))
      cos.append(np.sum(ours * theirs) / (np.linalg.norm(ours) * np.linalg.norm(theirs)))
      ratio.append(np.linalg.norm(ours) / np.linalg.norm(theirs))
  worst = max(rel, key=rel.get)
  return rel[worst], worst, min(cos), min(ratio), max(ratio)


def joint_gate_up():
  """Dense SwiGLU gate and up, row-norm with one unit per neuron holding both
  (the library stack's default) against the reference's separate rows."""
  case, names = "swiglu_dense_rownorm", ("gate", "up")
  tx = eqv.scale_by_row_norm(0, joint=names, **eqv.REFERENCE["scale_by_row_norm"])
  step = jax.jit(tx.update)
  grads = {n: golden.DATA[f"{case}/{n}/grads"] for n in names}
  params = {
    n: np.concatenate([np.zeros_like(grads[n][:1]), golden.DATA[f"{case}/zero/fp32/{n}/params"]])
    for n in names
  }
  state, rel, cos, ratio = tx.init({n: grads[n][0] for n in names}), [], [], []
  for k in range(3):  # scenario zero: lr 1, no weight decay, so u_k = p_{k-1} - p_k
    u, state = step({n: grads[n][k] for n in names}, state)
    for n in names:
      ours, theirs = (
        np.asarray(u[n], np.float64),
        params[n][k] - params[n][k + 1].astype(np.float64),
      )
      rel.append(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))
      cos.append(np.sum(ours * theirs) / (np.linalg.norm(ours) * np.linalg.norm(theirs)))
      ratio.append(np.linalg.norm(ours) / np.linalg.norm(theirs))
  return max(rel), case, min(cos), min(ratio), max(ratio)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--only", default="", help="run the rows whose label contains this")
  only = parser.parse_args().only
  print(
    "| difference (library default vs reference) | cases | max rel. diff (case) | min cosine | norm ratio |"
  )
  print("|---|---|---|---|---|")
  rows = ROWS + [
    (
      "Muon in bfloat16 as shipped: bf16 matmuls with float32 iterate vs torch bf16 throughout",
      cases("muon_"),
      dict(mode="default", ns_dtype=jnp.bfloat16),
    )
  ]
  rows.insert(
    -1,
    (
      "stack: dense SwiGLU gate and up as one unit per neuron (joint row-norm), not separately",
      ["swiglu_dense_rownorm"],
      None,
    ),
  )
  for label, selected, kw in rows:
    if only not in label:
      continue
    rel, worst, cos, lo, hi = joint_gate_up() if kw is None else measure(selected, **kw)
    print(
      f"| {label} | {len(selected)} | {rel:.1e} ({worst}) | {cos:.4f} | {lo:.3f}-{hi:.3f} |",
      flush=True,
    )


if __name__ == "__main__":
  main()
