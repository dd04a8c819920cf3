"""The study of ``harness.study``: the papers' claims measured over seeds.

Its docstring (``python examples/study.py --help`` prints the flags) describes the
experiments, seeds, verdicts and the resumable ``runs.jsonl``; docs/study.md gives the
results. From the repository root::

  python examples/study.py
  python examples/study.py --seeds 10 --opt-seeds 6 --tune-seeds 2
"""

import common  # noqa: F401  (the repository root on sys.path, for harness)
from harness import study

if __name__ == "__main__":
  study.main()
