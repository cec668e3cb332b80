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
  latin1 = tmp_path / "latin1.toml"  # a bare UnicodeDecodeError before
  latin1.write_bytes('name = "caf\u00e9"\n'.encode("latin-1"))
  with pytest.raises(ValueError, match=r"latin1.toml: not valid TOML \(TOML "
                     "is UTF-8"):
    qlayers.recipe(latin1)
  (tmp_path / "dir.toml").mkdir()
  with pytest.raises(FileNotFoundError, match="dir.toml is not a file"):
    qlayers.recipe(tmp_path / "dir.toml")
  unknown = tmp_path / "unknown.toml"
  unknown.write_text('[fprop]\nx = { format = "e4m3", colour = 1 }\n'
                     'w = { format = "e4m3" }\n')
  with pytest.raises(ValueError, match="unknown keys"):
    qlayers.recipe(unknown)
  wrong_role = tmp_path / "role.toml"
  wrong_role.write_text('[fprop]\ng = { format = "e4m3" }\n')
  with pytest.raises(ValueError, match="takes operands"):
    qlayers.recipe(wrong_role)


def _load(tmp_path, text, name="r"):
  p = tmp_path / f"{name}.toml"
  p.write_text(text)
  return qlayers.recipe(p)


@pytest.mark.parametrize("block", [7, 16, 64])
def test_mx_block_size_must_be_32(tmp_path, block):
  """OCP MX v1.0 fixes the block size at 32: refused when the recipe is
  made, naming the field, not at the first GEMM (or never)."""
  with pytest.raises(ValueError, match=f"block_size must be 32.*got {block}"):
    QuantSpec(format="e4m3", granularity="mx", block_size=block)
  with pytest.raises(ValueError, match=r"fprop\.x: block_size must be 32"):
    _load(tmp_path, f'[defaults]\ngranularity = "mx"\nformat = "e2m3"\n'
          f'block_size = {block}\n[fprop]\nx = {{}}\nw = {{}}\n')
  assert QuantSpec(format="e4m3", granularity="mx", block_size=32)


def test_block_size_only_where_it_applies():
  with pytest.raises(ValueError, match="block_size applies to"):
    QuantSpec(format="e4m3", granularity="tensor", block_size=128)
  assert QuantSpec(granularity="tile", block_size=64).block_size == 64


@pytest.mark.parametrize("text,field", [
    ('save_quantized_wgrad_input = "false"\n', "save_quantized_wgrad_input"),
    ('scaling = "delayed"\namax_history_len = true\n[fprop]\n'
     'x = { format = "e4m3" }\nw = { format = "e4m3" }\n', "amax_history_len"),
    ('amax_history_len = 16.0\n', "amax_history_len"),
    ('[fprop]\nx = { format = "e4m3", pow2 = "true" }\n'
     'w = { format = "e4m3" }\n', "pow2"),
    ('[fprop]\nx = { format = "e4m3", margin = false }\n'
     'w = { format = "e4m3" }\n', "margin"),
    ('[dgrad]\nhadamard = true\ng = { format = "e2m1", granularity = "mx" }\n'
     'w = { format = "e2m1", granularity = "mx" }\n', "hadamard"),
    ('[fprop]\nout_dtype = 16\nx = { format = "e4m3" }\n'
     'w = { format = "e4m3" }\n', "out_dtype"),
    ('compute_dtype = ["bfloat16"]\n', "compute_dtype"),
    ('description = 3\n', "description"),
])
def test_toml_fields_of_the_wrong_type_are_refused(tmp_path, text, field):
  with pytest.raises(ValueError, match=rf"\.{field} must be"):
    _load(tmp_path, text)


