"""Property tests: quantize / dequantize / pack / the scale rules against the
independent NumPy reference (tests/reference_numpy.py), over random shapes,
dtypes and magnitudes, with zero, subnormal, huge, NaN, Inf, tiny and tie
blocks mixed in."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import reference_numpy as ref
from qlayers import formats as F
from qlayers import scale_rules
from qlayers import scaling as S
from qlayers.scaling import QuantSpec

# XLA on CPU reads FP32 subnormals as zero; the reference models that.
FTZ = float(jax.jit(lambda v: v * 3.0)(np.float32(1e-40))) == 0.0

FAST = settings(max_examples=25, deadline=None, database=None,
                derandomize=True)
# Per compiled quantize case (15 of them): fewer examples, each still
# drawing magnitudes from 2**-135 to 2**120 and up to three special blocks.
CASE = settings(FAST, max_examples=12)

FP8 = ("e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz")
MX = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
          "float16": jnp.float16}
SPECIALS = ("nan", "inf", "-inf", "subnormal", "huge", "zero_block",
            "tiny_block", "tie_block")


@functools.cache
def _quantize_fn(spec, axis):
  """One jitted call: (scale, payload codes (unpacked), dequantized)."""
  def run(x):
    qt = S.quantize(x, spec, axis)
    return qt.scale, payload_codes(qt), qt.dequantize()
  return jax.jit(run)


def _grid_values(fmt):
  """Finite non-negative values of ``fmt``, ascending."""
  codes = np.arange(1 << ref.BITS[fmt], dtype=np.uint8)
  v = ref.decode(codes, fmt)
  return np.unique(v[np.isfinite(v) & (v >= 0)])


def make_input(seed, shape, log2_mag, specials, fmt):
  """FP32 data: Gaussian * 2**log2_mag, then the listed special blocks or
  elements along the last axis (blocks of 32)."""
  rng = np.random.default_rng(seed)
  with np.errstate(over="ignore"):
    x = (rng.standard_normal(shape) * 2.0**log2_mag).astype(np.float32)
  flat_rows = x.reshape(-1, shape[-1])
  nblocks = -(-shape[-1] // 32)
  for kind in specials:
    r = rng.integers(flat_rows.shape[0])
    c = rng.integers(shape[-1])
    b = slice(32 * rng.integers(nblocks), None)
    b = slice(b.start, min(b.start + 32, shape[-1]))
    if kind == "nan":
      flat_rows[r, c] = np.nan
    elif kind == "inf":
      flat_rows[r, c] = np.inf
    elif kind == "-inf":
      flat_rows[r, c] = -np.inf
    elif kind == "subnormal":
      flat_rows[r, c] = np.float32(rng.uniform(-1, 1) * 2.0**-127)
    elif kind == "huge":
      flat_rows[r, c] = np.float32(rng.choice([-3e38, 3e38]))
    elif kind == "zero_block":
      flat_rows[r, b] = 0.0
    elif kind == "tiny_block":  # amax / max below the FP32 normal range
      n = b.stop - b.start
      flat_rows[r, b] = rng.choice([1.0, -1.5, 0.75], n) * 2.0**-120
    elif kind == "tie_block":  # exact ties once scaled by 2**e
      e = int(rng.integers(-20, 20))
      grid = _grid_values(fmt)
      mids = (grid[:-1] + grid[1:]) / 2
      n = b.stop - b.start
      vals = rng.choice(mids, n) * rng.choice([-1, 1], n)
      vals[0] = ref.fmt_max(fmt)
      flat_rows[r, b] = np.ldexp(vals, e)
  return flat_rows.reshape(shape)


def payload_codes(qt):
  if qt.fmt.packed:
    return F.unpack(qt.payload, qt.fmt)
  return jax.lax.bitcast_convert_type(qt.payload, jnp.uint8)


def assert_same_bits(got, want, what, mask=None):
  """FP32 (or uint8) arrays equal bit for bit, NaN matching any NaN."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  if got.dtype == np.uint8:
    same = got == want
  else:
    g32, w32 = got.astype(np.float32), want.astype(np.float32)
    same = (g32.view(np.uint32) == w32.view(np.uint32)) | (
        np.isnan(g32) & np.isnan(w32))
  if mask is not None:
    same |= ~mask
  bad = np.argwhere(~same)
  assert bad.size == 0, (f"{what}: {len(bad)} mismatches, first at "
                         f"{bad[0].tolist()}: got {got[tuple(bad[0])]!r}, "
                         f"want {want[tuple(bad[0])]!r}")


