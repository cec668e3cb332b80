"""E2M1 GEMMs on sm_100 at the FP4 rate, checked from this CPU host: NVFP4
operands keep their two scale levels apart, and NVFP4 and MXFP4 reach
cuDNN's NVFP4 GEMM as ``float4_e2m1fn`` payloads with E4M3 scales per 16
(`forms.as_nvfp4`). What cuDNN is given, dequantized as it reads it, is
what the CPU emulation multiplies, bit for bit (MXFP4 blocks more than 2^17
below the largest aside: flushed to zero)."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qlayers
from qlayers import dispatch, forms, partition, scaling
from qlayers.block_scaled_dot import block_scaled_dot

# One compiled program per case (eager ops compile one by one).
quantize = jax.jit(scaling.quantize, static_argnums=(1, 2))
dequantize = jax.jit(lambda q: q.dequantize())
nvfp4_dequantize = jax.jit(lambda q: forms.as_nvfp4(q).dequantize())
as_nvfp4 = jax.jit(forms.as_nvfp4)


def _bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


def _wide_rows(shape, seed, octaves=20):
  """Gaussian rows over 2**-octaves .. 2**octaves, one zero block."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp2(
      rng.integers(-octaves, octaves + 1, (shape[0], 1)))
  x[0, :32] = 0.0
  return jnp.asarray(x, jnp.float32)


@jax.jit
def _as_cudnn_reads(q):
  """The operands `forms._nvfp4_cudnn` passes to ``jax.nn.scaled_matmul``,
  dequantized as cuDNN reads them: E2M1 x E4M3 (per 16) x the tensor scale."""
  n = forms.as_nvfp4(q)
  elems = forms._e2m1(n).astype(jnp.float32)
  block = jnp.repeat(n.block_scale.astype(jnp.float32), 16, axis=1)
  return elems * (block * n.tensor_scale)


def _operands(name, seed):
  """Fprop's x (1 x 16 tiles) and w (16 x 16 blocks; 32-blocks for MX), as
  the plan makes them: contraction-last."""
  r = qlayers.recipe(name)
  x, w = _wide_rows((40, 96), seed), _wide_rows((72, 96), seed + 1)
  return quantize(x, r.fprop.lhs, 1), quantize(w, r.fprop.rhs, 1)


@pytest.mark.parametrize("seed", [0, 1])
def test_nvfp4_levels_apart_multiply_to_the_scale(seed):
  for q in _operands("nvfp4", seed):
    assert q.block_scale.dtype == jnp.float8_e4m3fn and q.tensor_scale.shape == ()
    np.testing.assert_array_equal(
        _bits(q.block_scale.astype(jnp.float32) * q.tensor_scale), _bits(q.scale))
  bad = quantize(jnp.full((2, 16), jnp.inf), qlayers.recipe("nvfp4").fprop.lhs,
                 1)
  assert np.isnan(np.asarray(bad.block_scale, np.float32)).all()


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_cudnn_operands_are_the_emulation_operands_bit_for_bit(name):
  for q in _operands(name, 0):
    want = _bits(dequantize(q))  # what the CPU emulation multiplies
    got = _as_cudnn_reads(q)[:q.shape[0], :q.shape[1]]
    np.testing.assert_array_equal(_bits(got),
                                  _bits(nvfp4_dequantize(q)))
    if name == "mxfp4":  # these rows span 2**40: some blocks are flushed
      codes = np.asarray(q.scale).astype(int)
      keep = np.repeat(codes >= codes.max() - 17, 32, axis=1)[:, :q.shape[1]]
      assert (~keep).any() and keep.any()
      np.testing.assert_array_equal(np.asarray(got)[~keep], 0.0)
      got, want = np.asarray(got)[keep], want[keep]
    np.testing.assert_array_equal(_bits(got), want)


def test_mxfp4_as_nvfp4_exact_flushed_and_nan_blocks():
  spec = qlayers.recipe("mxfp4").fprop.lhs
  x = np.ones((2, 128), np.float32)
  x[0, 32:64] *= 2.0 ** -17   # 17 octaves down: the last exact one
  x[0, 64:96] *= 2.0 ** -18   # one more: flushed to zero
  x[1, :32] = np.nan
  q = quantize(jnp.asarray(x), spec, 1)
  n = as_nvfp4(q)
  e4m3 = np.asarray(n.block_scale, np.float32)
  np.testing.assert_array_equal(e4m3[0], [256.0] * 2 + [2.0 ** -9] * 2
                                + [0.0] * 2 + [256.0] * 2)
  assert np.isnan(e4m3[1, :2]).all() and (e4m3[1, 2:] == 256.0).all()
  got, want = np.asarray(dequantize(n)), np.asarray(dequantize(q))
  np.testing.assert_array_equal(got[0, :64], want[0, :64])
  np.testing.assert_array_equal(got[0, 64:96], 0.0)
  np.testing.assert_array_equal(got[:, 96:], want[:, 96:])


