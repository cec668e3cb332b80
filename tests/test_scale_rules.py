"""Scale rules (qlayers.scale_rules): TE multiplier and scale, DeepSeek-V3
and MX scale codes, and the correctly rounded FP32 divisions under them;
properties against the NumPy reference (tests/_support/reference_numpy.py) over
random, special and boundary amaxes."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from _support import reference_numpy as ref
from qlayers import formats as F
from qlayers import scale_rules as S
from qlayers.wide_divide import rdivide_wide

# XLA on CPU reads FP32 subnormals as zero; the reference models that.
FTZ = float(jax.jit(lambda v: v * 3.0)(np.float32(1e-40))) == 0.0
FAST = settings(max_examples=25, deadline=None, database=None,
                derandomize=True)


def test_mx_scale_codes_match_ml_dtypes_for_powers_of_two():
  # For a power-of-two scale 2**e, ml_dtypes' E8M0 encodes code e + 127.
  exps = np.arange(-120, 120)
  amax = np.ldexp(448.0, exps).astype(np.float32)
  codes = np.asarray(S.mx_scale_codes(jnp.asarray(amax), F.E4M3, "mx_rceil"))
  ref = np.ldexp(1.0, exps).astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
  np.testing.assert_array_equal(codes, ref)


def test_mx_extreme_exponents_clamp():
  amax = jnp.array([1e-45, 3e38], jnp.float32)
  codes = np.asarray(S.mx_scale_codes(amax, F.E4M3, "mx_floor"))
  assert codes[0] == 0 and codes[1] == 127 + 127 - 8


def test_te_scale_margin_pow2_and_bad_amax():
  e4 = F.E4M3
  assert float(S.te_scale(448.0, e4)) == 1.0
  assert float(S.te_scale(448.0, e4, margin=2)) == 4.0
  assert float(S.te_multiplier(448.0, e4, margin=2)) == 0.25
  assert float(S.te_scale(300.0, e4, pow2=True)) == 1.0
  assert float(S.te_scale(500.0, e4, pow2=True)) == 2.0
  assert float(S.te_scale(0.0, e4)) == 1.0  # nothing to scale: s = 1
  for bad in (np.inf, np.nan):  # the unit holds Inf/NaN: its GEMM is too
    assert np.isnan(float(S.te_scale(bad, e4)))
  # max / amax overflows FP32: the multiplier is the FP32 max (TE's
  # value_for_inf), rounded down to 2**127 with pow2.
  tiny = np.float32(2.0**-126)
  assert float(S.te_multiplier(tiny, e4)) == np.finfo(np.float32).max
  assert float(S.te_multiplier(tiny, e4, pow2=True)) == 2.0**127


def test_margin_divides_the_multiplier_by_a_power_of_two():
  amax = np.float32(31.683146)
  for margin in (0, 1, 4):
    s = float(S.te_multiplier(jnp.float32(amax), F.E5M2, margin=margin))
    assert s == float((np.float32(57344) / amax) / np.float32(2**margin))


def _binade(biased_exponent):
  """Every FP32 value with this exponent field (2**23 of them)."""
  mant = np.arange(1 << 23, dtype=np.uint32)
  return ((np.uint32(biased_exponent) << 23) | mant).view(np.float32)


@pytest.mark.parametrize("const", [448.0, 57344.0, 240.0, 7.5])
def test_divisions_are_correctly_rounded_on_a_whole_binade(const):
  """divide_rn(a, c) and rdivide_rn(c, a) equal NumPy's IEEE FP32 division
  for all 2**23 significands (the quotient's significand depends on the
  significand only), where XLA's a / c (a * fl(1/c)) is 1 ulp off for about
  half of them and XLA:GPU's c / a is div.full.f32 (2 ulp). The integer
  long division and the FP64 division (rdivide_rn's other branches) are
  checked here too."""
  a = _binade(120)
  got = np.asarray(jax.jit(lambda v: S.divide_rn(v, const))(a))
  np.testing.assert_array_equal(got.view(np.uint32),
                                (a / np.float32(const)).view(np.uint32))
  for rdivide in (S.rdivide_rn, S.rdivide_rn_integer, rdivide_wide):
    got = np.asarray(jax.jit(lambda v, f=rdivide: f(const, v))(a))
    np.testing.assert_array_equal(got.view(np.uint32),
                                  (np.float32(const) / a).view(np.uint32))
    recip = np.asarray(jax.jit(lambda v, f=rdivide: f(1.0, v))(a))
    np.testing.assert_array_equal(recip.view(np.uint32),
                                  (np.float32(1) / a).view(np.uint32))


def test_rdivide_rn_lowers_only_its_platform_branch():
  """On CPU the lowered program is one division, not the integer steps."""
  text = jax.jit(lambda v: S.rdivide_rn(448.0, v)).lower(
      jnp.ones((8,), jnp.float32)).as_text()
  assert "divide" in text
  assert "shift_left" not in text and "count_leading_zeros" not in text


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_rdivide_rn_divides_in_fp64_on_gpus(platform):
  """Lowered for a GPU, rdivide_rn is one FP64 division rounded to FP32
  (not XLA:GPU's div.full.f32 FP32 division, nor the integer steps)."""
  text = jax.jit(lambda v: S.rdivide_rn(448.0, v)).trace(
      jnp.ones((8,), jnp.float32)).lower(
          lowering_platforms=(platform,)).as_text()
  assert "stablehlo.divide" in text and "tensor<8xf64>" in text
  assert "shift_left" not in text and "count_leading_zeros" not in text


@pytest.mark.parametrize("const", [448.0, 1.0])
def test_rdivide_rn_integer_edge_cases_fall_back_to_division(const):
  """Zero, subnormal, huge and non-finite divisors (and quotients out of the
  normal range) give the plain division's result."""
  b = np.array([0.0, -0.0, 1e-40, 1e-38, 3e38, np.inf, -np.inf, np.nan,
                -2.5, 1.0, 7.0], np.float32)
  want = np.asarray(jax.jit(lambda v: const / v)(b))
  got = np.asarray(jax.jit(lambda v: S.rdivide_rn_integer(const, v))(b))
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))