def assert_codes_match(got, want, fmt, mask):
  """Element codes equal, NaN codes matching any NaN code."""
  g, w = ref.decode(got, fmt), ref.decode(want, fmt)
  same = (got == want) | (np.isnan(g) & np.isnan(w)) | ~mask
  bad = np.argwhere(~same)
  assert bad.size == 0, (f"payload: {len(bad)} mismatches, first at "
                         f"{bad[0].tolist()}: got {g[tuple(bad[0])]}, want "
                         f"{w[tuple(bad[0])]}")


def check_quantize(x32, dtype, spec, axis):
  """qlayers' quantize/dequantize of ``x32`` (as ``dtype``) == reference."""
  xj = jnp.asarray(x32).astype(DTYPES[dtype])  # overflow: +-Inf
  xr = np.asarray(xj.astype(jnp.float32))  # the values quantize sees
  got_scale, got_codes, got = map(np.asarray, _quantize_fn(spec, axis)(xj))
  codes, scale = ref.quantize(
      xr, spec.format, spec.granularity, axis, rule=spec.scale_rule,
      margin=spec.margin, pow2=spec.pow2, block_size=spec.block_size,
      ftz=FTZ)
  assert_same_bits(got_scale, scale, "scale")
  # Units with a NaN scale carry the NaN; their payload is not compared.
  if spec.granularity == "mx":
    nan_unit = np.asarray(scale) == 255
  else:
    nan_unit = np.isnan(np.asarray(scale, np.float32))
  if spec.granularity == "tensor":
    mask = np.full(codes.shape, not bool(nan_unit))
  else:
    mask = ~_expand(nan_unit, codes.shape)
  assert_codes_match(got_codes, codes, spec.format, mask)
  want = ref.dequantize(codes, scale, spec.format, x32.shape,
                        spec.granularity, axis, spec.block_size, ftz=FTZ)
  assert_same_bits(got, want, "dequantize")
  # Every element of a NaN-scale unit dequantizes to NaN.
  crop = tuple(slice(0, n) for n in x32.shape)
  assert np.all(np.isnan(got[~mask[crop]]))