def test_mxfp4_as_nvfp4_scale_codes_are_ml_dtypes_powers_of_two():
  """Every E8M0 code a block can take below the largest, and NaN: each
  block's two E4M3 scales hold ml_dtypes' E4M3 of ``2**(k - c)`` (normal,
  subnormal down to 2**-9), 0 further down, NaN for an Inf/NaN block."""
  spec = qlayers.recipe("mxfp4").fprop.lhs
  octaves = np.arange(0, -24, -1)  # block i holds 2**-i
  x = np.repeat(np.exp2(octaves), 32)[None].astype(np.float32)
  x = np.concatenate([x, np.full((1, 32), np.nan, np.float32)], axis=1)
  q = quantize(jnp.asarray(x), spec, 1)
  codes = np.asarray(q.scale).astype(int)[0]
  top = codes[:-1].max()
  assert list(codes[:-1]) == list(top + octaves) and codes[-1] == 255
  e = codes[:-1] - top + 8
  want = np.where(e >= -9, np.exp2(e.astype(float)), 0.0).astype(
      ml_dtypes.float8_e4m3fn).view(np.uint8)
  got = np.asarray(as_nvfp4(q).block_scale).view(np.uint8)[0]
  np.testing.assert_array_equal(got[:-2], np.repeat(want, 2))
  assert list(want[15:18]) == [4, 2, 1] and (want[18:] == 0).all()  # ends
  assert np.isnan(np.asarray(as_nvfp4(q).block_scale, np.float32)[0, -2:]
                  ).all()


def test_table_needs_the_levels_apart():
  a, b = _operands("nvfp4", 0)
  assert dispatch.choose(a, b, "cuda", "sm_100").form == "nvfp4_cudnn"
  assert dispatch.choose(a, b, "cuda", "sm_90").form == "f32_dequant"
  # Operands rebuilt from payload + scale alone keep the FP32 dequantize.
  bare = [dataclasses.replace(q, block_scale=None, tensor_scale=None)
          for q in (a, b)]
  c = dispatch.choose(*bare, "cuda", "sm_100")
  assert c.form == "f32_dequant" and "payload + scale" in c.why
  ma, mb = _operands("mxfp4", 0)
  c = dispatch.choose(ma, mb, "cuda", "sm_100")
  assert c.form == "nvfp4_cudnn" and "flushed to zero" in c.why
  assert dispatch.choose(ma, mb, "cuda", "sm_90").form == "bf16_dequant"


def _cudnn_call(name, out_dtype):
  """The one block-scaled call the CUDA lowering of the form makes."""
  a, b = _operands(name, 0)
  f = lambda a, b: forms.FORMS["nvfp4_cudnn"](a, b, out_dtype, (1, 1))  # noqa: E731
  text = jax.jit(f).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
  call = [l for l in text.splitlines() if "__op$block_scaled_dot" in l]
  assert len(call) == 1, text
  return call[0], text


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_cudnn_takes_the_tensor_scales_and_writes_the_output_dtype(name):
  """The per-tensor scales' product is the call's fifth operand (cuDNN's
  global scale, in the output's type), so the GEMM writes BF16 itself and
  nothing multiplies its output."""
  call, text = _cudnn_call(name, jnp.bfloat16)
  operands = call.split("->")[0].split(":")[-1]
  assert operands.count("tensor<") == 5 and "tensor<bf16>)" in operands
  assert call.strip().endswith("xbf16>")
  after = text[text.index("__op$block_scaled_dot"):]
  assert "stablehlo.multiply" not in after.split("return")[0]
  call, _ = _cudnn_call(name, jnp.float32)   # Wgrad: FP32 out, FP32 scale
  assert "tensor<f32>)" in call and call.strip().endswith("xf32>")


def test_global_scale_rounds_to_the_output_dtype_once():
  """The call's definition (its lowering off CUDA): the FP32 accumulator of
  the block-scaled operands times the global scale in the output's type,
  rounded once; a BF16 output is within 2**-8 (the scale's rounding) plus
  one rounding of the FP32 one."""
  a, b = _operands("nvfp4", 1)
  qa, qb = as_nvfp4(a), as_nvfp4(b)
  alpha = qa.tensor_scale * qb.tensor_scale
  gemm = jax.jit(lambda a, b, g, dt: block_scaled_dot(  # noqa: E731
      forms._e2m1(a)[None], forms._e2m1(b)[None], a.block_scale[None],
      b.block_scale[None], g, dt)[0], static_argnums=3)
  raw = np.asarray(gemm(qa, qb, jnp.float32(1.0), jnp.float32))
  wide = np.asarray(gemm(qa, qb, alpha, jnp.float32))
  got = np.asarray(gemm(qa, qb, alpha, jnp.bfloat16), np.float32)
  scale = np.float32(jnp.asarray(alpha, jnp.bfloat16).astype(jnp.float32))
  want = np.asarray(jnp.asarray(raw * scale).astype(jnp.bfloat16), np.float32)
  np.testing.assert_array_equal(_bits(got), _bits(want))
  np.testing.assert_array_equal(_bits(wide), _bits(raw * np.float32(alpha)))
  np.testing.assert_allclose(got, wide, rtol=2.0**-7, atol=0)
  assert scale != np.float32(alpha)  # the case the bound is about


