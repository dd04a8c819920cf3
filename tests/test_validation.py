"""saggs_jax._src.validation: the argument checks the stages share."""

import re

import numpy as np
import pytest

from saggs_jax._src.validation import check_number


@pytest.mark.parametrize("value", [1, 2, np.int64(3)])
def test_check_number_accepts_ints_in_range(value):
  check_number("every", value, lambda k: k >= 1, ">= 1", integer=True)


@pytest.mark.parametrize("value", [0, 1.5, True, "2", None, np.float32(2.0)])
def test_check_number_rejects_with_the_name_and_interval(value):
  with pytest.raises(ValueError, match=re.escape(f"every must be an int >= 1, got {value!r}.")):
    check_number("every", value, lambda k: k >= 1, ">= 1", integer=True)


def test_check_number_numbers_and_nan():
  check_number("tau", np.float32(0.5), lambda t: 0 < t <= 1, "in (0, 1]", integer=False)
  for bad in (float("nan"), 0.0, 2):
    with pytest.raises(ValueError, match=r"tau must be a number in \(0, 1\]"):
      check_number("tau", bad, lambda t: 0 < t <= 1, "in (0, 1]", integer=False)