def _expand(grid, shape):
  """A keep-dims per-unit grid broadcast over the (padded) element shape."""
  out = grid
  for axis, n in enumerate(shape):
    out = np.repeat(out, n // out.shape[axis], axis=axis)
  return out


def _spec(fmt, gran, rule=None, **kw):
  return QuantSpec(format=fmt, granularity=gran, scale_rule=rule, **kw)


# (spec, axis, shape, dtype): each compiles once; hypothesis draws the data.
# Together they cover every granularity, scale rule, element format, pow2,
# margin, both quantization axes, padding and the three input dtypes.
CASES = [
    (_spec("e4m3", "tensor"), -1, (6, 40), "float32"),
    (_spec("e5m2", "tensor", margin=3, pow2=True), -1, (6, 40), "bfloat16"),
    (_spec("e4m3fnuz", "tensor", "deepseek"), -1, (6, 40), "float16"),
    (_spec("e4m3", "row", pow2=True), 1, (5, 48), "float32"),
    (_spec("e5m2fnuz", "row"), 0, (5, 48), "bfloat16"),
    (_spec("e4m3", "tile"), 1, (3, 200), "bfloat16"),
    (_spec("e4m3", "tile", pow2=True), 0, (200, 3), "float32"),
    (_spec("e4m3", "block"), 0, (130, 136), "float32"),
    (_spec("e5m2", "block", "te", pow2=True), 1, (130, 136), "bfloat16"),
    (_spec("e4m3", "mx"), -1, (4, 72), "bfloat16"),
    (_spec("e5m2", "mx", "mx_floor"), -1, (2, 3, 64), "float32"),
    (_spec("e3m2", "mx"), -1, (4, 72), "float32"),
    (_spec("e2m3", "mx", "mx_floor"), -1, (4, 72), "float16"),
    (_spec("e2m1", "mx"), -1, (4, 72), "float32"),
    (_spec("e2m1", "mx", "mx_floor"), -1, (2, 3, 64), "bfloat16"),
]


def _case_id(case):
  spec, axis, shape, dtype = case
  extra = "".join(f"-{k}{getattr(spec, k)}" for k in ("margin", "pow2")
                  if getattr(spec, k))
  return (f"{spec.granularity}-{spec.format}-{spec.scale_rule}{extra}-"
          f"axis{axis}-{dtype}")


@pytest.mark.parametrize("case", CASES, ids=map(_case_id, CASES))
@CASE
@given(seed=st.integers(0, 2**31 - 1),
       log2_mag=st.sampled_from([-135, -100, -20, -3, 0, 5, 40, 120]),
       specials=st.lists(st.sampled_from(SPECIALS), max_size=3))
def test_quantize_matches_reference(case, seed, log2_mag, specials):
  spec, axis, shape, dtype = case
  x = make_input(seed, shape, log2_mag, specials, spec.format)
  check_quantize(x, dtype, spec, axis)


# ------------------------------------------------------------- scale rules

AMAX = st.one_of(
    st.floats(width=32, allow_subnormal=True, allow_infinity=True,
              allow_nan=True),
    st.sampled_from([0.0, 2.0**-126, 2.0**-120, 5e-36, 1e-4, 448.0, 449.0,
                     57344.0, 3.4e38]),
    st.integers(-149, 127).map(lambda e: float(np.ldexp(np.float32(1), e))))


@functools.cache
def _rule_fn(kind, fmt):
  f = F.get_format(fmt)
  if kind == "mx":
    def rules(a):
      return {rule: S.mx_scale_codes(a, f, rule)
              for rule in ("mx_floor", "mx_rceil")}
  else:
    def rules(a):
      return [(S.te_multiplier(a, f, pow2=pow2), S.te_scale(a, f, pow2=pow2),
               scale_rules.deepseek_scale(a, f, pow2)) for pow2 in (False, True)]
  return jax.jit(rules)


def _amax_array(amaxes):
  a = np.zeros(64, np.float32)
  with np.errstate(over="ignore"):
    a[:len(amaxes)] = np.abs(np.asarray(amaxes, np.float64))
  return a


@FAST
@given(st.lists(AMAX, min_size=1, max_size=64), st.sampled_from(MX))
def test_mx_scale_codes_match_reference(amaxes, fmt):
  a = _amax_array(amaxes)
  got = _rule_fn("mx", fmt)(a)
  for rule in ("mx_floor", "mx_rceil"):
    want = ref.mx_codes(ref.flush(a, FTZ), fmt, rule)
    assert_same_bits(np.asarray(got[rule]), want, f"{rule} codes")


@FAST
@given(st.lists(AMAX, min_size=1, max_size=64), st.sampled_from(FP8))
def test_te_and_deepseek_rules_match_reference(amaxes, fmt):
  a = _amax_array(amaxes)
  ar = ref.flush(a, FTZ)
  got = _rule_fn("fp8", fmt)(a)
  for pow2 in (False, True):
    mult, scale, ds = got[int(pow2)]
    want_mult, want_scale = ref.te(ar, fmt, pow2=pow2)
    assert_same_bits(mult, want_mult, "te multiplier")
    assert_same_bits(scale, ref.flush(want_scale, FTZ), "te scale")
    assert_same_bits(ds, ref.deepseek(ar, fmt, pow2)[1], "deepseek scale")


# ------------------------------------------------------------------ packing


@functools.cache
def _pack_fns(fmt):
  return (jax.jit(lambda c: F.pack(c, fmt)),
          jax.jit(lambda p: F.unpack(p, fmt)))


@FAST
@given(st.sampled_from(["e2m1", "e3m2", "e2m3"]), st.integers(0, 2**31 - 1))
def test_pack_matches_reference_and_round_trips(fmt, seed):
  codes = np.random.default_rng(seed).integers(
      0, 1 << ref.BITS[fmt], (3, 2, 24)).astype(np.uint8)
  pack, unpack = _pack_fns(fmt)
  packed = np.asarray(pack(codes))
  np.testing.assert_array_equal(packed, ref.pack(codes, fmt))
  np.testing.assert_array_equal(np.asarray(unpack(packed)), codes)


def test_reference_cast_is_ml_dtypes_on_every_code():
  """The reference itself: decode(cast(v)) == v for every finite code."""
  for fmt in FP8 + ("e3m2", "e2m3", "e2m1"):
    codes = np.arange(1 << ref.BITS[fmt], dtype=np.uint8)
    v = ref.decode(codes, fmt)
    ok = np.isfinite(v)
    back = ref.decode(ref.cast_codes(v[ok].astype(np.float32), fmt), fmt)
    np.testing.assert_array_equal(back, v[ok])
    assert ml_dtypes.finfo(ref._DTYPES[fmt]).max == ref.fmt_max(fmt)


@pytest.mark.parametrize("case", [c for c in CASES if c[0].granularity == "mx"],
                         ids=_case_id)
def test_tie_blocks_round_to_even(case):
  """Blocks of exact midpoints (amax = max * 2**e): both MX rules give scale
  2**e and every payload rounds half to even, as ml_dtypes does."""
  spec, axis, shape, dtype = case
  x = make_input(0, shape, 0, ["tie_block"] * 6, spec.format)
  check_quantize(x, dtype, spec, axis)