def test_every_field_is_type_checked_in_python_too():
  e4 = QuantSpec(format="e4m3")
  with pytest.raises(TypeError, match="Recipe.amax_history_len must be int"):
    Recipe(amax_history_len=True)
  with pytest.raises(TypeError, match="save_quantized_wgrad_input must be"):
    Recipe(save_quantized_wgrad_input="false")
  with pytest.raises(TypeError, match="amax_history_len must be int"):
    qlayers.recipe("fp8_delayed", amax_history_len=True)
  with pytest.raises(ValueError, match="Recipe.scaling must be"):
    Recipe(scaling="dynamic")
  with pytest.raises(TypeError, match="GemmRecipe.lhs must be QuantSpec"):
    GemmRecipe(lhs={"format": "e4m3"}, rhs=e4)
  with pytest.raises(TypeError, match="Recipe.fprop must be GemmRecipe"):
    Recipe(fprop=None)
  with pytest.raises(TypeError, match="QuantSpec.pow2 must be bool"):
    QuantSpec(pow2=1)
  with pytest.raises(TypeError, match="QuantSpec.block_size must be int"):
    QuantSpec(granularity="tile", block_size=128.0)
  with pytest.raises(ValueError, match="QuantSpec.rounding must be"):
    QuantSpec(rounding="floor")
  with pytest.raises(ValueError, match="amax_history_len must be >= 1"):
    Recipe(amax_history_len=0)
  # numpy integers are integers; Format objects name their format.
  import numpy as np
  from qlayers import formats
  assert Recipe(amax_history_len=np.int64(4)).amax_history_len == 4
  assert QuantSpec(format=formats.E5M2).format == "e5m2"


def test_unknown_recipe_suggests_the_closest_names():
  with pytest.raises(ValueError, match=r"did you mean 'fp8_delayed'"):
    qlayers.recipe("fp8_delay")
  with pytest.raises(ValueError, match=r"did you mean 'mxfp8'.*available"):
    qlayers.recipe("mxpf8")
  with pytest.raises(ValueError, match=r"Unknown recipe 'zzz'; available"):
    qlayers.recipe("zzz")


# ----------------------------------------------------------------------------
# Files that quantize nothing, sizes out of range, bad tables: refused with
# the file and the field named.

_QUANTIZED = '[fprop]\nx = {}\nw = {}\n'


@pytest.mark.parametrize("text,what", [
    ('[defaults]\nformat = "e4m3"\ngranularity = "tensor"\n', r"\[defaults\]"),
    ('scaling = "delayed"\namax_history_len = 16\n', "scaling"),
    ('save_quantized_wgrad_input = true\n[fprop]\nout_dtype = "float32"\n',
     "save_quantized_wgrad_input"),
])
def test_a_file_that_quantizes_nothing_is_refused(tmp_path, text, what):
  with pytest.raises(ValueError, match=rf"r\.toml: sets .*{what}.* but "
                     "quantizes no GEMM: list the operands"):
    _load(tmp_path, text)


def test_wide_recipes_still_load(tmp_path):
  """A wide recipe is written as bf16.toml is: no [defaults] or GEMM
  tables, no setting only quantization reads."""
  assert not qlayers.recipe("bf16").quantized
  assert not qlayers.recipe("fp16").quantized
  mine = _load(tmp_path, 'description = "wide"\ncompute_dtype = "float32"\n')
  assert not mine.quantized and mine.compute_dtype == "float32"


def test_amax_history_len_is_bounded(tmp_path):
  text = ('scaling = "delayed"\namax_history_len = 1000000000\n'
          + _QUANTIZED)
  with pytest.raises(ValueError, match=r"r\.toml: .*amax_history_len must "
                     r"be >= 1 and <= 4096 .*got 1000000000"):
    _load(tmp_path, text)
  assert qlayers.recipe("fp8_delayed", amax_history_len=4096).delayed
  with pytest.raises(ValueError, match="<= 4096"):
    qlayers.recipe("fp8_delayed", amax_history_len=4097)


@pytest.mark.parametrize("block", [100000, 2048, 8, 48, 100])
def test_tile_and_block_sizes_are_bounded(tmp_path, block):
  """block_size 100000 once asked for ~41 GB at the first GEMM."""
  for gran in ("tile", "block"):
    text = (f'[defaults]\ngranularity = "{gran}"\nblock_size = {block}\n'
            + _QUANTIZED)
    with pytest.raises(ValueError, match=rf"r\.toml: .*fprop\.x: block_size "
                       rf"must be a power of two from 16 to 1024.*got {block}"):
      _load(tmp_path, text)
    with pytest.raises(ValueError, match=rf"power of two .*got {block}"):
      QuantSpec(granularity=gran, block_size=block)
  for ok in (16, 64, 128, 1024):
    r = _load(tmp_path, f'[defaults]\ngranularity = "tile"\n'
              f'block_size = {ok}\n' + _QUANTIZED)
    assert r.fprop.lhs.block_size == ok


