"""Element formats against ml_dtypes: every code, rounding, saturation,
packing (also against the NumPy reference, tests/_support/reference_numpy.py)."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from _support import reference_numpy as ref
from qlayers import formats as F

ALL = [F.E4M3, F.E5M2, F.E4M3FNUZ, F.E5M2FNUZ, F.E3M2, F.E2M3, F.E2M1]
PACKED = [F.E3M2, F.E2M3, F.E2M1]


def _codes(fmt):
  codes = np.arange(1 << fmt.bits, dtype=np.uint8)
  return codes, codes.view(fmt.np_dtype).astype(np.float32)


def _reference_cast(x, fmt):
  """ml_dtypes cast after saturation, as uint8 codes."""
  x = np.clip(np.asarray(x, np.float32), -fmt.max, fmt.max)
  return x.astype(fmt.np_dtype).view(np.uint8)


def _our_codes(x, fmt):
  out = F.cast(jnp.asarray(x, jnp.float32), fmt)
  if fmt.packed:
    return np.asarray(out)
  return np.asarray(jax.lax.bitcast_convert_type(out, jnp.uint8))


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_format_constants_match_ml_dtypes(fmt):
  fi = ml_dtypes.finfo(fmt.np_dtype)
  assert fmt.max == float(fi.max)
  assert fmt.min_normal == float(fi.smallest_normal)
  assert fmt.min_subnormal == float(fi.smallest_subnormal)
  assert fmt.bits == fi.bits
  assert fmt.mbits == fi.nmant


def test_named_constants():
  assert (F.E4M3.max, F.E5M2.max, F.E3M2.max, F.E2M3.max, F.E2M1.max) == (
      448.0, 57344.0, 28.0, 7.5, 6.0)
  assert F.E4M3FNUZ.max == 240.0 and F.E5M2FNUZ.max == 57344.0
  # OCP MX v1.0 emax_elem.
  assert [f.emax for f in (F.E4M3, F.E5M2, F.E3M2, F.E2M3, F.E2M1)] == [
      8, 15, 4, 2, 2]
  assert F.get_format("float8_e4m3fn") is F.E4M3
  with pytest.raises(ValueError, match="Unknown element format"):
    F.get_format("e9m9")


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_every_code_round_trips(fmt):
  codes, values = _codes(fmt)
  finite = np.isfinite(values)
  ours = _our_codes(values[finite], fmt)
  ref = _reference_cast(values[finite], fmt)
  # -0 and +0 both decode to 0; compare values for zeros, codes otherwise.
  nz = values[finite] != 0
  np.testing.assert_array_equal(ours[nz], codes[finite][nz])
  np.testing.assert_array_equal(ours, ref)
  if fmt.packed:
    np.testing.assert_array_equal(
        np.asarray(F.decode(jnp.asarray(codes), fmt)), values)


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_random_values_match_ml_dtypes(fmt):
  rng = np.random.default_rng(0)
  x = np.concatenate([
      rng.standard_normal(4000) * fmt.max / 4,
      rng.standard_normal(4000) * fmt.min_normal * 4,  # subnormal range
      rng.uniform(-2 * fmt.max, 2 * fmt.max, 2000),  # saturation
  ]).astype(np.float32)
  np.testing.assert_array_equal(_our_codes(x, fmt), _reference_cast(x, fmt))


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_midpoints_round_to_even(fmt):
  _, values = _codes(fmt)
  pos = np.unique(values[np.isfinite(values) & (values >= 0)])
  mids = (pos[:-1] + pos[1:]) / 2  # exact in float32
  ours = np.asarray(F.round_to_format(jnp.asarray(mids), fmt))
  ref = mids.astype(fmt.np_dtype).astype(np.float32)
  np.testing.assert_array_equal(ours, ref)
  # Ties go to the neighbour with an even mantissa (its code is even).
  codes = _our_codes(mids, fmt) & ((1 << (fmt.bits - 1)) - 1)
  assert np.all(codes % 2 == 0)


def test_specific_rne_and_subnormal_cases():
  e4 = F.E4M3
  r = lambda v, f=e4: float(F.round_to_format(jnp.float32(v), f))
  assert r(1.0625) == 1.0  # tie -> even mantissa 000
  assert r(1.1875) == 1.25  # tie -> even mantissa 010
  assert r(2.0**-9) == 2.0**-9  # smallest subnormal
  assert r(2.0**-10) == 0.0  # half of it ties to zero (even)
  assert r(1.5 * 2.0**-10) == 2.0**-9
  assert r(-3 * 2.0**-10) == -2 * 2.0**-9
  assert r(0.5, F.E2M1) == 0.5 and r(0.25, F.E2M1) == 0.0
  assert r(2.5, F.E2M1) == 2.0 and r(3.5, F.E2M1) == 4.0 and r(5.0, F.E2M1) == 4.0


def test_saturation_never_gives_nan_or_inf():
  x = jnp.array([1e6, -1e6, jnp.inf, -jnp.inf, 449.0, 500.0], jnp.float32)
  e4 = F.cast(x, F.E4M3).astype(jnp.float32)
  np.testing.assert_array_equal(e4, [448, -448, 448, -448, 448, 448])
  e5 = F.cast(x * 100, F.E5M2).astype(jnp.float32)
  np.testing.assert_array_equal(e5[:4], [57344, -57344, 57344, -57344])
  # Without saturation XLA gives NaN for E4M3 overflow: the reason we clip.
  assert np.isnan(float(jnp.float32(1e6).astype(jnp.float8_e4m3fn)))
  fnuz = F.cast(x, F.E4M3FNUZ).astype(jnp.float32)
  np.testing.assert_array_equal(fnuz[:2], [240, -240])
  for fmt in PACKED:
    v = F.decode(F.cast(x, fmt), fmt)
    np.testing.assert_array_equal(np.abs(v), fmt.max)


def test_nan_stays_nan_in_fp8():
  x = jnp.array([jnp.nan, 1.0], jnp.float32)
  assert np.isnan(float(F.cast(x, F.E4M3)[0].astype(jnp.float32)))
  assert np.isnan(float(F.cast(x, F.E5M2)[0].astype(jnp.float32)))


@pytest.mark.parametrize("fmt", [F.E4M3, F.E5M2, F.E2M1, F.E3M2],
                         ids=lambda f: f.name)
def test_stochastic_rounding_is_unbiased_and_local(fmt):
  x = jnp.full((200_000,), 1.03 if fmt.bits > 4 else 1.2, jnp.float32)
  x0 = float(x[0])
  ulp = float(F._ulp(x[0], fmt))
  lo = np.floor(x0 / ulp) * ulp
  out = np.asarray(F.round_to_format(x, fmt, key=jax.random.key(0)))
  assert set(np.unique(out).tolist()) == {lo, lo + ulp}  # only neighbours
  assert abs(out.mean() - float(x[0])) < 2e-3
  # Different keys give different patterns; the same key repeats exactly.
  again = np.asarray(F.round_to_format(x, fmt, key=jax.random.key(0)))
  other = np.asarray(F.round_to_format(x, fmt, key=jax.random.key(1)))
  np.testing.assert_array_equal(out, again)
  assert not np.array_equal(out, other)


def test_stochastic_rounding_saturates():
  x = jnp.array([447.9, 1e9, -1e9], jnp.float32)
  out = F.round_to_format(x, F.E4M3, key=jax.random.key(3))
  assert float(jnp.max(jnp.abs(out))) == 448.0


def test_e8m0_limits():
  codes = np.arange(256, dtype=np.uint8)
  ref = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
  ours = np.ldexp(1.0, codes.astype(np.int64) - 127)
  np.testing.assert_array_equal(ours[:255], ref[:255])
  assert np.isnan(ref[255])
  assert F.E8M0.max == 2.0**127 and F.E8M0.min_normal == 2.0**-127
  assert not F.E8M0.signed and F.E8M0.bits == 8


@pytest.mark.parametrize("fmt", PACKED, ids=lambda f: f.name)
def test_pack_round_trip_random_codes(fmt):
  rng = np.random.default_rng(1)
  codes = rng.integers(0, 1 << fmt.bits, size=(7, 96), dtype=np.uint8)
  packed = F.pack(jnp.asarray(codes), fmt)
  assert packed.dtype == jnp.uint8
  assert packed.shape == (7, F.packed_size(96, fmt))
  np.testing.assert_array_equal(np.asarray(F.unpack(packed, fmt)), codes)


def test_pack_bit_layout():
  fp4 = F.pack(jnp.array([[0x1, 0x2, 0xF, 0x0]], jnp.uint8), F.E2M1)
  np.testing.assert_array_equal(np.asarray(fp4), [[0x21, 0x0F]])
  v = [0x01, 0x02, 0x03, 0x3F]
  word = v[0] | v[1] << 6 | v[2] << 12 | v[3] << 18
  fp6 = F.pack(jnp.array([v], jnp.uint8), F.E3M2)
  np.testing.assert_array_equal(
      np.asarray(fp6), [[word & 0xFF, (word >> 8) & 0xFF, word >> 16]])


@pytest.mark.parametrize("fmt", PACKED, ids=lambda f: f.name)
def test_unpack_reads_every_byte_group(fmt):
  # Every packed group (all 2**24 byte triples for FP6): element i is bits
  # [bits * i, bits * (i + 1)) of the group's little-endian word, as
  # `pack` writes it. unpack was rewritten for GPU fusion; this pins it.
  elems, nbytes = F._group(fmt)  # pylint: disable=protected-access
  word = np.arange(1 << (8 * nbytes), dtype=np.uint32)
  groups = np.stack([(word >> (8 * j)) & 0xFF for j in range(nbytes)], -1)
  rows = groups.astype(np.uint8).reshape(-1, nbytes * 256)
  got = np.asarray(jax.jit(lambda p: F.unpack(p, fmt))(jnp.asarray(rows)))
  want = np.stack([(word >> (fmt.bits * i)) & ((1 << fmt.bits) - 1)
                   for i in range(elems)], -1).astype(np.uint8)
  np.testing.assert_array_equal(got.reshape(want.shape), want)


def test_pack_rejects_bad_lengths():
  with pytest.raises(ValueError, match="multiple of 2"):
    F.pack(jnp.zeros((3,), jnp.uint8), F.E2M1)
  with pytest.raises(ValueError, match="multiple of 4"):
    F.pack(jnp.zeros((6,), jnp.uint8), F.E2M3)
  with pytest.raises(TypeError, match="uint8"):
    F.unpack(jnp.zeros((3,), jnp.int32), F.E2M3)


@functools.cache
def _pack_fns(fmt):
  return (jax.jit(lambda c: F.pack(c, fmt)),
          jax.jit(lambda p: F.unpack(p, fmt)))


@settings(max_examples=25, deadline=None, database=None, derandomize=True)
@given(st.sampled_from(["e2m1", "e3m2", "e2m3"]), st.integers(0, 2**31 - 1))
def test_pack_matches_reference_and_round_trips(fmt, seed):
  codes = np.random.default_rng(seed).integers(
      0, 1 << ref.BITS[fmt], (3, 2, 24)).astype(np.uint8)
  pack, unpack = _pack_fns(fmt)
  packed = np.asarray(pack(codes))
  np.testing.assert_array_equal(packed, ref.pack(codes, fmt))
  np.testing.assert_array_equal(np.asarray(unpack(packed)), codes)


def _edge_values():
  """Every FP32 class at each format's scale: ties, -0, subnormals, huge,
  Inf, NaN, random bit patterns and normals over a wide range."""
  rng = np.random.default_rng(0)
  return np.concatenate([
      np.arange(-8.0, 8.0, 1 / 64, dtype=np.float32),
      np.float32([-0.0, 0.0, 1e-40, -1e-45, 2**22 + 0.5, 1e30, -np.inf,
                  np.inf, np.nan, 0.49999997, 1.5000001, 447.99, 449.0,
                  57344.0, 5.0, 0.25, 0.75, -0.25]),
      rng.integers(0, 2**32, 20_000, dtype=np.uint64).astype(
          np.uint32).view(np.float32),
      (rng.standard_normal(20_000) * np.exp(rng.uniform(-20, 20, 20_000))
       ).astype(np.float32)])


@pytest.mark.parametrize("fmt", ["e2m1", "e3m2", "e2m3", "e4m3", "e5m2"])
def test_integer_rounding_is_round_half_even_bit_for_bit(fmt):
  """round_on_grid's integer steps equal ml_dtypes' round to nearest even
  (after saturation) for every class of input, and grid_codes equal the
  codes of those values."""
  f = F.get_format(fmt)
  y = _edge_values()
  for scale in (1.0, 2.0**-6, 2.0**-12):
    with np.errstate(invalid="ignore"):  # the random bits' signalling NaNs
      v = y * np.float32(scale)
    got = np.asarray(jax.jit(lambda a: F.round_on_grid(a, f))(v))
    sat = np.clip(v, -f.max, f.max)
    want = sat.astype(f.np_dtype).astype(np.float32)
    finite = ~np.isnan(v)
    np.testing.assert_array_equal(got.view(np.uint32)[finite],
                                  want.view(np.uint32)[finite])
    assert np.isnan(got[~finite]).all()
    if f.packed:
      codes = np.asarray(jax.jit(lambda a: F.grid_codes(a, f))(v))
      np.testing.assert_array_equal(codes, np.asarray(
          F.encode(jnp.asarray(got), f)))


@pytest.mark.parametrize("fmt", ["e2m1", "e3m2", "e4m3", "e5m2"])
def test_stochastic_rounding_is_the_exact_floor_of_magnitude_plus_byte(fmt):
  """With random bytes b, |x| rounds to floor(|x| / step + (2b + 1) / 512)
  steps, exactly (in float64 here), its sign kept."""
  f = F.get_format(fmt)
  y = _edge_values()
  y = y[np.isfinite(y)] * np.float32(2.0**-4)  # ties and subnormals too
  r = np.random.default_rng(1).integers(0, 256, y.shape).astype(np.uint32)
  got = np.asarray(jax.jit(lambda a, b: F.round_on_grid(a, f, b))(y, r))
  a = np.abs(np.clip(y.astype(np.float64), -f.max, f.max))
  e = np.maximum(np.floor(np.log2(np.where(a == 0, 1.0, a))), f.emin)
  step = 2.0 ** (e - f.mbits)
  want = np.copysign(np.floor(a / step + (2 * r + 1) / 512.0) * step, y)
  np.testing.assert_array_equal(got.astype(np.float64), want)
  np.testing.assert_array_equal(np.signbit(got), np.signbit(y))
  if f.packed:
    codes = np.asarray(jax.jit(lambda a, b: F.grid_codes(a, f, b))(y, r))
    np.testing.assert_array_equal(codes, np.asarray(
        F.encode(jnp.asarray(got), f)))
    # A kernel's route for finite values (its own truncation, no NaN
    # test): the same codes; the truncation it is given is the one used.
    def kernel_codes(truncate):
      return np.asarray(jax.jit(lambda a, b: F.grid_codes(
          a, f, b, truncate=truncate, nan=False))(y, r))
    np.testing.assert_array_equal(kernel_codes(
        lambda v: jnp.trunc(v).astype(jnp.int32).astype(jnp.uint32)), codes)
    assert (kernel_codes(lambda v: (v + 512).astype(jnp.uint32))
            != codes).any()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz",
                                 "e8m0"])
def test_encode_of_fp8_and_e8m0_is_ml_dtypes_code(fmt):
  """NaN, +-Inf and FNUZ's zeros (no -0: its 0x80 is NaN) encode as ml_dtypes
  does, through every element function that gives codes or values."""
  f = F.get_format(fmt)
  x = np.array([np.nan, np.inf, -np.inf, 1.0, 2.0], np.float32)
  if fmt != "e8m0":
    x = np.concatenate([x, [-0.0, 0.0, -1e-5, 1e-5]]).astype(np.float32)
  want = x.astype(f.np_dtype).view(np.uint8)
  got = np.asarray(F.encode(jnp.asarray(x), fmt))
  np.testing.assert_array_equal(got, want)
  if fmt.endswith("fnuz"):
    tiny = x[-4:]
    r = np.asarray(F.round_to_format(jnp.asarray(tiny), fmt))
    assert not np.signbit(r[r == 0]).any()
    np.testing.assert_array_equal(F.grid_codes(jnp.asarray(tiny), f),
                                  tiny.astype(f.np_dtype).view(np.uint8))


def test_scale_format_and_non_codes_are_refused():
  for fn in (F.round_to_format, F.cast):
    with pytest.raises(ValueError, match="E8M0 holds scales"):
      fn(jnp.ones(2), "e8m0")
  with pytest.raises(ValueError, match="E8M0 holds scales"):
    F.grid_codes(jnp.ones(2), F.E8M0)
  with pytest.raises(TypeError, match="pack expects uint8 codes"):
    F.pack(jnp.array([1.7, 1, 2, 3]), "e2m1")
