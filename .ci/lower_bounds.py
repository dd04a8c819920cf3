"""The lower bounds of pyproject.toml's dependencies, as pip constraints (``name==version``).

The dependencies, and the libraries of the ``test`` extra that saggs_jax is used with (flax,
chex); not its tools (pytest, hypothesis, ...).

With ``--check``: that the installed versions are those bounds, so the oldest CI run tests
what the package claims to support.
"""

import argparse
import pathlib
import re
import sys
import tomllib
from importlib import metadata

PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
LIBRARIES = ("flax", "chex")  # of the test extra


def bounds() -> dict[str, str]:
  project = tomllib.loads(PYPROJECT.read_text())["project"]
  test = project["optional-dependencies"]["test"]
  deps = project["dependencies"] + [d for d in test if re.match(rf"({'|'.join(LIBRARIES)})\b", d)]
  found = {}
  for dep in deps:
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][0-9.]*)", dep.replace(" ", ""))
    if not m:
      sys.exit(f"{PYPROJECT}: {dep!r} has no plain lower bound (name>=version)")
    found[m[1]] = m[2]
  return found


def main():
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--check", action="store_true", help="compare with what is installed")
  args = parser.parse_args()
  if not args.check:
    print("\n".join(f"{name}=={version}" for name, version in bounds().items()))
    return
  wrong = {n: (v, metadata.version(n)) for n, v in bounds().items() if metadata.version(n) != v}
  if wrong:
    sys.exit(f"installed versions are not the lower bounds: {wrong}")


if __name__ == "__main__":
  main()
