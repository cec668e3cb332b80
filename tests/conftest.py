"""Test setup: the suite's XLA flags (`_support.xla_flags`), strict dtype
promotion, rank-promotion errors, warnings as errors."""

from _support import xla_flags

xla_flags.apply()  # before JAX starts its backend

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
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
      # jax >= 0.11 lowering the one-pass kernels for CUDA (Pallas on Triton).
      "ignore:The Pallas Triton backend is deprecated:DeprecationWarning",
  ):
    config.addinivalue_line("filterwarnings", pattern)


# Modules whose tests share one expensive module-scoped result (a
# multi-device subprocess: multidevice.run_once, or a trained model): under
# pytest-xdist one worker runs each of them whole, so no other worker sits
# waiting for that result or builds it again. Every other test is spread
# over the workers one by one.
WHOLE_MODULES = frozenset({
    "tests/test_sharding_auto.py", "tests/test_sharding_explicit.py",
    "tests/test_sharding_multiprocess.py", "tests/test_nvfp4_sharded.py",
    "tests/test_partition.py", "tests/test_expert_parallel.py",
    "tests/test_checkpoint.py", "tests/examples/test_models.py",
})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  from xdist.scheduler import LoadScopeScheduling  # pylint: disable=g-import-not-at-top

  class Scheduling(LoadScopeScheduling):

    def _split_scope(self, nodeid):
      module = nodeid.split("::", 1)[0]
      return module if module in WHOLE_MODULES else nodeid

  return Scheduling(config, log)


@pytest.fixture
def sqnr():
  return sqnr_db


@pytest.fixture
def optax_promotion():
  """optax.adam computes ``decay ** count`` (float ** int32), which strict
  dtype promotion refuses: run optimizer updates under the standard rules."""
  with jax.numpy_dtype_promotion("standard"):
    yield


@pytest.fixture(autouse=True)
def _fresh_traces_when_patched(request):
  """A test that monkeypatches qlayers' internals traces them afresh, and
  leaves no trace made under its patches: a layer's GEMMs and a step's end
  are jitted as trace caches (`qlayers.gemm`, `qlayers.history_roll`), which
  would otherwise replay a trace made before the patch (or after it, one
  made under it)."""
  patched = "monkeypatch" in request.fixturenames
  if patched:
    jax.clear_caches()
  yield
  if patched:
    jax.clear_caches()
