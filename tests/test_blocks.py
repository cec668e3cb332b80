"""qlayers.blocks: `amax` and `block_amax` against a NumPy reference (exact
values, NaN anywhere, also as the last of 4096+ elements, -0.0, Inf,
subnormals) and the block grid of each granularity."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qlayers import blocks as B
from qlayers.scaling import QuantSpec

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
# XLA on CPU reads FP32 subnormals as zero in float arithmetic; the float
# stage of its two-stage amax may then return 0 for them.
FTZ = float(jax.jit(lambda v: v * 3.0)(np.float32(1e-40))) == 0.0


def ref_amax(x: np.ndarray, axes=None) -> np.ndarray:
  """max |x| over ``axes`` in FP32, +Inf where there is an Inf or a NaN."""
  a = np.abs(np.asarray(x, np.float32))
  bad = np.isnan(a).any(axis=axes)
  return np.where(bad, np.float32(np.inf), a.max(axis=axes)).astype(np.float32)


def bits(v) -> np.ndarray:
  return np.asarray(v, np.float32).view(np.uint32)


def _values(dtype, n, rng):
  fi = ml_dtypes.finfo(np.dtype(dtype))
  x = rng.standard_normal(n).astype(np.float32) * 3
  return x.astype(np.dtype(dtype)), fi


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 32, 33, 4095, 4096, 4097, 64 * 4096])
def test_nan_anywhere_gives_inf(dtype, n):
  rng = np.random.default_rng(n)
  x, _ = _values(dtype, n, rng)
  f = jax.jit(B.amax)
  np.testing.assert_array_equal(bits(f(jnp.asarray(x))), bits(ref_amax(x)))
  positions = sorted({0, n // 2, n - 1, *rng.integers(0, n, 3).tolist()})
  for pos in positions:
    y = x.copy()
    y[pos] = np.nan if pos % 2 == 0 else -np.nan
    got = float(f(jnp.asarray(y)))
    assert got == np.inf, (n, pos, got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values(dtype):
  fi = ml_dtypes.finfo(np.dtype(dtype))
  sub = float(fi.smallest_subnormal)
  cases = {
      "zeros": [0.0] * 40,
      "neg_zero": [-0.0] * 40,
      "neg_zero_max": [-0.0, 0.0, -0.0],
      "neg_inf": [1.0, -np.inf, 2.0],
      "inf_last": [1.0] * 4999 + [np.inf],
      "max": [float(fi.max), -float(fi.max), 1.0],
      "neg_biggest": [0.5, -3.25, 3.0],
      "tiny": [float(fi.tiny), -sub, 0.0],
      "nan_and_inf": [np.nan, -np.inf, 1.0],
  }
  for name, vals in cases.items():
    x = np.asarray(vals, np.float32).astype(np.dtype(dtype))
    want = ref_amax(x)
    for f in (B.amax, jax.jit(B.amax)):
      got = np.asarray(f(jnp.asarray(x)))
      assert got.dtype == np.float32
      np.testing.assert_array_equal(bits(got), bits(want), err_msg=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [3, 32, 5000])
def test_subnormals(dtype, n):
  """Subnormal-only inputs: the exact max where the platform keeps
  subnormals. On XLA:CPU the float stage (past 32 elements) may read an
  FP32 subnormal (BF16 ones are FP32 subnormals too) as zero, as every FP32
  operation there does; FP16 subnormals are normal in FP32."""
  fi = ml_dtypes.finfo(np.dtype(dtype))
  sub = np.float32(fi.smallest_subnormal)
  x = np.full(n, sub, np.float32)
  x[n // 3] = -5 * sub
  x = x.astype(np.dtype(dtype))
  got = np.float32(jax.jit(B.amax)(jnp.asarray(x)))
  want = ref_amax(x)
  if FTZ and dtype != jnp.float16 and n > 32:
    assert got in (want, 0.0)
  else:
    assert bits(got) == bits(want)


def test_fp8_inputs_widen():
  """FP8 has no Inf (E4M3) or an Inf below its NaNs (E5M2): NaN still maps to
  +Inf, finite values are exact."""
  for dt in (jnp.float8_e4m3fn, jnp.float8_e5m2):
    x = np.asarray([1.5, -448.0 if dt == jnp.float8_e4m3fn else -57344.0, 0.0],
                   np.float32).astype(np.dtype(dt))
    assert float(B.amax(jnp.asarray(x))) == float(ref_amax(x))
    y = x.copy()
    y[1] = np.nan
    assert float(B.amax(jnp.asarray(y))) == np.inf


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block,shape", [((1, 32), (64, 96)), ((1, 128), (8, 512)),
                                         ((128, 128), (256, 384)),
                                         ((1, 96), (16, 96)), ((48, 1), (96, 8))])
def test_block_amax_matches_reference(dtype, block, shape):
  rng = np.random.default_rng(0)
  x, fi = _values(dtype, int(np.prod(shape)), rng)
  x = x.reshape(shape)
  # Special values in some blocks: NaN (first, last, middle), Inf, -0.0.
  x[0, 0] = np.nan
  x[-1, -1] = np.nan
  x[shape[0] // 2, shape[1] // 2] = -np.inf
  x[shape[0] // 2 + 1, 3] = -np.nan
  x[-1, 0] = -float(fi.max)
  gb = [n // b for n, b in zip(shape, block)]
  blocks = x.astype(np.float32).reshape(gb[0], block[0], gb[1], block[1])
  want = ref_amax(blocks, axes=(1, 3))
  got = jax.jit(lambda v: B.block_amax(v, block))(jnp.asarray(x))
  assert got.dtype == x.dtype
  np.testing.assert_array_equal(bits(np.asarray(got, np.float32)), bits(want))
  zero = np.zeros(shape, np.dtype(dtype))
  zero[0, 0] = -0.0
  got0 = jax.jit(lambda v: B.block_amax(v, block))(jnp.asarray(zero))
  np.testing.assert_array_equal(bits(np.asarray(got0, np.float32)), 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axes", [(0, 1), (1,), (0,)])
def test_gpu_branch_of_the_amax_matches_the_cpu_one(monkeypatch, dtype, axes):
  """The branch XLA:GPU runs (one integer max, the NaN clamp before it)
  gives the CPU branch's bits: NaN of either sign as +Inf, -0.0 as 0."""
  rng = np.random.default_rng(3)
  x, _ = _values(dtype, 64 * 96, rng)
  x = x.reshape(64, 96)
  x[1, 2], x[40, 7], x[5, 90] = np.nan, -np.nan, -np.inf
  x[:, 11] = -0.0
  want = jax.jit(lambda v: B._max_magnitude(v, axes))(jnp.asarray(x))  # noqa: SLF001
  monkeypatch.setattr(B.jax.lax, "platform_dependent",
                      lambda *a, default, **_: default(*a))
  got = jax.jit(lambda v: B._max_magnitude(v, axes))(jnp.asarray(x))  # noqa: SLF001
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(bits(np.asarray(got, np.float32)),
                                bits(np.asarray(want, np.float32)))
  np.testing.assert_array_equal(
      bits(np.asarray(got, np.float32)),
      bits(ref_amax(x.astype(np.float32), axes)))


