"""Test setup: strict dtype promotion, rank-promotion errors, warnings as errors."""

import jax
import pytest

from _support.numerics import sqnr_db

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_configure(config):
  config.addinivalue_line("filterwarnings", "error")
  # Third-party warnings we do not control.
  for pattern in (
      "ignore::DeprecationWarning:orbax.*",
      "ignore::DeprecationWarning:tensorstore.*",
      "ignore::DeprecationWarning:google.protobuf.*",
      "ignore::DeprecationWarning:tunix.*",
      "ignore:.*jax.tree_util.register_keypaths.*:DeprecationWarning",
  ):
    config.addinivalue_line("filterwarnings", pattern)


@pytest.fixture
def sqnr():
  return sqnr_db


@pytest.fixture
def optax_promotion():
  """optax.adam computes ``decay ** count`` (float ** int32), which strict
  dtype promotion refuses: run optimizer updates under the standard rules."""
  with jax.numpy_dtype_promotion("standard"):
    yield
