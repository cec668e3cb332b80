"""Native CPU kernels (ffi/) against NumPy references built on ml_dtypes.

Payloads are random codes of every format, decoded with ml_dtypes; the
references are computed in float64 and the kernels (FP32 accumulation) must
agree within the FP32 summation bound ``K * 2**-23 * (|A| @ |B|^T)`` (plus
bf16 rounding of the output where it applies). Casts are checked bit-exactly.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qlayers import _native

pytestmark = pytest.mark.skipif(
    not _native.available(), reason=_native.unavailable_reason() or "native library missing")

FP8 = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
}
SUBBYTE = {
    "e3m2": (ml_dtypes.float6_e3m2fn, 6),
    "e2m3": (ml_dtypes.float6_e2m3fn, 6),
    "e2m1": (ml_dtypes.float4_e2m1fn, 4),
}


def _np_dtype(fmt):
  return FP8[fmt] if fmt in FP8 else SUBBYTE[fmt][0]


def random_codes(rng, shape, fmt):
  """Uniform random codes of ``fmt`` with NaN/Inf codes excluded."""
  bits = 8 if fmt in FP8 else SUBBYTE[fmt][1]
  codes = rng.integers(0, 1 << bits, size=shape, dtype=np.uint16).astype(np.uint8)
  vals = codes.view(_np_dtype(fmt)).astype(np.float32)
  return np.where(np.isfinite(vals), codes, np.uint8(0)).astype(np.uint8)


def decode(codes, fmt):
  return codes.view(_np_dtype(fmt)).astype(np.float64)


def pack(codes, fmt):
  """Packs along the last axis: fp4 two per byte, fp6 four per three bytes."""
  if fmt in FP8:
    return codes
  c = codes.astype(np.uint32)
  if SUBBYTE[fmt][1] == 4:
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)
  w = c[..., 0::4] | c[..., 1::4] << 6 | c[..., 2::4] << 12 | c[..., 3::4] << 18
  out = np.stack([w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF], axis=-1)
  return out.reshape(*codes.shape[:-1], -1).astype(np.uint8)


def e8m0(codes):
  v = np.ldexp(1.0, codes.astype(np.int64) - 127)
  return np.where(codes == 255, np.nan, v)


def payload_array(codes, fmt):
  """What a caller hands to the kernel: an fp8 array or packed uint8."""
  if fmt in FP8:
    return jnp.asarray(codes.view(FP8[fmt]))
  return jnp.asarray(pack(codes, fmt))


def assert_gemm_close(out, ref, abs_ref, k, out_dtype):
  out = np.asarray(out).astype(np.float64)
  np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
  ok = ~np.isnan(ref)
  tol = (k + 2) * 2.0**-23 * abs_ref + 2.0**-140
  if out_dtype == jnp.bfloat16:
    tol = tol + 2.0**-8 * np.abs(ref)
  err = np.abs(out - ref)
  assert np.all(err[ok] <= tol[ok]), f"max excess {np.max(err[ok] - tol[ok])}"


SHAPES = [(1, 1), (3, 17), (17, 130), (130, 3)]


@pytest.mark.parametrize("fmt", list(FP8) + list(SUBBYTE))
def test_every_code_decodes_exactly(fmt):
  """Row m of A holds code m at k = 0 (zeros elsewhere), B is e_0: OUT[m, 0]
  is the decoded value of code m, exactly, NaN and Inf codes included."""
  n_codes = 256 if fmt in FP8 else 1 << SUBBYTE[fmt][1]
  k = 32
  codes = np.zeros((n_codes, k), np.uint8)
  codes[:, 0] = np.arange(n_codes)
  one = np.zeros((1, k), np.uint8)
  one[0, 0] = np.array(1.0, ml_dtypes.float8_e4m3fn).view(np.uint8)
  b = jnp.asarray(one.view(ml_dtypes.float8_e4m3fn))
  if fmt in FP8:
    out = _native.gemm_fp8_tensor(payload_array(codes, fmt), 1.0, b, 1.0)
  else:
    out = _native.gemm_mx(payload_array(codes, fmt), jnp.full((n_codes, 1), 127, jnp.uint8),
                          b, jnp.full((1, 1), 127, jnp.uint8), a_format=fmt, b_format="e4m3")
  want = np.arange(n_codes, dtype=np.uint8).view(_np_dtype(fmt)).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(out)[:, 0], want)


# ----------------------------------------------------------------------------
# Per-tensor FP8


@pytest.mark.parametrize("m,n", SHAPES)
@pytest.mark.parametrize("fa,fb,k", [("e4m3", "e4m3", 1), ("e4m3", "e5m2", 200),
                                     ("e5m2", "e4m3", 257),
                                     ("e4m3fnuz", "e5m2fnuz", 64)])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_gemm_fp8_tensor(m, n, fa, fb, k, out_dtype):
  rng = np.random.default_rng(m * 1000 + n + k)
  ca, cb = random_codes(rng, (m, k), fa), random_codes(rng, (n, k), fb)
  sa, sb = np.float32(0.375), np.float32(3.0e-3)
  out = _native.gemm_fp8_tensor(payload_array(ca, fa), sa, payload_array(cb, fb),
                                jnp.asarray([sb]), out_dtype=out_dtype)
  assert out.shape == (m, n) and out.dtype == out_dtype
  a, b = decode(ca, fa), decode(cb, fb)
  alpha = float(sa) * float(sb)
  assert_gemm_close(out, (a @ b.T) * alpha, (np.abs(a) @ np.abs(b).T) * alpha, k,
                    out_dtype)


def test_gemm_fp8_tensor_large_blocks():
  """Several K and N cache blocks, and M beyond one row panel."""
  rng = np.random.default_rng(1)
  m, n, k = 150, 2100, 600
  ca, cb = random_codes(rng, (m, k), "e4m3"), random_codes(rng, (n, k), "e4m3")
  out = _native.gemm_fp8_tensor(payload_array(ca, "e4m3"), 1.0,
                                payload_array(cb, "e4m3"), 1.0,
                                out_dtype=jnp.bfloat16)
  a, b = decode(ca, "e4m3"), decode(cb, "e4m3")
  assert_gemm_close(out, a @ b.T, np.abs(a) @ np.abs(b).T, k, jnp.bfloat16)


# ----------------------------------------------------------------------------
# MX


MX_PAIRS = [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e3m2", "e2m3"), ("e2m1", "e2m1"),
            ("e2m1", "e4m3"), ("e2m3", "e5m2"), ("e3m2", "e3m2")]


def mx_reference(ca, sa, fa, cb, sb, fb):
  a = decode(ca, fa) * np.repeat(e8m0(sa), 32, axis=1)
  b = decode(cb, fb) * np.repeat(e8m0(sb), 32, axis=1)
  with np.errstate(invalid="ignore"):
    return a @ b.T, np.abs(a) @ np.abs(b).T


@pytest.mark.parametrize("fa,fb", MX_PAIRS)
@pytest.mark.parametrize("m,n,k", [(1, 3, 32), (17, 130, 96), (130, 17, 320)])
def test_gemm_mx(fa, fb, m, n, k):
  rng = np.random.default_rng(m + 7 * n + k)
  ca, cb = random_codes(rng, (m, k), fa), random_codes(rng, (n, k), fb)
  sa = rng.integers(110, 140, size=(m, k // 32), dtype=np.uint8)
  sb = rng.integers(110, 140, size=(n, k // 32), dtype=np.uint8)
  out_dtype = jnp.bfloat16 if (m + n) % 2 else jnp.float32
  out = _native.gemm_mx(payload_array(ca, fa), jnp.asarray(sa), payload_array(cb, fb),
                        jnp.asarray(sb), a_format=fa, b_format=fb, out_dtype=out_dtype)
  assert out.shape == (m, n) and out.dtype == out_dtype
  ref, abs_ref = mx_reference(ca, sa, fa, cb, sb, fb)
  assert_gemm_close(out, ref, abs_ref, k, out_dtype)


def test_gemm_mx_nan_scales_poison_only_their_rows_and_columns():
  rng = np.random.default_rng(3)
  m, n, k = 9, 11, 128
  ca, cb = random_codes(rng, (m, k), "e4m3"), random_codes(rng, (n, k), "e2m1")
  sa = np.full((m, k // 32), 127, np.uint8)
  sb = np.full((n, k // 32), 120, np.uint8)
  sa[2, 1] = 255
  sb[5, 3] = 255
  out = np.asarray(_native.gemm_mx(payload_array(ca, "e4m3"), jnp.asarray(sa),
                                   payload_array(cb, "e2m1"), jnp.asarray(sb),
                                   a_format="e4m3", b_format="e2m1"))
  nan = np.zeros((m, n), bool)
  nan[2, :] = True
  nan[:, 5] = True
  np.testing.assert_array_equal(np.isnan(out), nan)
  ref, abs_ref = mx_reference(ca, sa, "e4m3", cb, sb, "e2m1")
  assert_gemm_close(out, ref, abs_ref, k, jnp.float32)


def test_gemm_mx_extreme_scales_keep_subnormals():
  """2**-127-scaled A (f32 subnormal values) times 2**100-scaled B."""
  rng = np.random.default_rng(4)
  m, n, k = 5, 6, 64
  ca, cb = random_codes(rng, (m, k), "e4m3"), random_codes(rng, (n, k), "e4m3")
  sa = rng.integers(0, 3, size=(m, k // 32), dtype=np.uint8)      # 2^-127..2^-125
  sb = rng.integers(226, 229, size=(n, k // 32), dtype=np.uint8)  # 2^99..2^101
  out = _native.gemm_mx(payload_array(ca, "e4m3"), jnp.asarray(sa),
                        payload_array(cb, "e4m3"), jnp.asarray(sb),
                        a_format="e4m3", b_format="e4m3")
  ref, abs_ref = mx_reference(ca, sa, "e4m3", cb, sb, "e4m3")
  assert np.max(np.abs(ref)) > 1e-30  # normal range: nothing flushed
  assert_gemm_close(out, ref, abs_ref, k, jnp.float32)


def test_gemm_mx_accepts_uint8_fp8_codes():
  rng = np.random.default_rng(5)
  ca, cb = random_codes(rng, (4, 64), "e5m2"), random_codes(rng, (3, 64), "e4m3")
  s = jnp.full((4, 2), 127, jnp.uint8)
  t = jnp.full((3, 2), 127, jnp.uint8)
  typed = _native.gemm_mx(payload_array(ca, "e5m2"), s, payload_array(cb, "e4m3"), t,
                          a_format="e5m2", b_format="e4m3")
  raw = _native.gemm_mx(jnp.asarray(ca), s, jnp.asarray(cb), t,
                        a_format="e5m2", b_format="e4m3")
  np.testing.assert_array_equal(np.asarray(typed), np.asarray(raw))


# ----------------------------------------------------------------------------
# Blockwise (DeepSeek-V3)


def blockwise_reference(a, sa, ra, b, sb, rb):
  m, k = a.shape
  n = b.shape[0]
  ref = np.zeros((m, n))
  abs_ref = np.zeros((m, n))
  rows, cols = np.arange(m) // ra, np.arange(n) // rb
  for c in range(k // 128):
    sl = slice(128 * c, 128 * (c + 1))
    scale = sa[rows, c][:, None] * sb[cols, c][None, :]
    ref += (a[:, sl] @ b[:, sl].T) * scale
    abs_ref += (np.abs(a[:, sl]) @ np.abs(b[:, sl]).T) * np.abs(scale)
  return ref, abs_ref


@pytest.mark.parametrize("ra,rb", [(1, 128), (1, 1), (128, 128), (128, 1)])
@pytest.mark.parametrize("m,n,k", [(1, 3, 128), (17, 130, 384), (130, 129, 256)])
def test_gemm_blockwise(ra, rb, m, n, k):
  rng = np.random.default_rng(ra + rb + m + n + k)
  fa, fb = "e4m3", ("e5m2" if m == 17 else "e4m3")
  ca, cb = random_codes(rng, (m, k), fa), random_codes(rng, (n, k), fb)
  sa = (rng.uniform(0.5, 2.0, size=(-(-m // ra), k // 128))
        * 2.0 ** rng.integers(-20, 5, size=(-(-m // ra), k // 128))).astype(np.float32)
  sb = (rng.uniform(0.5, 2.0, size=(-(-n // rb), k // 128))
        * 2.0 ** rng.integers(-20, 5, size=(-(-n // rb), k // 128))).astype(np.float32)
  out_dtype = jnp.bfloat16 if ra == rb else jnp.float32
  out = _native.gemm_blockwise(payload_array(ca, fa), jnp.asarray(sa),
                               payload_array(cb, fb), jnp.asarray(sb),
                               a_rows_per_scale=ra, b_rows_per_scale=rb,
                               out_dtype=out_dtype)
  assert out.shape == (m, n) and out.dtype == out_dtype
  ref, abs_ref = blockwise_reference(decode(ca, fa), sa.astype(np.float64), ra,
                                     decode(cb, fb), sb.astype(np.float64), rb)
  assert_gemm_close(out, ref, abs_ref, k, out_dtype)


def test_jit_and_vmap():
  rng = np.random.default_rng(6)
  ca = random_codes(rng, (3, 5, 64), "e4m3")
  cb = random_codes(rng, (7, 64), "e4m3")
  a = jnp.asarray(ca.view(FP8["e4m3"]))
  b = jnp.asarray(cb.view(FP8["e4m3"]))
  f = jax.jit(jax.vmap(lambda x: _native.gemm_fp8_tensor(x, 2.0, b, 0.5)))
  got = np.asarray(f(a))
  for i in range(3):
    np.testing.assert_array_equal(
        got[i], np.asarray(_native.gemm_fp8_tensor(a[i], 2.0, b, 0.5)))


def test_qtensor_adapter():
  rng = np.random.default_rng(7)
  m, n, k = 5, 200, 256  # b is padded to 256 rows by its 128x128 blocks
  ca, cb = random_codes(rng, (m, k), "e4m3"), random_codes(rng, (256, k), "e4m3")
  sa = np.full((m, 2), 0.5, np.float32)
  sb = np.full((2, 2), 4.0, np.float32)
  qa = types.SimpleNamespace(payload=payload_array(ca, "e4m3"), scale=jnp.asarray(sa),
                             format="e4m3", granularity="tile", block=(1, 128), axis=1,
                             shape=(m, k))
  qb = types.SimpleNamespace(payload=payload_array(cb, "e4m3"), scale=jnp.asarray(sb),
                             format="e4m3", granularity="block", block=(128, 128),
                             axis=1, shape=(n, k))
  assert _native.supports(qa, qb)[0]
  out = _native.gemm(qa, qb, out_dtype=jnp.float32)
  assert out.shape == (m, n)
  a, b = decode(ca, "e4m3"), decode(cb, "e4m3")[:n]
  assert_gemm_close(out, (a @ b.T) * 2.0, (np.abs(a) @ np.abs(b).T) * 2.0, k, jnp.float32)
  ok, why = _native.supports(qa, types.SimpleNamespace(**{**vars(qb), "axis": 0}))
  assert not ok and "contraction-last" in why


@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_gemms_with_lower_isa_kernels(isa):
  """The AVX2 and portable micro-kernels give the same results as references."""
  if not _native._force_cpu_isa(isa):
    pytest.skip(f"this CPU lacks {isa}")
  try:
    assert f"isa={isa}" in _native.build_info()["details"]["cpu"]["info"]
    for out_dtype in (jnp.float32, jnp.bfloat16):
      test_gemm_fp8_tensor(17, 130, "e4m3", "e5m2", 200, out_dtype)
      test_gemm_fp8_tensor(130, 3, "e5m2", "e4m3", 257, out_dtype)
    test_gemm_mx("e2m1", "e4m3", 130, 17, 320)
    test_gemm_mx("e3m2", "e2m3", 17, 130, 96)
    test_gemm_blockwise(1, 128, 130, 129, 256)
    test_gemm_blockwise(128, 1, 17, 130, 384)
    test_gemm_fp8_tensor_large_blocks()
  finally:
    _native._force_cpu_isa(None)


def test_build_info():
  info = _native.build_info()
  assert info["cpu"] is True
  assert "isa=" in info["details"]["cpu"]["info"]
  assert set(info) >= {"cpu", "cuda", "rocm"}


def test_missing_library_is_reported_not_raised(tmp_path):
  # A copy of the module alone in a folder, loaded by path (an editable
  # install's import hook would otherwise hand back the real package).
  copy = tmp_path / "lonely" / "_native.py"
  copy.parent.mkdir()
  shutil.copy(pathlib.Path(_native.__file__), copy)
  env = dict(os.environ)
  code = ("import importlib.util as u; "
          f"s = u.spec_from_file_location('lonely_native', {str(copy)!r}); "
          "n = u.module_from_spec(s); s.loader.exec_module(n); "
          "print(n.available(), n.build_info()['cpu'], "
          "'build_inplace' in n.unavailable_reason())")
  res = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                       capture_output=True, text=True, check=True, timeout=120)
  assert res.stdout.split() == ["False", "False", "True"]