@pytest.mark.parametrize("default,msg", [
    ("format = 7", r"format must be str, got 7"),
    ('format = "e9m9"', "e9m9"),
    ("pow2 = 1", r"pow2 must be bool"),
    ("colour = 1", r"unknown keys \['colour'\]"),
])
def test_defaults_are_checked_even_when_every_operand_overrides_them(
    tmp_path, default, msg):
  text = (f'[defaults]\n{default}\n[fprop]\nx = {{ format = "e4m3", '
          'pow2 = false }\nw = { format = "e4m3", pow2 = false }\n')
  with pytest.raises(ValueError, match=rf"r\.toml: \[defaults\]: .*{msg}"):
    _load(tmp_path, text)


@pytest.mark.parametrize("text,where", [
    ('[fprop]\nx = "e4m3"\nw = { format = "e4m3" }\n',
     r"fprop\.x must be a table .*got 'e4m3' \(str\)"),
    ('[fprop]\nx = false\nw = { format = "e4m3" }\n', r"fprop\.x must be a "),
    ('fprop = 3\n', r"\[fprop\] must be a table .*got 3"),
    ('defaults = "e4m3"\n' + _QUANTIZED, r"\[defaults\] must be a table"),
])
def test_operands_that_are_not_tables_name_file_and_field(tmp_path, text,
                                                         where):
  with pytest.raises(ValueError, match=rf"r\.toml: {where}"):
    _load(tmp_path, text)


def test_recipes_are_found_by_name_or_path_only(tmp_path, monkeypatch):
  """No search path from the environment: a file of your own is loaded by
  its path (QLAYERS_RECIPES is not read)."""
  (tmp_path / "mine.toml").write_text('description = "wide"\n')
  monkeypatch.setenv("QLAYERS_RECIPES", str(tmp_path))
  assert "mine" not in qlayers.available_recipes()
  with pytest.raises(ValueError, match="Unknown recipe 'mine'"):
    qlayers.recipe("mine")
  assert qlayers.recipe(tmp_path / "mine.toml").name == "mine"
  # A shipped name is not shadowed by a same-named file where it runs.
  monkeypatch.chdir(tmp_path)
  (tmp_path / "mxfp8").write_text("")
  (tmp_path / "fp8_delayed").write_text("a log, not TOML\n")
  assert qlayers.recipe("mxfp8").quantized
  assert qlayers.recipe("fp8_delayed").delayed
  assert not qlayers.recipe("./mxfp8").quantized  # a path: the file's


def test_wgrad_out_dtype_bfloat16_rounds_the_weight_gradient():
  """``[wgrad] out_dtype = "bfloat16"`` stores the weight gradient as a BF16
  layer does (half the bytes the optimizer reads); the default is FP32."""
  import dataclasses
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  base = qlayers.recipe("fp8_current")
  narrow = base.replace(wgrad=dataclasses.replace(base.wgrad,
                                                  out_dtype="bfloat16"))
  x = jax.random.normal(jax.random.key(0), (32, 64))

  def kernel_grad(recipe):
    layer = qlayers.QuantDense(64, 48, recipe=recipe, rngs=nnx.Rngs(1))
    loss = lambda m, x: jnp.sum(m(x) ** 2)  # noqa: E731
    _, grads = qlayers.value_and_grad(loss)(layer, x)
    return np.asarray(grads["kernel"][...], np.float32)

  wide, bf16 = kernel_grad(base), kernel_grad(narrow)
  assert bf16.dtype == wide.dtype == np.float32
  as_bf16 = np.asarray(jnp.asarray(bf16).astype(jnp.bfloat16), np.float32)
  np.testing.assert_array_equal(bf16, as_bf16)       # BF16 values
  assert (np.asarray(jnp.asarray(wide).astype(jnp.bfloat16), np.float32)
          != wide).any()                              # the default is not
  np.testing.assert_allclose(bf16, wide, rtol=2.0**-8, atol=0)


