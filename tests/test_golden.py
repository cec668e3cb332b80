"""Outputs, gradients and state of every recipe against
``tests/golden/golden.npz`` (written by ``tests/golden/make_golden.py``):
numerics must not move. The file was first written before the GEMM-plan
refactoring, at XLA:CPU's default optimization level; it was rewritten
under the suite's flags (`_support.xla_flags`: level 0), from a tree that
still matched it at the default level.

Quantization state (amax histories, the gradient amax) is compared bit for
bit. A float32 value that comes out of an FP32-accumulated GEMM (outputs,
gradients, the parameters Adam moved with them) carries the summation order
XLA's CPU kernels pick for the host (on a host with AVX512-BF16/AMX, BF16
GEMMs round differently from the host the file was written on): those
are compared to within 2^-16 of the array's largest magnitude. The largest
difference seen is 2^-20 (the BF16 recipe's bias after 3 Adam steps, which
divide by the gradient's own size); a change of a rounding, a payload or a
scale moves values by 2^-8 (BF16) to 2^-3 (FP8) relative, and the scale
formulas are pinned bit for bit in their own tests."""

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


_ORDER_TOLERANCE = 2.0**-16


def _is_state(key: str) -> bool:
  """Quantization state: no GEMM's summation order reaches it."""
  return any(part in key for part in ("/qstate/", "/state/", "/grad/quant/",
                                      "/g_amax"))


# The recipes the golden file holds (recipes added since pin their numerics
# in their own tests, e.g. test_nvfp4.py against the NumPy reference).
_NAMES = sorted({k.split("/")[0] for k in _GOLDEN.files})


def test_every_golden_recipe_still_ships():
  assert set(_NAMES) <= set(qlayers.available_recipes())


@pytest.mark.parametrize("name", _NAMES)
def test_recipe_matches_the_golden_file(name):
  got = {}
  for part in (make_golden._layer(name), make_golden._ops(name)):  # pylint: disable=protected-access
    got.update({f"{name}/{k}": v for k, v in part.items()})
  want = {k: _GOLDEN[k] for k in _GOLDEN.files if k.startswith(name + "/")}
  assert sorted(got) == sorted(want)
  for k, v in want.items():
    assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
    if _is_state(k):
      diff = int((_bits(got[k]) != _bits(v)).sum())
      assert diff == 0, f"{k}: {diff} of {v.size} elements differ"
    else:
      np.testing.assert_allclose(got[k], v, rtol=0, err_msg=k,
                                 atol=_ORDER_TOLERANCE * np.abs(v).max())
