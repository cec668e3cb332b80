"""Test setup: strict dtype promotion, rank-promotion errors, warnings as errors."""

import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_configure(config):
  config.addinivalue_line("filterwarnings", "error")
  # Third-party warnings we do not control.
  for pattern in (
      "ignore::DeprecationWarning:orbax.*",
      "ignore::DeprecationWarning:tensorstore.*",
      "ignore::DeprecationWarning:google.protobuf.*",
      "ignore:.*jax.tree_util.register_keypaths.*:DeprecationWarning",
  ):
    config.addinivalue_line("filterwarnings", pattern)


def sqnr_db(ref, approx) -> float:
  """20*log10(|ref| / |ref - approx|) in float64."""
  import numpy as np
  r = np.asarray(ref, np.float64)
  a = np.asarray(approx, np.float64)
  err = np.linalg.norm(r - a)
  return float("inf") if err == 0 else float(20 * np.log10(np.linalg.norm(r) / err))


@pytest.fixture
def sqnr():
  return sqnr_db