def test_benchmark_recipe_variants_differ_from_theirs_only_in_wgrad_dtype():
  """benchmarks/recipes/NAME_bf16_wgrad.toml is NAME with BF16 weight
  gradients (RESULTS.md, "What FP32 weight gradients cost")."""
  import dataclasses
  files = sorted((pathlib.Path(__file__).parent.parent / "benchmarks"
                  / "recipes").glob("*_bf16_wgrad.toml"))
  assert len(files) == 3
  for f in files:
    variant = qlayers.recipe(str(f))
    base = qlayers.recipe(f.stem.removesuffix("_bf16_wgrad"))
    assert variant.wgrad.out_dtype == "bfloat16" and base.wgrad.out_dtype is None
    assert dataclasses.replace(variant, name=base.name,
                               description=base.description,
                               wgrad=base.wgrad) == base


def test_delayed_settings_on_another_scaling_are_refused(tmp_path):
  # They were accepted and read by nothing, and a checkpoint of the shipped
  # fp8_current then refused to restore over them.
  path = tmp_path / "cur.toml"
  path.write_text('scaling = "current"\namax_history_len = 16\n'
                  '[defaults]\nformat = "e4m3"\n'
                  "[fprop]\nx = {}\nw = {}\n")
  with pytest.raises(ValueError, match="amax_history_len.*only delayed"):
    qlayers.recipe(path)


def test_saving_a_wgrad_input_that_is_not_quantized_is_refused(tmp_path):
  # Accepted and read by nothing: the Wgrad input stayed wide.
  path = tmp_path / "fprop_only.toml"
  body = '[defaults]\nformat = "e4m3"\n[fprop]\nx = {}\nw = {}\n'
  path.write_text("save_quantized_wgrad_input = true\n" + body)
  with pytest.raises(ValueError, match="save_quantized_wgrad_input, but "
                     "Wgrad's x is not quantized"):
    qlayers.recipe(path)
  path.write_text("save_quantized_wgrad_input = false\n" + body)
  assert not qlayers.recipe(path).save_quantized_wgrad_input


def test_numpy_scalar_fields_are_stored_as_python_values():
  # np.int64(16) passed the type check, trained, and then failed the
  # checkpoint's JSON description.
  import numpy as np
  r = qlayers.recipe("fp8_delayed", amax_history_len=np.int64(16))
  assert type(r.amax_history_len) is int and r.amax_history_len == 16
  spec = QuantSpec(margin=np.int64(1), pow2=np.bool_(True))
  assert type(spec.margin) is int and type(spec.pow2) is bool


def test_overrides_a_recipe_would_not_read_are_refused_as_in_a_file():
  # recipe("fp8_current", amax_history_len=16) gave current scaling and no
  # history, where a file setting it is refused.
  with pytest.raises(ValueError, match="only delayed scaling reads"):
    qlayers.recipe("fp8_current", amax_history_len=16)
  with pytest.raises(ValueError, match="quantizes no GEMM"):
    qlayers.recipe("bf16", scaling="delayed")
  r = qlayers.recipe("fp8_delayed", amax_history_len=16)
  assert r.amax_history_len == 16 and r.delayed
  assert qlayers.recipe("fp8_delayed", scaling="current").delayed is False


def test_a_per_tensor_operand_drops_the_defaults_block_size(tmp_path):
  # TOML has no null: the operand could not unset [defaults]' block_size,
  # and its error blamed the operand.
  path = tmp_path / "mixed.toml"
  path.write_text("""
[defaults]
format = "e4m3"
granularity = "tile"
block_size = 64
[fprop]
x = {}
w = { granularity = "tensor" }
[dgrad]
g = {}
w = { granularity = "mx" }
""")
  r = qlayers.recipe(path)
  assert r.fprop.lhs.block_size == 64
  assert r.fprop.rhs.granularity == "tensor"
  assert r.dgrad.rhs.block_size == 32  # MX blocks are 32
