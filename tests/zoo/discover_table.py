"""Prints the README's zoo table: what ``saggs.discover`` finds on each zoo model, and how long
it takes (tracing, numeric confirmation and compilation included; the model already built).

  python tests/zoo/discover_table.py            # needs the zoo extra: pip install -e ".[zoo]"
"""

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def summary(found) -> str:
  """What was found, briefly: each pair's name, the layers on its sides and its grouping; the
  norm gains by their norm layers."""
  if isinstance(found, Exception):
    return f"raises {found!r}"

  def short(side):
    names = []
    for s in side if isinstance(side, tuple) else (side,):
      pattern = s if isinstance(s, str) else s.pattern
      segs = [x for x in pattern.split("/") if x not in ("kernel", "weight", "scale", "w")]
      names.append(segs[-1] + ("" if isinstance(s, str) else f"[{s.part}]"))
    return "+".join(names)

  phrases, gains = [], []
  for p in found:
    if p.name == "norm gain":
      gains.append(short(p.a))
      continue
    groups = "per channel" if p.groups is None else f"{p.groups} group{'s' * (p.groups > 1)}"
    phrases.append(f"{p.name or 'pair'} {short(p.a)} ~ {short(p.b)} ({groups})")
  if gains:
    phrases.append(f"norm gains of {', '.join(gains)} against the linears they feed")
  return "; ".join(phrases)


def gemma_row():
  """The gemma package imports in a process of its own (it patches flax process-wide)."""
  out = os.path.join(tempfile.mkdtemp(prefix="zoo_table_"), "row.json")
  code = (
    "import sys, json, gemma_worker, discover_table as t; "
    "zoo = gemma_worker.build(); "
    "json.dump([zoo.seconds, t.summary(zoo.found)], open(sys.argv[1], 'w'))"
  )
  env = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join(
      [os.path.dirname(os.path.dirname(HERE)), HERE, os.environ.get("PYTHONPATH", "")]
    ),
  )
  subprocess.run([sys.executable, "-c", code, out], env=env, check=True, timeout=600)
  with open(out) as f:
    return json.load(f)


def main():
  import jax

  jax.config.update("jax_default_matmul_precision", "highest")
  import zoo_models

  rows = []
  classes = dict(
    llama="FlaxLlamaForCausalLM (GQA)",
    mistral="FlaxMistralForCausalLM (GQA)",
    gemma="FlaxGemmaForCausalLM (MQA)",
    gpt2="FlaxGPT2LMHeadModel (fused QKV)",
  )
  for name, cls in classes.items():
    zoo = zoo_models.transformers_model(name)
    rows.append((f"transformers `{cls}`", zoo.seconds, summary(zoo.found)))
  seconds, found = gemma_row()
  rows.append(("gemma package `gm.nn.Transformer` (GQA, fused kv and gating)", seconds, found))
  zoo = zoo_models.equinox_model()
  rows.append(("equinox LLaMA-style", zoo.seconds, summary(zoo.found)))
  print("| model | discover (s) | what discover finds |")
  print("|---|---|---|")
  for model, seconds, found in rows:
    print(f"| {model} | {seconds:.1f} | {found} |")


if __name__ == "__main__":
  main()
