"""Puts the repository root on ``sys.path``, so that the examples import ``harness``.

The harness (the example LM, the study, its statistics) is a folder of the repository, not
part of the installed ``saggs_jax``; a script's own folder is on ``sys.path``, the repository
root is not. Every example imports this module before ``harness``.
"""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))
