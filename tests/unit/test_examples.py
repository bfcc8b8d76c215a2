"""The built-in examples' data: digits are scikit-learn's, as `load_digits` gives them, read
without importing scikit-learn (1.5 CPU-seconds in every worker that loads them)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from sklearn.datasets import load_digits

from ravnest.examples import digits


def test_digits_are_load_digits_read_without_importing_scikit_learn():
    images, targets = digits.digits()
    expected = load_digits()
    np.testing.assert_array_equal(images, expected.images)
    np.testing.assert_array_equal(targets, expected.target)
    assert images.dtype == expected.images.dtype and targets.dtype == expected.target.dtype
    train, val = digits.datasets()
    assert len(train) + len(val) == len(expected.target) == 1797
    imported = subprocess.run(
        [sys.executable, "-c", "import sys; from ravnest.examples.digits import datasets; "
         "datasets(); print(sorted({m.split('.')[0] for m in sys.modules} & {'sklearn'}))"],
        capture_output=True, text=True, timeout=120, check=True)
    assert imported.stdout.strip() == "[]", imported.stdout
