"""Operands rewritten for a GPU route are the same values, bit for bit.

DeepSeek-V3 tiles/blocks with UE8M0 scales become MXFP8 operands of cuDNN's
block-scaled GEMM on sm_100 (`forms.as_mx`), FP6/FP4 payloads are widened to
E4M3 for it, and OCP FP8 payloads become FNUZ on gfx942 (`forms.to_fnuz`).
The sm_100 forms run here as they are: `qlayers.block_scaled_dot` lowers to
its definition off CUDA.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qlayers
from qlayers import formats
from qlayers import forms
from qlayers import scaling as S

TILE = S.QuantSpec(granularity="tile", scale_rule="deepseek", pow2=True)
BLOCK = S.QuantSpec(granularity="block", scale_rule="deepseek", pow2=True)


def _bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


def _operands(m, k, n):
  x = jax.random.normal(jax.random.key(0), (m, k)) * 3
  w = jax.random.normal(jax.random.key(1), (k, n)) * 1e-3
  g = jax.random.normal(jax.random.key(2), (m, n)) * 1e-6
  # (Fprop, Dgrad, Wgrad) of x (m, k) @ w (k, n), as the recipe quantizes.
  return (((S.quantize(x, TILE, 1), S.quantize(w, BLOCK, 0)), (1, 0)),
          ((S.quantize(g, TILE, 1), S.quantize(w, BLOCK, 1)), (1, 1)),
          ((S.quantize(x, TILE, 0), S.quantize(g, TILE, 0)), (0, 0)))


def test_mx_operands_dequantize_to_the_tile_and_block_values():
  @jax.jit
  def pairs():  # every operand of the recipe's GEMMs, shapes not whole tiles
    return [(forms.as_mx(q), forms.as_mx(q).dequantize(),
             forms.contraction_last(q).dequantize())
            for (a, b), _ in _operands(100, 200, 72) for q in (a, b)]
  for mx, got, want in pairs():
    assert mx.granularity == "mx" and mx.axis == 1
    assert mx.scale.dtype == jnp.uint8 and mx.payload.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_mx_codes_are_the_scale_exponents_and_nan_stays_nan():
  x = jnp.ones((2, 256)).at[0, 0].set(jnp.inf).at[1, 200].set(1e-9)
  mx = jax.jit(lambda x: forms.as_mx(S.quantize(x, TILE, 1)))(x)
  # Row 0, tile 0 holds Inf: NaN scale -> E8M0 NaN code 0xFF, four times.
  assert mx.scale[0, :4].tolist() == [255] * 4
  # Row 1: amax 1 -> 2**ceil(log2(1 / 448)) = 2**-8 (code 119) in both tiles.
  assert mx.scale[1].tolist() == [119] * 8
  with pytest.raises(ValueError, match="FP8 tile/block"):
    forms.as_mx(S.quantize(x, S.QuantSpec(granularity="mx"), 1))


def test_cudnn_route_equals_the_emulation_bit_for_bit():
  """Every GEMM of the recipe through the sm_100 form equals the CPU
  emulation bit for bit (whole tiles: the same sum order), in FP32 and BF16
  outputs."""

  @jax.jit
  def products():
    return [(forms.FORMS["ue8m0_cudnn"](a, b, out, axes),
             forms.FORMS["f32_emulation"](a, b, out, axes))
            for (a, b), axes in _operands(128, 256, 128)
            for out in (jnp.float32, jnp.bfloat16)]
  for got, want in products():
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_recipe_scales_are_powers_of_two():
  r = qlayers.recipe("deepseek_v3_ue8m0")
  specs = (r.fprop.lhs, r.fprop.rhs, r.dgrad.lhs, r.dgrad.rhs, r.wgrad.lhs,
           r.wgrad.rhs)
  assert all(s.pow2 and s.scale_rule == "deepseek" and s.format == "e4m3"
             for s in specs)
  assert [s.granularity for s in specs] == ["tile", "block", "tile", "block",
                                            "tile", "tile"]


@pytest.mark.parametrize("fmt", ["e2m1", "e2m3", "e3m2"])
def test_widened_mx_payload_is_exact(fmt):
  """FP6/FP4 payloads widened to E4M3 for cuDNN keep every value; the GEMM
  of the widened operands is the FP32 emulation's, bit for bit."""
  spec = S.QuantSpec(format=fmt, granularity="mx")
  codes = jnp.arange(2 ** spec.fmt.bits, dtype=jnp.uint8)
  values = formats.decode(codes, spec.fmt)
  wide = jax.jit(lambda codes: S.widened(S.QTensor(
      formats.pack(codes[None], spec.fmt), jnp.zeros((1, 1), jnp.uint8),
      fmt, "mx", (1, 32), 1, (1, codes.size))).payload)(codes)
  assert wide.dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(_bits(wide[0].astype(jnp.float32)),
                                _bits(values))

  @jax.jit
  def products(x, w):
    a, b = S.quantize(x, spec, 1), S.quantize(w, spec, 1)
    wa, wb = S.widened(a), S.widened(b)  # as the GPU pair kernels make them
    return (forms.FORMS["mx_cudnn"](a, b, jnp.float32, (1, 1)),
            forms.FORMS["mx_cudnn"](wa, wb, jnp.float32, (1, 1)),
            forms.FORMS["f32_emulation"](wa, wb, jnp.float32, (1, 1)),
            forms.FORMS["f32_emulation"](a, b, jnp.float32, (1, 1)))
  *got, want = products(jax.random.normal(jax.random.key(0), (64, 96)),
                        jax.random.normal(jax.random.key(1), (40, 96)))
  for g in got:
    np.testing.assert_array_equal(_bits(g), _bits(want))


@pytest.mark.parametrize("fmt,dtype", [("e4m3", ml_dtypes.float8_e4m3fn),
                                       ("e5m2", ml_dtypes.float8_e5m2)])
def test_fnuz_copy_keeps_every_value(fmt, dtype):
  values = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
  values = values[np.isfinite(values)]
  q = S.QTensor(jnp.asarray(values.astype(dtype)), jnp.float32(3.0), fmt,
                "tensor", None, 0, values.shape)
  f = forms.to_fnuz(q)
  assert f.format == fmt + "fnuz"
  assert f.payload.dtype == formats.get_format(fmt + "fnuz").dtype
  np.testing.assert_array_equal(np.asarray(f.dequantize()), values * 3)
  assert forms.to_fnuz(f) is f


def test_partitioned_local_gemm_keeps_the_ue8m0_route():
  """Under a mesh each device runs the local GEMM registered for the plan:
  the ``_pow2`` one keeps cuDNN on sm_100, the plain one cannot tell."""
  from qlayers import dispatch, partition  # pylint: disable=g-import-not-at-top
  a, b = S.quantize(jnp.ones((128, 256)), TILE, 1), S.quantize(
      jnp.ones((256, 128)), BLOCK, 0)

  def lowered(local):
    f = lambda a, b: partition._LOCAL[local](a, b, (1, 0), jnp.float32)  # noqa: E731  pylint: disable=protected-access
    with dispatch.target_arch("sm_100"):
      return jax.jit(f).trace(a, b).lower(lowering_platforms=("cuda",)
                                          ).as_text()
  assert "__op$block_scaled_dot" in lowered("default_pow2")
  assert "__op$block_scaled_dot" not in lowered("default")
  assert dispatch._local_name(None, True) == "default_pow2"  # pylint: disable=protected-access