def test_division_constants_are_checked_and_named():
  """The constant's odd part must be below 128 (so the integer steps fit
  uint32); the error names the division and the constant."""
  with pytest.raises(ValueError, match="divide_rn supports odd parts below "
                     "128; 129.0 has 129"):
    S.divide_rn(jnp.ones(2), 129.0)
  with pytest.raises(ValueError, match="rdivide_rn expects a positive finite "
                     "constant, got -1.0"):
    S.rdivide_rn(-1.0, jnp.ones(2))
  with pytest.raises(ValueError, match="rdivide_rn supports odd parts"):
    S.rdivide_rn_integer(255.0, jnp.ones(2))

# --------------------------------------------- properties (NumPy reference)


def assert_same_bits(got, want, what):
  """FP32 arrays equal bit for bit, a NaN matching any NaN."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  same = (got.view(np.uint32) == want.view(np.uint32)) | (
      np.isnan(got) & np.isnan(want))
  assert same.all(), (what, got[~same][:4], want[~same][:4])


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
               S.deepseek_scale(a, f, pow2)) for pow2 in (False, True)]
  return jax.jit(rules)


def _amax_array(amaxes):
  a = np.zeros(64, np.float32)
  with np.errstate(over="ignore"):
    a[:len(amaxes)] = np.abs(np.asarray(amaxes, np.float64))
  return a


@FAST
@given(st.lists(AMAX, min_size=1, max_size=64),
       st.sampled_from(["e4m3", "e5m2", "e3m2", "e2m3", "e2m1"]))
def test_mx_scale_codes_match_reference(amaxes, fmt):
  a = _amax_array(amaxes)
  got = _rule_fn("mx", fmt)(a)
  for rule in ("mx_floor", "mx_rceil"):
    want = ref.mx_codes(ref.flush(a, FTZ), fmt, rule)
    np.testing.assert_array_equal(np.asarray(got[rule]), want,
                                  err_msg=f"{rule} codes")


@FAST
@given(st.lists(AMAX, min_size=1, max_size=64),
       st.sampled_from(["e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz"]))
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
