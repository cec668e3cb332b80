"""Outputs, gradients and state of every recipe, bit for bit against
``tests/golden/golden.npz`` (written by ``tests/golden/make_golden.py``
before the GEMM-plan refactoring): numerics must not move."""

import pathlib
import sys

import numpy as np
import pytest

import qlayers

sys.path.insert(0, str(pathlib.Path(__file__).parent / "golden"))
import make_golden  # noqa: E402  pylint: disable=g-import-not-at-top

_GOLDEN = np.load(make_golden.PATH)


def _bits(a: np.ndarray) -> np.ndarray:
  a = np.ascontiguousarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32,
                 8: np.uint64}[a.dtype.itemsize])


# The recipes the golden file holds (recipes added since pin their numerics
# in their own tests, e.g. test_nvfp4.py against the NumPy reference).
_NAMES = sorted({k.split("/")[0] for k in _GOLDEN.files})


def test_every_golden_recipe_still_ships():
  assert set(_NAMES) <= set(qlayers.available_recipes())


@pytest.mark.parametrize("name", _NAMES)
def test_recipe_is_bit_identical_to_the_golden_file(name):
  got = {}
  for part in (make_golden._layer(name), make_golden._ops(name)):  # pylint: disable=protected-access
    got.update({f"{name}/{k}": v for k, v in part.items()})
  want = {k: _GOLDEN[k] for k in _GOLDEN.files if k.startswith(name + "/")}
  assert sorted(got) == sorted(want)
  for k, v in want.items():
    assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
    diff = int((_bits(got[k]) != _bits(v)).sum())
    assert diff == 0, f"{k}: {diff} of {v.size} elements differ"
