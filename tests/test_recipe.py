"""Recipe files and validation."""

import pathlib

import pytest

import qlayers
from qlayers.recipe import GemmRecipe, Recipe
from qlayers.scaling import QuantSpec

REQUIRED = ["bf16", "fp16", "fp8_delayed", "fp8_current", "fp8_rowwise",
            "deepseek_v3", "mxfp8", "mxfp6", "mxfp4"]


def test_all_named_recipes_load():
  assert set(REQUIRED) <= set(qlayers.available_recipes())
  for name in REQUIRED:
    r = qlayers.recipe(name)
    assert r.name == name and r.description


def test_recipe_contents():
  d = qlayers.recipe("fp8_delayed")
  assert d.delayed and d.amax_history_len == 1024
  assert d.amax_compute_algo == "max"
  assert (d.fprop.lhs.format, d.fprop.rhs.format) == ("e4m3", "e4m3")
  assert (d.dgrad.lhs.format, d.dgrad.rhs.format) == ("e5m2", "e4m3")
  assert (d.wgrad.lhs.format, d.wgrad.rhs.format) == ("e4m3", "e5m2")
  ds = qlayers.recipe("deepseek_v3")
  assert ds.fprop.lhs.granularity == "tile" and ds.fprop.lhs.block_size == 128
  assert ds.fprop.rhs.granularity == "block"
  assert ds.fprop.lhs.scale_rule == "deepseek"
  m = qlayers.recipe("mxfp8")
  assert m.fprop.lhs.scale_rule == "mx_rceil" and m.fprop.lhs.block_size == 32
  f4 = qlayers.recipe("mxfp4")
  assert f4.dgrad.lhs.stochastic and f4.wgrad.rhs.stochastic
  assert not f4.fprop.lhs.stochastic
  assert qlayers.recipe("fp8_rowwise").fprop.lhs.pow2
  assert not qlayers.recipe("bf16").quantized
  assert qlayers.recipe("fp16").loss_scaling == "dynamic"


def test_recipe_from_path_and_overrides(tmp_path: pathlib.Path):
  p = tmp_path / "mine.toml"
  p.write_text('scaling = "delayed"\namax_history_len = 16\n'
               '[fprop]\nx = { format = "e4m3" }\nw = { format = "e4m3" }\n')
  r = qlayers.recipe(p)
  assert r.name == "mine" and r.amax_history_len == 16 and r.delayed
  assert qlayers.recipe(str(p), amax_history_len=4).amax_history_len == 4
  assert qlayers.recipe("fp8_delayed", amax_history_len=8).amax_history_len == 8


def test_validation_errors(tmp_path):
  e4 = QuantSpec(format="e4m3")
  e5 = QuantSpec(format="e5m2")
  with pytest.raises(ValueError, match="E5M2 by E5M2"):
    Recipe(dgrad=GemmRecipe(lhs=e5, rhs=e5))
  with pytest.raises(ValueError, match="one operand only"):
    Recipe(fprop=GemmRecipe(lhs=e4))
  with pytest.raises(ValueError, match="delayed scaling keeps one scale"):
    Recipe(scaling="delayed",
           fprop=GemmRecipe(lhs=QuantSpec(granularity="mx"),
                            rhs=QuantSpec(granularity="mx")))
  with pytest.raises(ValueError, match="loss_scaling='dynamic'"):
    Recipe(compute_dtype="float16")
  with pytest.raises(ValueError, match="Unknown recipe 'nope'"):
    qlayers.recipe("nope")
  with pytest.raises(FileNotFoundError):
    qlayers.recipe(tmp_path / "missing.toml")
  bad = tmp_path / "bad.toml"
  bad.write_text("scaling = [")
  with pytest.raises(ValueError, match="not valid TOML"):
    qlayers.recipe(bad)
  unknown = tmp_path / "unknown.toml"
  unknown.write_text('[fprop]\nx = { format = "e4m3", colour = 1 }\n'
                     'w = { format = "e4m3" }\n')
  with pytest.raises(ValueError, match="unknown keys"):
    qlayers.recipe(unknown)
  wrong_role = tmp_path / "role.toml"
  wrong_role.write_text('[fprop]\ng = { format = "e4m3" }\n')
  with pytest.raises(ValueError, match="takes operands"):
    qlayers.recipe(wrong_role)