def test_mx_call_has_four_operands_and_the_mx_values():
  """Without a global scale (MX) the call has four operands, and off CUDA
  its definition is each payload times its E8M0 block scales, an FP32
  dot, one rounding."""
  e8m0 = jnp.float8_e8m0fnu
  a = jax.random.normal(jax.random.key(0), (1, 8, 64)).astype(
      jnp.float8_e4m3fn)
  b = jax.random.normal(jax.random.key(1), (1, 16, 64)).astype(
      jnp.float8_e5m2)
  sa = jnp.full((1, 8, 2), 2.0**-3, e8m0).at[0, 1, 1].set(2.0**5)
  sb = jnp.full((1, 16, 2), 2.0**4, e8m0)
  f = lambda a, b, sa, sb: block_scaled_dot(a, b, sa, sb, None,  # noqa: E731
                                            jnp.float32)
  text = jax.jit(f).trace(a, b, sa, sb).lower(
      lowering_platforms=("cuda",)).as_text()
  call, = [l for l in text.splitlines() if "__op$block_scaled_dot" in l]
  assert call.split("->")[0].split(":")[-1].count("tensor<") == 4
  wide = lambda x, s: (np.asarray(x, np.float32)  # noqa: E731
                       * np.repeat(np.asarray(s, np.float32), 32, axis=2))
  want = np.einsum("bmk,bnk->bmn", wide(a, sa), wide(b, sb))
  np.testing.assert_allclose(np.asarray(f(a, b, sa, sb)), want, rtol=1e-6)


def test_vmapped_block_scaled_dot_is_the_loop_of_its_calls():
  """jax.vmap (the experts' GEMMs) joins the mapped axis to the batch; a
  mapped global scale is applied after an FP32 GEMM, one rounding, as the
  definition does: the same bits as one call per item."""
  e4m3 = jnp.float8_e4m3fn
  keys = jax.random.split(jax.random.key(0), 4)
  a = jax.random.normal(keys[0], (3, 1, 8, 32)).astype(jnp.float4_e2m1fn)
  b = jax.random.normal(keys[1], (3, 1, 16, 32)).astype(jnp.float4_e2m1fn)
  sa = jnp.abs(jax.random.normal(keys[2], (3, 1, 8, 2))).astype(e4m3)
  sb = jnp.abs(jax.random.normal(keys[3], (1, 16, 2))).astype(e4m3)
  g = jnp.array([0.5, 3.0, 0.1], jnp.float32)
  for dtype in (jnp.bfloat16, jnp.float32):
    f = lambda a, b, sa, g: block_scaled_dot(a, b, sa, sb, g, dtype)  # noqa: E731,B023
    got = jax.vmap(f)(a, b, sa, g)
    want = jnp.stack([f(a[i], b[i], sa[i], g[i]) for i in range(3)])
    np.testing.assert_array_equal(_bits(np.asarray(got, np.float32)),
                                  _bits(np.asarray(want, np.float32)))
  mx = lambda a: block_scaled_dot(a, b[0], sa[0], sb, None, jnp.float32)  # noqa: E731
  np.testing.assert_array_equal(jax.vmap(mx)(a), jnp.stack(
      [mx(a[i]) for i in range(3)]))


def test_block_scaled_dot_names_bad_operands():
  e2m1, e4m3 = jnp.float4_e2m1fn, jnp.float8_e4m3fn
  a, s = jnp.zeros((1, 4, 32), e2m1), jnp.zeros((1, 4, 2), e4m3)
  with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
    block_scaled_dot(a, a, s, s, 1.0, jnp.int32)
  with pytest.raises(ValueError, match=r"\(batch, m, k\)"):
    block_scaled_dot(a[0], a[0], s, s, 1.0, jnp.bfloat16)
  with pytest.raises(ValueError, match="scales"):
    block_scaled_dot(a, a, s[:, :2], s, 1.0, jnp.bfloat16)
  with pytest.raises(ValueError, match="scalar"):
    block_scaled_dot(a, a, s, s, jnp.ones(2), jnp.bfloat16)


def test_partitioned_gemm_carries_the_levels():
  """The local GEMM of the partitioning rule (every GEMM under a mesh) gets
  NVFP4's two scale levels too, so it reaches cuDNN's NVFP4 GEMM."""
  a, b = _operands("nvfp4", 0)
  f = lambda a, b: partition.gemm(a, b, (1, 1), jnp.bfloat16, "default")  # noqa: E731
  with dispatch.target_arch("sm_100"):
    text = jax.jit(f).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
  calls = [l for l in text.splitlines() if "__op$block_scaled_dot" in l]
  assert len(calls) == 1 and "f4E2M1FN" in calls[0]
