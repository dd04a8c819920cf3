"""Packs the reference golden vectors into ``equivariant_reference.npz``.

The input is the npz that a generator script wrote by running the classes of
timlautk/equivariant_optimizers (the public code of Lau & Su, "symmetry-
compatible updates") on fixed gradients: per case, scenario (``zero``,
``init_wd``, ``init_wd_lr05``) and mode (``fp32``, ``default``), the arrays
``param_0``, ``grad_1..3``, ``param_1..3`` of every tensor, plus a JSON
``meta``. This keeps every case and drops only repeats: the gradients and the
random init are shared by all runs of a case, and the ``default`` mode is kept
only where it differs from ``fp32`` (the Muon classes, whose Polar Express
runs in bfloat16). Output keys:

* ``__info__``, ``<case>/meta``: the JSON strings of the input;
* ``<case>/<tensor>/grads``: ``(3, *shape)``, the gradients of steps 1..3;
* ``<case>/<tensor>/init``: the random ``param_0`` of the ``init_*`` scenarios
  (``zero`` starts from zeros);
* ``<case>/<scenario>/<mode>/<tensor>/params``: ``(3, *shape)``, the
  parameters after steps 1..3.

  python tests/data/pack_reference.py GOLDEN.npz tests/data/equivariant_reference.npz
"""

import json
import sys

import numpy as np


def pack(src):
  z = np.load(src)
  info = json.loads(str(z["__info__"]))
  out = {"__info__": z["__info__"]}
  for case in info["cases"]:
    meta = json.loads(str(z[f"{case}/meta"]))
    out[f"{case}/meta"] = z[f"{case}/meta"]
    for t in meta["tensors"]:
      name = t["name"]
      get = lambda s, m, a, case=case, name=name: z[f"{case}/{s}/{m}/{name}/{a}"]
      grads = np.stack([get("zero", "fp32", f"grad_{k}") for k in (1, 2, 3)])
      init = get("init_wd", "fp32", "param_0")
      for s in info["scenarios"]:
        for m in info["modes"]:
          assert np.array_equal(grads, np.stack([get(s, m, f"grad_{k}") for k in (1, 2, 3)]))
          start = get(s, m, "param_0")
          assert not start.any() if s == "zero" else np.array_equal(start, init)
      out[f"{case}/{name}/grads"] = grads
      out[f"{case}/{name}/init"] = init
      for s in info["scenarios"]:
        fp32 = np.stack([get(s, "fp32", f"param_{k}") for k in (1, 2, 3)])
        default = np.stack([get(s, "default", f"param_{k}") for k in (1, 2, 3)])
        out[f"{case}/{s}/fp32/{name}/params"] = fp32
        if not np.array_equal(fp32, default):
          out[f"{case}/{s}/default/{name}/params"] = default
  return out


if __name__ == "__main__":
  np.savez_compressed(sys.argv[2], **pack(sys.argv[1]))
