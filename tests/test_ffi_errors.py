"""The native handlers reject bad operands with clear errors, never by
reading out of bounds. The FFI targets are called directly (bypassing the
Python wrappers' own checks) so the C++ validation is what is tested."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qlayers import _native
from qlayers import scaling

pytestmark = pytest.mark.skipif(
    not _native.available(), reason=_native.unavailable_reason() or "native library missing")

F8 = jnp.float8_e4m3fn
F32 = jnp.float32


def z(shape, dtype):
  return jnp.zeros(shape, dtype)


def out(shape, dtype=F32):
  return jax.ShapeDtypeStruct(shape, dtype)


def call(target, outs, *args, **attrs):
  return jax.ffi.ffi_call(target, outs)(*args, **attrs)


def raises(match):
  # JaxRuntimeError (jax >= 0.4.36) derives from RuntimeError.
  return pytest.raises(getattr(jax.errors, "JaxRuntimeError", RuntimeError), match=match)


S = jnp.ones((), F32)

TENSOR_CASES = [
    # (a, a_scale, b, b_scale, out, message)
    (z((4, 32), F32), S, z((5, 32), F8), S, out((4, 5)), "a must be an fp8 array"),
    (z((4, 32), F8), S, z((5, 16), F8), S, out((4, 5)), "contraction sizes differ"),
    (z((2, 4, 32), F8), S, z((5, 32), F8), S, out((4, 5)), "a must be rank 2"),
    (z((4, 32), F8), jnp.ones((2,), F32), z((5, 32), F8), S, out((4, 5)),
     r"a_scale must have shape \(\) or \(1,\)"),
    (z((4, 32), F8), S, z((5, 32), F8), jnp.ones((), jnp.float16), out((4, 5)),
     "b_scale must be float32"),
    (z((4, 32), F8), S, z((5, 32), F8), S, out((5, 4)), r"output must have shape \(4, 5\)"),
    (z((4, 32), F8), S, z((5, 32), F8), S, out((4, 5), jnp.float16),
     "output must be float32 or bfloat16"),
]


@pytest.mark.parametrize("a,sa,b,sb,o,msg", TENSOR_CASES)
def test_gemm_fp8_tensor_errors(a, sa, b, sb, o, msg):
  with raises(msg):
    call("qlayers_gemm_fp8_tensor", o, a, sa, b, sb)


U8 = jnp.uint8
MX_CASES = [
    # (a, a_scales, b, b_scales, a_format, b_format, message)
    (z((4, 64), F8), z((4, 2), U8), z((3, 64), F8), z((3, 2), U8), "e9m9", "e4m3",
     "a_format must be one of"),
    (z((4, 64), F8), z((4, 2), U8), z((3, 64), F8), z((3, 2), U8), "e4m3", "e4m3fnuz",
     "b_format must be one of"),
    (z((4, 64), F8), z((4, 2), F32), z((3, 64), F8), z((3, 2), U8), "e4m3", "e4m3",
     "a_scales must hold E8M0 codes"),
    (z((4, 64), F8), z((4, 2), U8), z((3, 64), F8), z((3, 3), U8), "e4m3", "e4m3",
     "disagree on K / 32"),
    (z((4, 64), F8), z((5, 2), U8), z((3, 64), F8), z((3, 2), U8), "e4m3", "e4m3",
     r"a \(e4m3, K = 64 from the scales\) must have shape \(5, 64\)"),
    (z((4, 64), jnp.float8_e5m2), z((4, 2), U8), z((3, 64), F8), z((3, 2), U8), "e4m3",
     "e4m3", "a has format e4m3 and must be float8_e4m3fn"),
    (z((4, 64), F8), z((4, 2), U8), z((3, 33), U8), z((3, 2), U8), "e4m3", "e2m1",
     r"b \(e2m1, K = 64 from the scales\) must have shape \(3, 32\)"),
    (z((4, 64), U8), z((4, 2), U8), z((3, 48), U8), z((3, 2), U8), "e3m2", "e2m3",
     r"a \(e3m2, K = 64 from the scales\) must have shape \(4, 48\)"),
    (z((4, 48), F8), z((4, 2), U8), z((3, 48), U8), z((3, 2), U8), "e3m2", "e2m3",
     "a has format e3m2 and must be packed uint8"),
]


@pytest.mark.parametrize("a,sa,b,sb,fa,fb,msg", MX_CASES)
def test_gemm_mx_errors(a, sa, b, sb, fa, fb, msg):
  with raises(msg):
    call("qlayers_gemm_mx", out((a.shape[0], b.shape[0])), a, sa, b, sb,
         a_format=fa, b_format=fb)


def _bw(a, sa, b, sb, ra=1, rb=128, o=None):
  o = o or out((a.shape[0], b.shape[0]))
  return call("qlayers_gemm_blockwise", o, a, sa, b, sb,
              a_rows_per_scale=np.int64(ra), b_rows_per_scale=np.int64(rb))


def test_gemm_blockwise_errors():
  a, b = z((3, 256), F8), z((130, 256), F8)
  sa, sb = z((3, 2), F32), z((2, 2), F32)
  _bw(a, sa, b, sb)  # the valid call
  with raises("a_rows_per_scale must be 1"):
    _bw(a, sa, b, sb, ra=64)
  with raises("must be a multiple of 128"):
    _bw(z((3, 200), F8), sa, z((130, 200), F8), sb)
  with raises(r"b_scales must have shape \(2, 2\)"):
    _bw(a, sa, b, z((1, 2), F32))
  with raises(r"a_scales must have shape \(3, 2\)"):
    _bw(a, z((3, 1), F32), b, sb)
  with raises("a_scales must be float32"):
    _bw(a, z((3, 2), jnp.bfloat16), b, sb)
  with raises(r"b_scales must have shape \(130, 2\)"):
    _bw(a, sa, b, sb, rb=1)
  with raises("b must be an fp8 array"):
    _bw(a, sa, z((130, 256), U8), sb)


def test_wrapper_errors():
  a = z((4, 64), F8)
  with pytest.raises(ValueError, match="out_dtype"):
    _native.gemm_fp8_tensor(a, 1.0, a, 1.0, out_dtype=jnp.float16)
  with pytest.raises(ValueError, match="a_format"):
    _native.gemm_mx(a, z((4, 2), U8), a, z((4, 2), U8), a_format="fp8", b_format="e4m3")
  with pytest.raises(ValueError, match="2-D"):
    _native.gemm_blockwise(z((2, 4, 128), F8), z((8, 1), F32), a, z((1, 1), F32))


def test_loading_another_library_after_first_use_says_so(tmp_path):
  # It replaced the loaded state with a duplicate-registration failure, and
  # every forced ffi GEMM then said to reinstall the package.
  if not _native.available():
    pytest.skip("libqlayers_cpu.so not built")
  other = tmp_path / "libqlayers_cpu.so"
  other.write_bytes(pathlib.Path(
      _native.build_info()["details"]["cpu"]["path"]).read_bytes())
  with pytest.raises(RuntimeError, match="registered already"):
    _native.load(tmp_path)
  assert _native.available()
  spec = scaling.QuantSpec(format="e4m3", granularity="row")
  a = scaling.quantize(jnp.ones((4, 32)), spec, 1)
  ok, why = _native.supports(a, a, "cpu")
  assert not ok and "has no row-wise fp8 kernel" in why
