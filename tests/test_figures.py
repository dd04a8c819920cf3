"""The update-time figures (docs/benchmarks.md; the README links to them) name the commit
they were measured at (``bench/bench_saggs.py`` prints it first), and no module on the update path
has changed since: a change there means measuring again."""

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
UPDATE_PATH = [
  f"saggs_jax/_src/{name}.py"
  for name in ("norms", "balance", "transport", "scaling", "transform", "stage", "chain")
]
# The sentence that names the commit, beside the update-time figures of each document.
MARKER = re.compile(r"bench/bench_saggs\.py --part update[^`]*` at commit `([0-9a-f]{7,40})`")


def git(*args: str) -> str:
  command = ["git", "-C", str(ROOT), *args]
  return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("document", ["docs/benchmarks.md"])
def test_update_time_figures_are_newer_than_the_update_path(document):
  try:
    git("rev-parse", "--git-dir")
  except (OSError, subprocess.CalledProcessError):
    pytest.skip("not a git checkout: the history the figures are checked against is missing")
  found = MARKER.findall((ROOT / document).read_text())
  assert len(found) == 1, f"{document} names no commit (or several) beside its update times"
  (commit,) = found
  try:
    git("cat-file", "-e", f"{commit}^{{commit}}")
  except subprocess.CalledProcessError:
    pytest.skip(f"commit {commit} is not in this checkout's history (a shallow clone?)")
  newer = git("log", "--format=%h %s", f"{commit}..HEAD", "--", *UPDATE_PATH)
  assert not newer, (
    f"{document}'s update times were measured at {commit}; the update path changed since:"
    f"\n{newer}\nmeasure again (bench/bench_saggs.py --part update) and name the new commit"
  )