def test_amax_under_transpose_and_grad():
  """Transposed operands (contraction-last layouts) and jvp traces."""
  x = jnp.asarray(np.random.default_rng(1).standard_normal((64, 96)),
                  jnp.bfloat16).at[5, 7].set(-9.5)
  assert float(jax.jit(lambda v: B.amax(v.T))(x)) == 9.5
  _, t = jax.jvp(B.amax, (x,), (x,))
  assert t.dtype == jnp.float32


def test_block_shape_and_padding_per_granularity():
  shape = (300, 200)
  assert B.block_shape(shape, QuantSpec(), 1) is None
  assert B.block_shape(shape, QuantSpec(granularity="row"), 0) == (300, 1)
  assert B.block_shape(shape, QuantSpec(granularity="tile"), 1) == (1, 128)
  assert B.block_shape(shape, QuantSpec(granularity="block"), 0) == (128, 128)
  assert B.padded_shape(shape, (128, 128)) == (384, 256)
  assert B.pad_to(jnp.ones((2, 3)), (2, 8)).tolist() == [[1] * 3 + [0] * 5] * 2
  with pytest.raises(ValueError, match="one of the two trailing dims"):
    B.block_shape((4, 256, 256), QuantSpec(granularity="block"), 0)
  with pytest.raises(ValueError, match="axis -3 out of range"):
    B.normalize_axis(-3, 2)
