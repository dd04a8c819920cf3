"""Every ``python examples/...`` command that README.md and docs/ give runs, at smoke size.

``COMMANDS`` is the one list of them, with the files each says it writes; the first test
keeps it equal to what the documents give. The others run each command as written, in a
subprocess with ``SAGGS_SMOKE=1`` (every example shrinks to a tiny model and a few steps,
``harness.lm.smoke_defaults``), all in one folder in the order listed, so that the study's
second command reuses the first one's runs as docs/study.md says it does.
"""

import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The moe experiment's own plots (harness.study.plot_moe), besides its differences and curves.
MOE_PLOTS = ("load_imbalance", "router_flips", "router_norm", "router_change", "logit_growth")
# Each documented command: the files it writes (relative to where it runs), or why it cannot
# run here.
COMMANDS = {
  "python examples/train_lm.py": [
    "runs/train_lm/loss.png",
    "runs/train_lm/val_gap.png",
    "runs/train_lm/qk_imbalance.png",
  ],
  "python examples/discover.py": ["runs/discover/loss.png"],
  "python examples/checkpoint_resume.py": ["runs/checkpoint_resume/val_loss.png"],
  "python examples/compare_optimizers.py --seeds 3": [
    "runs/compare_optimizers/val_loss_vs_lr.png",
    "runs/compare_optimizers/best_curves.png",
  ],
  "python examples/qk_clip.py": ["runs/qk_clip/max_logit.png"],
  "python examples/study.py": [
    f"runs/study/{experiment}_{plot}.png"
    for experiment in ("imbalance", "resume", "balanced", "optimizers", "moe")
    for plot in ("differences", "curves")
  ]
  + [f"runs/study/moe_{plot}.png" for plot in MOE_PLOTS],
  "python examples/study.py --experiments moe": [
    f"runs/study/moe_{plot}.png" for plot in ("differences", "curves", *MOE_PLOTS)
  ],
  "python examples/study.py --seeds 10 --opt-seeds 6 --tune-seeds 2": ["runs/study/runs.jsonl"],
  "python examples/gpu_study.py --tiny": ["runs/gpu_study_tiny/summary.json"],
  "python examples/gpu_study.py": "needs a GPU (JAX for CUDA); its --tiny form runs here",
  (
    "python examples/maxtext_saggs.py \"$(python -c 'import maxtext, os;"
    " print(os.path.dirname(maxtext.__file__))')/configs/base.yml\" model_name=llama2-7b"
    " run_name=saggs base_output_directory=/tmp/maxtext dataset_type=synthetic steps=20"
  ): (
    "needs MaxText and a 7B model's memory; the zoo's MaxText leg runs the same driver on a"
    " tiny config (tests/zoo/test_zoo_maxtext_train.py)"
  ),
  "python examples/easydel_saggs.py": (
    "needs EasyDeL (Python 3.11 with its own pins); the zoo's EasyDeL leg runs it at smoke size"
    " (tests/zoo/test_zoo_easydel_train.py::test_the_documented_command_runs)"
  ),
}

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)


def documented(text: str) -> list[str]:
  """The ``python examples/...`` commands of a Markdown text, whitespace normalised: in code
  blocks (a line's continuation joined, its ``  #`` comment cut) and in inline code."""
  found = []
  for block in _FENCE.findall(text):
    for line in block.replace("\\\n", " ").splitlines():
      if match := re.search(r"python examples/.*", line.split("  #")[0]):
        found.append(match[0])
  found += re.findall(r"`(python examples/[^`]*)`", _FENCE.sub("", text))
  return [" ".join(command.split()) for command in found]


def test_documented_finds_commands_in_blocks_and_inline_code():
  text = (
    "Run `python examples/a.py\n--x 1` or:\n\n```bash\npip install . && python examples/b.py \\\n"
    "  --y 2   # writes runs/b\n```\n"
  )
  assert documented(text) == ["python examples/b.py --y 2", "python examples/a.py --x 1"]


def test_commands_are_exactly_those_the_docs_give():
  pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
  given = {command for page in pages for command in documented(page.read_text())}
  assert given == set(COMMANDS), (
    f"documented but not in COMMANDS: {sorted(given - set(COMMANDS))}; "
    f"in COMMANDS but not documented: {sorted(set(COMMANDS) - given)}"
  )


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  return tmp_path_factory.mktemp("examples")


@pytest.mark.heavy
@pytest.mark.parametrize("command", list(COMMANDS))
def test_documented_command_runs_at_smoke_size(command, folder):
  files = COMMANDS[command]
  if isinstance(files, str):
    if "GPU" not in files or jax.default_backend() != "gpu":
      pytest.skip(files)
  script, *args = command.removeprefix("python ").split()
  done = subprocess.run(
    [sys.executable, str(ROOT / script), *args],
    cwd=folder,
    env={**os.environ, "SAGGS_SMOKE": "1", "PYTHONUNBUFFERED": "1"},
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stderr[-4000:]}"
  saved = re.findall(r"^Saved ([^\s,]+)", done.stdout, re.M)
  missing = [f for f in (*files, *saved) if not (folder / f).is_file()]
  assert not missing, f"{command} did not write {missing}"
