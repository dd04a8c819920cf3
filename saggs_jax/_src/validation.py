"""Checks of user arguments, shared by the symmetry stages.

>>> from saggs_jax._src.validation import check_number
>>> check_number("every", 0, lambda k: k >= 1, ">= 1", integer=True)
Traceback (most recent call last):
...
ValueError: every must be an int >= 1, got 0.
"""

from __future__ import annotations

import numpy as np


def check_number(name, value, ok, interval, integer):
  """Raises a ValueError naming ``name`` unless ``value`` is a number (an int if ``integer``)
  for which ``ok`` holds; ``interval`` says which in words."""
  kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
  if isinstance(value, bool) or not isinstance(value, kinds) or not ok(value):
    raise ValueError(
      f"{name} must be {'an int' if integer else 'a number'} {interval}, got {value!r}."
    )
