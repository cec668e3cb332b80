"""E2M1 GEMMs on sm_100 at the FP4 rate, checked from this CPU host: NVFP4
operands keep their two scale levels apart, and NVFP4 and MXFP4 reach
cuDNN's NVFP4 GEMM as ``float4_e2m1fn`` payloads with E4M3 scales per 16
(`forms.as_nvfp4`). What cuDNN is given, dequantized as it reads it, is
what the CPU emulation multiplies, bit for bit (MXFP4 blocks more than 2^17
below the largest aside: flushed to zero)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qlayers
from qlayers import dispatch, forms, partition, scaling

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


def test_cudnn_output_dtype_nvfp4_f32_mxfp4_its_own():
  """NVFP4's GEMM writes FP32 (its per-tensor scales are arbitrary FP32, one
  rounding after them); MXFP4's writes BF16 directly (powers of two)."""
  def lowered(name):
    a, b = _operands(name, 0)
    f = lambda a, b: forms.FORMS["nvfp4_cudnn"](a, b, jnp.bfloat16, (1, 1))  # noqa: E731
    text = jax.jit(f).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
    call = [l for l in text.splitlines() if "__op$block_scaled_dot" in l]
    assert len(call) == 1, text
    return call[0].split("->")[-1].strip()
  assert lowered("nvfp4").endswith("xf32>")
  assert lowered("mxfp4").endswith("xbf16>")


def test_partitioned_gemm_carries_the_levels():
  """The local GEMM of the partitioning rule (every GEMM under a mesh) gets
  NVFP4's two scale levels too, so it reaches cuDNN's NVFP4 GEMM."""
  a, b = _operands("nvfp4", 0)
  f = lambda a, b: partition.gemm(a, b, (1, 1), jnp.bfloat16, "default")  # noqa: E731
  with dispatch.target_arch("sm_100"):
    text = jax.jit(f).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
  calls = [l for l in text.splitlines() if "__op$block_scaled_dot" in l]
  assert len(calls) == 1 and "f4E2M1FN" in calls[0]
