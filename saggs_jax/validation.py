"""Checks of user arguments and the user's frame, shared by the symmetry stages.

>>> from saggs_jax.validation import check_number
>>> check_number("every", 0, lambda k: k >= 1, ">= 1", integer=True)
Traceback (most recent call last):
...
ValueError: every must be an int >= 1, got 0.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import optax


def check_number(name, value, ok, interval, integer):
  """Raises a ValueError naming ``name`` unless ``value`` is a number (an int if ``integer``)
  for which ``ok`` holds; ``interval`` says which in words."""
  kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
  if isinstance(value, bool) or not isinstance(value, kinds) or not ok(value):
    raise ValueError(
      f"{name} must be {'an int' if integer else 'a number'} {interval}, got {value!r}."
    )


def user_frame():
  """The innermost frame outside saggs_jax, optax and jax: the user's line."""
  internal = tuple(os.path.dirname(m.__file__ or "") for m in (optax, jax)) + (
    os.path.dirname(__file__),
  )
  frame = sys._getframe(1)
  while frame is not None and frame.f_code.co_filename.startswith(internal):
    frame = frame.f_back
  return frame
