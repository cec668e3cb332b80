"""quantize and QTensor: bit-exact MX vectors, layout and padding, the
amax= of a precomputed amax, non-finite units, exact payloads; properties
against the independent NumPy reference (tests/_support/reference_numpy.py) over
random shapes, dtypes and magnitudes, with zero, subnormal, huge, NaN, Inf,
tiny and tie blocks mixed in."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from _support import reference_numpy as ref
from qlayers import formats as F
from qlayers import scaling as S
from qlayers.scaling import QuantSpec


def mx(fmt="e4m3", rule="mx_rceil"):
  return QuantSpec(format=fmt, granularity="mx", scale_rule=rule)


def payload_codes(qt):
  if qt.fmt.packed:
    return np.asarray(F.unpack(qt.payload, qt.fmt))
  return np.asarray(jax.lax.bitcast_convert_type(qt.payload, jnp.uint8))


# ---------------------------------------------------------------- MX vectors


def test_mx_block_of_480_floor_and_rceil():
  x = jnp.full((1, 32), 480.0)
  floor = S.quantize(x, mx(rule="mx_floor"))
  assert int(floor.scale[0, 0]) == 127  # 2**0
  assert np.all(payload_codes(floor) == 0x7E)  # 448, saturated
  rceil = S.quantize(x, mx(rule="mx_rceil"))
  assert int(rceil.scale[0, 0]) == 128  # 2**1
  assert np.all(np.asarray(rceil.payload.astype(jnp.float32)) == 240.0)
  np.testing.assert_array_equal(rceil.dequantize(), x)


@pytest.mark.parametrize("rule", ["mx_floor", "mx_rceil"])
def test_mx_zero_inf_nan_blocks(rule):
  x = np.ones((4, 32), np.float32)
  x[0] = 0.0
  x[1, 5] = np.inf
  x[2, 7] = np.nan
  x[3, 9] = -np.inf
  qt = S.quantize(jnp.asarray(x), mx(rule=rule))
  codes = np.asarray(qt.scale)[:, 0]
  assert codes[0] == 0  # zero block: 2**-127
  assert np.all(payload_codes(qt)[0] == 0)
  assert list(codes[1:]) == [255, 255, 255]
  deq = np.asarray(qt.dequantize())
  assert np.all(deq[0] == 0) and np.all(np.isnan(deq[1:]))


@pytest.mark.parametrize(
    "fmt,amax,floor_e,rceil_e",
    [
        ("e4m3", 448.0, 0, 0),  # exact max: RCEIL stays at 2**0
        ("e4m3", 449.0, 0, 1),  # just over: RCEIL rounds up
        ("e4m3", 256.0, 0, 0),  # 2**8 (FLOOR emax 8); RCEIL 256/448 -> 2**0
        ("e4m3", 1.0, -8, -8),  # 1/448 -> ceil(log2) = -8
        ("e5m2", 57344.0, 0, 0),
        ("e2m1", 6.0, 0, 0),
        ("e2m1", 7.0, 0, 1),
        ("e2m1", 4.0, 0, 0),
        ("e3m2", 28.0, 0, 0),
        ("e2m3", 7.5, 0, 0),
        ("e2m3", 0.001, -12, -12),
    ])
def test_mx_boundary_exponents(fmt, amax, floor_e, rceil_e):
  x = jnp.zeros((1, 32)).at[0, 3].set(amax).at[0, 4].set(-amax / 3)
  f = S.quantize(x, mx(fmt, "mx_floor"))
  r = S.quantize(x, mx(fmt, "mx_rceil"))
  assert int(f.scale[0, 0]) - 127 == floor_e
  assert int(r.scale[0, 0]) - 127 == rceil_e
  # RCEIL never saturates: the scaled amax fits the element range.
  assert float(jnp.max(jnp.abs(r.elements()))) <= F.get_format(fmt).max


def test_mx_dequantize_is_exact_given_payload():
  x = jax.random.normal(jax.random.key(0), (6, 96)) * 3
  for fmt in ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1"):
    qt = S.quantize(x, mx(fmt))
    codes = payload_codes(qt)
    elems = codes.view(F.get_format(fmt).np_dtype).astype(np.float64)
    scales = np.ldexp(1.0, np.asarray(qt.scale).astype(np.int64) - 127)
    ref = elems * np.repeat(scales, 32, axis=1)
    np.testing.assert_array_equal(np.asarray(qt.dequantize()), ref)


# ------------------------------------------------------- granularity/layout


def test_padding_reports_padded_shape_and_crops():
  x = jax.random.normal(jax.random.key(1), (5, 70))
  qt = S.quantize(x, QuantSpec(format="e4m3", granularity="tile"))
  assert qt.shape == (5, 70) and qt.padded_shape == (5, 128)
  assert qt.payload.shape == (5, 128) and qt.scale.shape == (5, 1)
  assert np.all(np.asarray(qt.payload[:, 70:].astype(jnp.float32)) == 0)
  assert qt.dequantize().shape == (5, 70)
  w = jax.random.normal(jax.random.key(2), (300, 200))
  qb = S.quantize(w, QuantSpec(format="e4m3", granularity="block"), axis=0)
  assert qb.padded_shape == (384, 256) and qb.scale.shape == (3, 2)
  fp4 = S.quantize(x, mx("e2m1"))
  assert fp4.payload.shape == (5, 48) and fp4.scale.shape == (5, 3)


def test_deepseek_scale_formula():
  x = np.zeros((2, 128), np.float32)
  x[0, 0] = 3.0
  x[1, :] = 1e-6  # below the amax floor
  qt = S.quantize(jnp.asarray(x), QuantSpec(format="e4m3",
                                            granularity="tile"))
  np.testing.assert_allclose(np.asarray(qt.scale)[:, 0],
                             [3.0 / 448, 1e-4 / 448], rtol=1e-7)
  p2 = S.quantize(jnp.asarray(x), QuantSpec(format="e4m3", granularity="tile",
                                            pow2=True))
  np.testing.assert_array_equal(np.asarray(p2.scale)[:, 0],
                                [2.0**-7, 2.0**-22])  # rounded up


def test_rowwise_scales_along_axis():
  x = jnp.arange(1.0, 13.0).reshape(3, 4)
  qt = S.quantize(x, QuantSpec(format="e4m3", granularity="row"), axis=1)
  np.testing.assert_allclose(np.asarray(qt.scale)[:, 0],
                             np.array([4, 8, 12]) / 448, rtol=1e-7)
  qc = S.quantize(x, QuantSpec(format="e4m3", granularity="row"), axis=0)
  np.testing.assert_allclose(np.asarray(qc.scale)[0],
                             np.array([9, 10, 11, 12]) / 448, rtol=1e-7)


def test_qtensor_is_a_pytree_under_jit():
  spec = mx("e2m1")
  f = jax.jit(lambda x: S.quantize(x, spec))
  qt = f(jnp.ones((4, 64)))
  assert isinstance(qt, S.QTensor) and qt.format == "e2m1"
  leaves = jax.tree.leaves(qt)
  assert len(leaves) == 2
  back = jax.jit(lambda q: q.dequantize())(qt)
  np.testing.assert_array_equal(back, jnp.ones((4, 64)))


def test_quantize_errors():
  with pytest.raises(ValueError, match="packed along the last axis"):
    S.quantize(jnp.ones((64, 4)), mx("e2m1"), axis=0)
  with pytest.raises(ValueError, match="needs block scales"):
    QuantSpec(format="e2m1", granularity="tensor")
  with pytest.raises(ValueError, match="Stochastic rounding needs"):
    S.quantize(jnp.ones((2, 32)), QuantSpec(format="e4m3",
                                            rounding="stochastic"))
  with pytest.raises(TypeError, match="floating-point"):
    S.quantize(jnp.ones((2, 32), jnp.int32), QuantSpec())
  with pytest.raises(ValueError, match="does not fit granularity"):
    QuantSpec(format="e4m3", granularity="tile", scale_rule="mx_rceil")
  with pytest.raises(ValueError, match="not an OCP MX element format"):
    QuantSpec(format="e4m3fnuz", granularity="mx")
  with pytest.raises(ValueError, match="axis 5 out of range"):
    S.quantize(jnp.ones((2, 32)), QuantSpec(), axis=5)


# --------------------------------------------------- non-finite, exactness

# Jitted: one compile per (spec, shape) instead of one per primitive.
jquantize = jax.jit(S.quantize, static_argnums=(1, 2),
                    static_argnames=("axis",))
jdequantize = jax.jit(lambda q: q.dequantize())

# XLA on CPU reads FP32 subnormals as zero (see the README's numerics notes).
FTZ = float(jax.jit(lambda v: v * 3.0)(np.float32(1e-40))) == 0.0


@pytest.mark.parametrize("spec,axis", [
    (QuantSpec(format="e4m3", granularity="row"), 1),
    (QuantSpec(format="e4m3", granularity="row", pow2=True), 0),
    (QuantSpec(format="e5m2", granularity="tile", scale_rule="te"), 1),
    (QuantSpec(format="e4m3", granularity="tile"), 1),
    (QuantSpec(format="e4m3", granularity="tile", pow2=True), 0),
    (QuantSpec(format="e4m3", granularity="block"), 1),
    (QuantSpec(format="e4m3", granularity="mx"), 1),
])
def test_units_holding_inf_or_nan_get_nan_scales(spec, axis):
  """Every unit holding Inf/NaN gets a NaN scale (MX: 0xFF) and dequantizes
  to NaN; every other unit is exactly what it is without them."""
  x = np.asarray(jax.random.normal(jax.random.key(3), (256, 256)))
  bad = x.copy()
  bad[3, 5], bad[200, 130], bad[70, 250] = np.inf, np.nan, -np.inf
  clean = jquantize(jnp.asarray(x), spec, axis)
  q = jquantize(jnp.asarray(bad), spec, axis)
  s, s0 = np.asarray(q.scale), np.asarray(clean.scale)
  nan_scale = (s == 255) if spec.granularity == "mx" else np.isnan(s)
  per_elem = _expand(nan_scale, x.shape)  # units touched, per element
  assert per_elem[3, 5] and per_elem[200, 130] and per_elem[70, 250]
  assert nan_scale.sum() <= 3  # only the units holding them
  np.testing.assert_array_equal(s[~nan_scale], s0[~nan_scale])
  deq, deq0 = np.asarray(jdequantize(q)), np.asarray(jdequantize(clean))
  assert np.all(np.isnan(deq[per_elem]))
  np.testing.assert_array_equal(deq[~per_elem], deq0[~per_elem])


def test_nan_survives_amax_of_large_fp32_arrays():
  """XLA:CPU's max reduction drops a NaN of an FP32 array of 4096+ elements
  unless it is the last of its block; every amax maps NaN to +Inf first."""
  x = np.ones((4, 1024), np.float32)
  x[0, 6] = np.nan
  xj = jnp.asarray(x)
  assert float(S.amax(xj)) == np.inf
  assert float(jax.jit(S.amax)(xj)) == np.inf
  mx = jquantize(xj, QuantSpec(format="e4m3", granularity="mx"))
  assert int(mx.scale[0, 0]) == 255  # was 119, the code of its ones
  assert int(mx.scale[0, 1]) == 119  # ceil(log2(1 / 448)) = -8
  assert np.isnan(float(jquantize(xj, QuantSpec(format="e4m3")).scale))
  for gran in ("row", "tile"):
    q = jquantize(xj, QuantSpec(format="e4m3", granularity=gran))
    assert np.isnan(np.asarray(q.scale)[0, 0])
    assert np.all(np.isfinite(np.asarray(q.scale)[1:]))
  # Delayed scaling: the NaN step scales by a non-finite amax and records 0.
  st = S.init_scale_state(4)
  now, running = S.delayed_amax(st, S.amax(xj))
  assert not np.isfinite(float(now)) and float(running) == 0.0
  for dtype in (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn):
    assert float(S.amax(xj.astype(dtype))) == np.inf


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1"])
def test_rceil_tiny_block_gets_code_0_and_keeps_payload(fmt):
  """amax / max below the FP32 normal range (CPU flushes the quotient): the
  exponent comes from the bits of amax, so 2**-120 gets code 0 (2**-127) and
  payload 2**7, as OCP/TE/cuBLAS give."""
  x = jnp.zeros((1, 32)).at[0, 0].set(2.0**-120).at[0, 1].set(-2.0**-121)
  q = jquantize(x, mx(fmt, "mx_rceil"))
  fm = F.get_format(fmt).max
  # e = ceil(log2(2**-120 / max)), clamped at -127 (448: -128.8 -> -127).
  e = max(-127, int(np.ceil(np.log2(2.0**-120 / fm))))
  assert int(q.scale[0, 0]) == e + 127
  assert np.asarray(q.elements())[0, :2].tolist() == [2.0**(-120 - e),
                                                      -2.0**(-121 - e)]
  if fmt == "e4m3":
    assert int(q.scale[0, 0]) == 0 and float(q.elements()[0, 0]) == 128
  codes = S.mx_scale_codes(jnp.asarray([2.0**-120, 5e-36, 2.0**-126, 1e-30],
                                       jnp.float32), F.E4M3, "mx_rceil")
  # / 448: 2**-128.8, 2**-126.1, 2**-134.8 (clamp to -127), 2**-108.4.
  assert np.asarray(codes).tolist() == [0, 1, 0, 19]


def test_fp32_subnormal_inputs_follow_the_platform():
  """FP32 subnormals: XLA:CPU treats them as zero (a subnormal-only block is
  a zero block); a platform that keeps them quantizes them like the
  reference. Not worked around: the references keep them, CPU does not."""
  sub = np.float32(3 * 2.0**-130)
  x = jnp.zeros((1, 32)).at[0, 0].set(sub)
  q = jquantize(x, mx("e4m3", "mx_rceil"))
  # amax is an integer max of the bits: exact on every platform.
  assert np.float32(S.amax(x)) == sub
  if FTZ:
    assert int(q.scale[0, 0]) == 0
    assert np.all(np.asarray(q.elements()) == 0)
  else:
    assert int(q.scale[0, 0]) == 0  # 2**-127: payload 3 * 2**-3
    assert float(q.elements()[0, 0]) == 0.375


def test_per_tensor_payload_uses_te_multiplier():
  """TE: s = fl(448 / amax), payload sat(x * s). With the old 1 / fl(amax /
  448) the payload of this pair was 112 instead of 104 (exact 107.99999)."""
  amax, x = np.float32(31.683146), np.float32(7.6379008)
  s = np.float32(448) / amax
  assert (x * s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) == 104
  q = jquantize(jnp.asarray([x, amax]), QuantSpec(format="e4m3"))
  assert float(q.elements()[0]) == 104.0
  # Stored scale = TE's scale_inv = 1 / s in FP32; also through amax=.
  assert np.float32(q.scale) == np.float32(1) / s
  q2 = jquantize(jnp.asarray([x]), QuantSpec(format="e4m3"),
                  amax=jnp.float32(amax))
  assert float(q2.elements()[0]) == 104.0
  assert np.float32(q2.scale) == np.float32(1) / s


def test_amax_keyword_scales_by_the_given_amax():
  """amax= (a delayed or global amax) replaces max |x| bit for bit."""
  x = jnp.asarray([1.0, -2.0, 3.0], jnp.bfloat16)
  spec = QuantSpec(format="e4m3")
  q = S.quantize(x, spec, amax=jnp.float32(6.0))
  assert float(q.scale) == np.float32(1) / (np.float32(448) / np.float32(6))
  assert np.asarray(q.elements()).tolist() == [72.0, -144.0, 224.0]
  with pytest.raises(ValueError, match="per-tensor granularity only, not "
                     "'tile'"):
    S.quantize(jnp.ones((2, 128)), QuantSpec(granularity="tile"),
               amax=jnp.float32(1.0))


def test_wrong_argument_types_are_named():
  """A format name or None as spec, a list as x, a non-scalar amax and a
  float axis are refused up front (they failed deep inside, or the axis was
  stored as 1.0)."""
  x = jnp.ones((4, 64))
  for spec in ("e4m3", None):
    with pytest.raises(TypeError, match="spec must be a QuantSpec"):
      S.quantize(x, spec)
  with pytest.raises(TypeError, match="x must be an array"):
    S.quantize([[1.0, 2.0]], QuantSpec())
  with pytest.raises(ValueError, match=r"amax must be a scalar.*\(3,\)"):
    S.quantize(x, QuantSpec(), amax=jnp.ones(3))
  with pytest.raises(TypeError, match="axis must be an int"):
    S.quantize(x, QuantSpec(), axis=1.0)
  assert type(S.quantize(x, QuantSpec(), axis=np.int64(1)).axis) is int


def test_deepseek_tile_scales_are_exact_quotients():
  """sf = fl(max(amax, 1e-4) / 448) (DeepGEMM's reference), payload
  x * fl(1 / sf) (DeepGEMM's per_token_cast_to_fp8), on 4096 tiles."""
  x = np.asarray(jax.random.normal(jax.random.key(7), (4096, 128)),
                 np.float32) * np.float32(3)
  x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
  q = jquantize(jnp.asarray(x, jnp.bfloat16),
                 QuantSpec(format="e4m3", granularity="tile"))
  amax = np.max(np.abs(x), axis=1, keepdims=True)
  sf = np.maximum(amax, np.float32(1e-4)) / np.float32(448)
  np.testing.assert_array_equal(np.asarray(q.scale), sf)
  payload = np.clip(x * (np.float32(1) / sf), -448, 448).astype(
      ml_dtypes.float8_e4m3fn)
  np.testing.assert_array_equal(payload_codes(q), payload.view(np.uint8))


def test_deepseek_floor_flushes_tiny_tiles():
  """The 1e-4 amax floor of DeepSeek-V3/DeepGEMM: a tile of ~1e-10 gets
  scale 1e-4 / 448 and a zero payload (documented in recipes/deepseek_v3);
  MXFP8 keeps it."""
  x = jnp.full((2, 128), 1e-10, jnp.float32)
  q = jquantize(x, QuantSpec(format="e4m3", granularity="tile"))
  np.testing.assert_array_equal(np.asarray(q.scale),
                                np.float32(1e-4) / np.float32(448))
  assert np.all(np.asarray(jdequantize(q)) == 0)
  m = jquantize(x, mx("e4m3"))
  np.testing.assert_allclose(np.asarray(jdequantize(m)), 1e-10, rtol=0.07)


# ---------------------------------------- properties (NumPy reference)

FAST = settings(max_examples=25, deadline=None, database=None,
                derandomize=True)
# Per compiled quantize case (15 of them): fewer examples, each still
# drawing magnitudes from 2**-135 to 2**120 and up to three special blocks.
CASE = settings(FAST, max_examples=12)

FP8 = ("e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
          "float16": jnp.float16}
SPECIALS = ("nan", "inf", "-inf", "subnormal", "huge", "zero_block",
            "tiny_block", "tie_block")


@functools.cache
def _quantize_fn(spec, axis):
  """One jitted call: (scale, payload codes (unpacked), dequantized)."""
  def run(x):
    qt = S.quantize(x, spec, axis)
    return qt.scale, _traced_codes(qt), qt.dequantize()
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


def _traced_codes(qt):
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


@pytest.mark.parametrize("spec", [
    QuantSpec(format="e2m1", granularity="mx"),
    QuantSpec(format="e2m3", granularity="mx"),
    QuantSpec(format="e3m2", granularity="mx"),
    QuantSpec(format="e2m1", granularity="tile", scale_rule="nvfp4"),
])
def test_packed_blocks_with_a_nan_scale_hold_zero_codes(spec):
  """FP4/FP6 have no NaN: a block with a NaN scale holds +0 codes, whatever
  its Inf or NaN elements (Inf * 0 is a NaN whose sign is the platform's)
  and its negative ones, so a GPU kernel and XLA write the same bits.
  (NVFP4's per-tensor scale makes every block's NaN.)"""
  x = -np.abs(np.asarray(jax.random.normal(jax.random.key(5), (2, 64))))
  x[0, 3], x[1, 40] = np.inf, np.nan
  q = jquantize(jnp.asarray(x), spec, 1)
  codes, deq = payload_codes(q), np.isnan(np.asarray(jdequantize(q)))
  b = spec.block_size
  assert np.all(deq[0, :b]) and np.all(deq[1, b:2 * b])
  assert np.all(deq) == (spec.scale_rule == "nvfp4")
  np.testing.assert_array_equal(codes == 0, deq)


@pytest.mark.parametrize("spec", [
    S.QuantSpec(), S.QuantSpec(granularity="row"),
    S.QuantSpec(granularity="mx"), S.QuantSpec(granularity="block"),
    S.QuantSpec(format="e2m1", granularity="tile", scale_rule="nvfp4")],
    ids=["tensor", "row", "mx", "block", "nvfp4"])
def test_empty_arrays_quantize_to_empty_qtensors(spec):
  """Every granularity takes an array with no elements (an empty batch) and
  gives back an empty one; the amax of nothing is 0."""
  for shape in ((0,), (2, 0), (0, 32)):
    if spec.granularity == "block" and len(shape) < 2:
      continue
    assert S.quantize(jnp.zeros(shape), spec).dequantize().shape == shape
  assert float(S.amax(jnp.zeros((0, 3)))) == 0.0


def test_the_largest_margin_keeps_finite_data_finite():
  # Margins up to 126 were taken: the scale of ordinary data went below
  # 2**-126, was flushed to 0 and decoded as NaN.
  x = jnp.asarray([[1e11, -3.0, 0.5, 0.0]], jnp.float32)
  qt = S.quantize(x, QuantSpec(margin=32), axis=1)
  assert np.isfinite(np.asarray(qt.scale)).all()
  assert np.isfinite(np.asarray(qt.dequantize(jnp.float32))).all()
  with pytest.raises(ValueError, match=r"margin must be in \[0, 32\]"):
    QuantSpec(margin=100)
