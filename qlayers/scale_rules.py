"""Scale rules: from the amax of a scaling unit to its scale, bit-exactly.

Convention: a *scale* in qlayers is always the dequantization factor, so a
quantized tensor means ``x ~= decode(payload) * scale``. Transformer Engine's
multiplier ``s = (max / amax) / 2**margin`` is ``1 / scale`` here.

Rules (``amax`` = max |x| over the unit, see `qlayers.blocks`):

* ``te`` (Transformer Engine): multiplier ``s = (max / amax) / 2**margin``,
  one correctly rounded FP32 division; payload ``sat(x * s)``; stored scale
  ``1 / s`` (TE's ``scale_inv``). ``pow2`` rounds ``s`` down to a power of
  two. A zero amax gives ``s = 1``.
* ``deepseek`` (DeepSeek-V3 / DeepGEMM): stored scale
  ``max(amax, 1e-4) / max``, correctly rounded; payload ``sat(x * (1 /
  scale))``; ``pow2`` rounds the scale up to a power of two (UE8M0). With
  the 1e-4 floor a unit whose amax is below 1e-4 keeps the scale 1e-4 /
  448: its values keep E4M3's 3 mantissa bits down to about 3.5e-9
  (E4M3's smallest normal, 2**-6, times the scale), E4M3's subnormal steps
  of 1e-4 / 448 * 2**-9 below that, and values below half of one (about
  2.2e-10) quantize to zero.
* ``mx_floor``: OCP MX v1.0 sec. 6.3: ``2**(floor(log2 amax) - emax_elem)``.
* ``mx_rceil``: ``2**ceil(log2(amax / max))`` (the exponent of ``amax / max``
  rounded up when its mantissa is non-zero; the rule of TE/cuBLAS).
* ``nvfp4``: two levels, E4M3 block scales under a per-tensor FP32 scale
  (`nvfp4_scales`: Transformer Engine's NVFP4 quantizer, arXiv 2509.25149).
  Both MX rules read exponents off the bits, give code 0 (2**-127) to an
  all-zero block and the NaN code 0xFF to a block holding Inf or NaN.

A unit whose amax is not finite gets a NaN scale, so the GEMMs that read it
give non-finite outputs, which a training step detects and skips. Divisions
are computed so that they are the IEEE FP32 quotient on every platform (XLA
rewrites ``a / const`` as ``a * fl(1 / const)``, and XLA:GPU divides with
``div.full.f32``); see `divide_rn` and `rdivide_rn`. FP32 subnormals are
read as zero by XLA on CPU (not worked around); elsewhere they are kept.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from qlayers import formats, wide_divide
from qlayers.formats import Format


__all__ = ["MAX_MARGIN", "divide_rn", "rdivide_rn", "rdivide_rn_integer",
           "te_multiplier", "te_scale", "deepseek_scale", "mx_scale_codes",
           "e8m0_decode", "unit_scales", "nvfp4_encode_scale", "nvfp4_scales"]

# DeepSeek-V3's floor on the amax of a tile/block before dividing by max.
DEEPSEEK_AMAX_FLOOR = 1e-4


def _bits(v: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(v.astype(jnp.float32), jnp.uint32)


def _from_bits(b: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(b.astype(jnp.uint32), jnp.float32)


def _f32_fields(value: float) -> tuple[int, int]:
  """(unbiased exponent, 23-bit mantissa field) of a normal FP32 constant."""
  b = int(np.float32(value).view(np.uint32))
  return ((b >> 23) & 0xFF) - 127, b & 0x7FFFFF


F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal, 2**-126
# The largest TE margin. Under Transformer Engine's rule a scale below
# 2**-126 flushes to 0 and decodes as NaN: at this margin that takes an
# amax above max * 2**(126 - margin), past 10**30; a larger margin flushes
# ordinary data (at 126, any amax above the format's max). Below it,
# max * 2**-margin and 2**margin are normal FP32 for every element format
# (max >= 6), so a zero amax gives s = 1 exactly.
MAX_MARGIN = 32


def _pow2_ceil(v: jax.Array) -> jax.Array:
  """Smallest power of two >= v, for positive normal FP32 v, from its bits.

  The exponent field plus one when the mantissa is non-zero (DeepGEMM's
  ``ceil_to_ue8m0``, deep_gemm/utils/math.py); exact, no log2/exp2.
  """
  b = _bits(v)
  e = ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0).astype(jnp.uint32)
  return _from_bits(e << 23)


def _odd_part(value: float, name: str) -> tuple[int, int]:
  """(n, k) with ``value = n * 2**k``, ``n`` odd and below 128, for the
  constant ``value`` of the division ``name``."""
  if not (0 < value < float("inf")):
    raise ValueError(f"{name} expects a positive finite constant, got "
                     f"{value}.")
  n, k = wide_divide.odd_part(value)
  if n >= 128:
    raise ValueError(f"{name} supports odd parts below 128; {value} has {n}.")
  return n, k


def _round_quotient(q: jax.Array, t: jax.Array,
                    rem: jax.Array) -> tuple[jax.Array, jax.Array]:
  """An integer quotient ``q`` rounded to 24 significant bits, to nearest
  even: ``t`` low bits dropped, ``rem`` the division's remainder (non-zero:
  the exact quotient lies above ``q``). Returns (24-bit significand, carry):
  carry 1 when rounding reached 2**24, one binade up."""
  keep = q >> t
  dropped = q & ((jnp.uint32(1) << t) - 1)
  half = jnp.uint32(1) << (t - 1)
  up = (dropped > half) | ((dropped == half) & ((rem != 0) | ((keep & 1) != 0)))
  keep = keep + up.astype(jnp.uint32)
  carry = keep >> 24
  return jnp.where(carry != 0, keep >> 1, keep), carry


def divide_rn(a: jax.Array, divisor: float) -> jax.Array:
  """``a / divisor`` correctly rounded (RNE) in FP32, for a constant divisor.

  XLA rewrites a division by a constant (or by any broadcast scalar) into a
  multiplication by its FP32 reciprocal, which is 1 ulp off the quotient for
  about half of all ``a`` when the divisor is not a power of two (448, say).
  This divides the 24-bit significand of ``a`` by the divisor's odd part in
  integer arithmetic (exact on every platform) and rounds the quotient to
  nearest even from its remainder. Positive normal ``a`` with a normal
  quotient take this path; zero, subnormal, non-finite or out-of-range values
  fall back to the plain division.

  Args:
    a: FP32 array.
    divisor: positive finite Python number whose odd part is below 128
      (every element format's max is: 448 = 7 * 2**6, 57344 = 7 * 2**13,
      240 = 15 * 2**4, ...).

  Example:
    >>> import jax.numpy as jnp
    >>> a = jnp.float32(3.0)
    >>> bool(divide_rn(a, 448.0) == np.float32(3.0) / np.float32(448.0))
    True
  """
  a = jnp.asarray(a, jnp.float32)
  n, k = _odd_part(divisor, "divide_rn")  # divisor = n * 2**k, n odd
  if n == 1:
    return a * (2.0**-k)  # a power of two: exact
  bits = _bits(a)
  ea = ((bits >> 23) & 0xFF).astype(jnp.int32)
  sig = (bits & 0x7FFFFF) | 0x800000  # a = sig * 2**(ea - 150)
  # sig * 2**s / n has 25 or 26 bits (n in (2**(b-1), 2**b)); the numerator
  # stays below 2**(25 + b) <= 2**32.
  s = n.bit_length() + 1
  wide = sig << s
  q = wide // n
  rem = wide - q * n
  t = jnp.where(q >= (1 << 25), 2, 1).astype(jnp.uint32)
  keep, carry = _round_quotient(q, t, rem)
  e = ea - k - s + t.astype(jnp.int32) + carry.astype(jnp.int32)
  exact = _from_bits((e.astype(jnp.uint32) << 23) | (keep & 0x7FFFFF))
  fast = (ea >= 1) & (ea <= 254) & (e >= 1) & (e <= 254)
  return jnp.where(fast, exact, a / divisor)


def rdivide_rn(numerator: float, b: jax.Array) -> jax.Array:
  """``numerator / b`` correctly rounded (RNE) in FP32, for a constant numerator.

  XLA:CPU divides with the IEEE instruction, so the CPU lowering is the plain
  division. XLA:GPU lowers an FP32 division to PTX ``div.full.f32`` (an
  approximation within 2 ulp), not the IEEE ``div.rn.f32`` that Transformer
  Engine's ``__fdiv_rn`` is, so CUDA and ROCm divide in FP64 and round to
  FP32 (`qlayers.wide_divide.rdivide_wide`, exact for these numerators), and
  any other platform long-divides in integer steps (`rdivide_rn_integer`).
  The branches are chosen by ``lax.platform_dependent``: a program lowered
  for one platform holds only its own.

  Args:
    numerator: positive finite Python number with an odd part below 128
      (448, 57344, 240, 1.0, ...).
    b: FP32 array.

  Example:
    >>> import jax.numpy as jnp
    >>> rdivide_rn(448.0, jnp.float32(3.0))
    Array(149.33333, dtype=float32)
  """
  n, k = _odd_part(numerator, "rdivide_rn")
  b = jnp.asarray(b, jnp.float32)

  def cpu(b):
    # |q| < 2**-126 needs b > numerator * 2**126, and b < 2**128: only a
    # numerator below 4 can give a subnormal quotient.
    if numerator >= 4:
      return numerator / b
    if n == 1:
      # numerator = 2**k: |fl(2**k / b)| < 2**-126 exactly when |b| >
      # 2**(k + 126) (just above, the quotient is within 2**-172 of the
      # largest subnormal), so such b become +-Inf and the division gives
      # the signed zero itself; the flush then fuses into the division
      # instead of into each consumer of the quotient.
      b = jnp.where(jnp.abs(b) > 2.0**(k + 126), b * jnp.inf, b)
      return numerator / b
    return _flush_subnormal(numerator / b)

  gpu = functools.partial(wide_divide.rdivide_wide, numerator)
  return jax.lax.platform_dependent(
      b, cpu=cpu, cuda=gpu, rocm=gpu,
      default=functools.partial(rdivide_rn_integer, numerator))


def _flush_subnormal(v: jax.Array) -> jax.Array:
  """``v`` with subnormals replaced by signed zeros.

  XLA:CPU computes with subnormals flushed, but a quotient that LLVM folds
  at compile time (``1 / select(c, FLT_MAX, x)`` becomes a select of
  ``1 / FLT_MAX``) keeps its subnormal; this makes both read as zero.
  """
  return jnp.where(jnp.abs(v) < _F32_TINY, v * 0.0, v)


def rdivide_rn_integer(numerator: float, b: jax.Array) -> jax.Array:
  """`rdivide_rn` on any platform, from integer operations only.

  Long-divides ``n * 2**48`` (``numerator = n * 2**k``, ``n`` odd) by the
  24-bit significand of ``b`` in base-256 integer steps and rounds to nearest
  even from the remainder: the IEEE quotient wherever the platform's own
  division is not. Positive normal ``b`` with a normal quotient take this
  path; anything else (negative, zero, subnormal, non-finite, an overflowing
  or subnormal quotient) falls back to the plain division.
  """
  n, k = _odd_part(numerator, "rdivide_rn")
  b = jnp.asarray(b, jnp.float32)
  bits = _bits(b)
  eb = ((bits >> 23) & 0xFF).astype(jnp.int32)
  sig = (bits & 0x7FFFFF) | 0x800000  # b = sig * 2**(eb - 150)
  # q = floor(n * 2**48 / sig), one base-256 digit at a time: remainders stay
  # below 2**24, so (rem << 8) fits uint32; q < 2n * 2**24 < 2**32.
  rem = jnp.full(sig.shape, n << 24, jnp.uint32)
  q = jnp.zeros(sig.shape, jnp.uint32)
  for i in range(4):
    if i:
      rem = rem << 8
    digit = rem // sig
    rem = rem - digit * sig
    q = (q << 8) | digit
  t = (8 - jax.lax.clz(q)).astype(jnp.uint32)  # bits beyond 24: 1..8
  keep, carry = _round_quotient(q, t, rem)
  # numerator / b = q * 2**(k - eb + 102), q ~ keep * 2**(t + carry).
  e = t.astype(jnp.int32) + carry.astype(jnp.int32) + k - eb + 252
  exact = _from_bits((e.astype(jnp.uint32) << 23) | (keep & 0x7FFFFF))
  positive = (bits >> 31) == 0
  fast = positive & (eb >= 1) & (eb <= 254) & (e >= 1) & (e <= 254)
  return jnp.where(fast, exact, numerator / b)


def te_multiplier(amax_value: jax.Array, fmt: Format, *, margin: int = 0,
                  pow2: bool = False, divide=None) -> jax.Array:
  """Transformer Engine's quantization multiplier ``s`` (payload ``x * s``).

  ``s = (max / amax) / 2**margin`` with one correctly rounded FP32 division,
  as TE computes it (transformer_engine/common/recipe/recipe_common.cuh,
  ``compute_scale_from_amax``: ``__fdiv_rn(max_fp8, amax)``; the delayed
  recipe's ``fp8_max / amax / 2**margin``). ``pow2`` clears the mantissa
  bits, rounding ``s`` down to a power of two, as TE does. A zero amax gives
  ``s = 1``; an amax so small that ``max / amax`` overflows gives the FP32
  max (TE's ``value_for_inf``); a non-finite amax (the unit holds Inf or
  NaN) gives NaN, which makes the payload, and any GEMM of it, non-finite.
  ``divide(numerator, b)`` is the correctly rounded division (default
  `rdivide_rn`; a kernel passes its own).

  Example:
    >>> from qlayers import formats
    >>> te_multiplier(224.0, formats.E4M3), te_multiplier(0.0, formats.E4M3)
    (Array(2., dtype=float32), Array(1., dtype=float32))
  """
  if not 0 <= margin <= MAX_MARGIN:
    raise ValueError(f"margin must be in [0, {MAX_MARGIN}], got {margin}.")
  a = jnp.asarray(amax_value, jnp.float32)
  # Special amaxes are replaced before the division, so the quotient needs
  # one clamp: zero by max * 2**-margin (then s = 2**margin * 2**-margin = 1
  # exactly), Inf/NaN by NaN (XLA's min propagates NaN). An amax is never
  # negative; for one the clamp leaves -Inf (max / -tiny) as it is.
  a0 = jnp.where(a == 0, fmt.max * 2.0**-margin, a)
  if not pow2:
    a0 = jnp.where(jnp.isfinite(a), a0, jnp.nan)
  s = (divide or rdivide_rn)(fmt.max, a0)
  s = jnp.minimum(s * (2.0**-margin), F32_MAX)  # / 2**margin, exactly
  if pow2:
    # Clearing the mantissa would turn a NaN into Inf: NaN comes after.
    s = _from_bits(_bits(s) & jnp.uint32(0xFF800000))
    s = jnp.where(jnp.isfinite(a), s, jnp.nan)
  return s


def te_scale(amax_value: jax.Array, fmt: Format, *, margin: int = 0,
             pow2: bool = False) -> jax.Array:
  """TE per-tensor scale as a dequantization factor: ``1 / te_multiplier``.

  This is TE's ``scale_inv`` (FP32 reciprocal of the multiplier); 1 for a
  zero amax, NaN for a non-finite one.

  Example:
    >>> from qlayers import formats
    >>> te_scale(896.0, formats.E4M3, margin=1)
    Array(4., dtype=float32)
  """
  return rdivide_rn(1.0, te_multiplier(amax_value, fmt, margin=margin,
                                       pow2=pow2))


def deepseek_scale(a: jax.Array, fmt: Format, pow2: bool) -> jax.Array:
  """DeepSeek-V3 tile/block scale ``max(amax, 1e-4) / max`` (dequantization
  factor), correctly rounded, as DeepGEMM's reference casts compute it
  (deep_gemm/utils/math.py: ``amax.clamp(1e-4) / 448.0``); ``pow2``: rounded
  up to a power of two (UE8M0). NaN for a unit holding Inf or NaN.

  Example:
    >>> from qlayers import formats
    >>> deepseek_scale(896.0, formats.E4M3, pow2=False)
    Array(2., dtype=float32)
    >>> deepseek_scale(0.0, formats.E4M3, pow2=True)  # 1e-4 / 448, up
    Array(2.3841858e-07, dtype=float32)
  """
  s = divide_rn(jnp.maximum(a, DEEPSEEK_AMAX_FLOOR), fmt.max)
  if pow2:
    s = _pow2_ceil(s)
  return jnp.where(jnp.isfinite(a), s, jnp.nan)


def mx_scale_codes(amax_value: jax.Array, fmt: Format,
                   rule: str = "mx_rceil", dtype=jnp.uint8) -> jax.Array:
  """E8M0 codes (uint8, or ``dtype``) of MX block scales from per-block amax.

  FLOOR (OCP MX v1.0 sec. 6.3): ``e = floor(log2 amax) - emax_elem``.
  RCEIL: ``e = ceil(log2(amax / max))``: the exponent of ``amax / max``,
  plus one when its mantissa is non-zero. Both are read off the bits of
  ``amax`` (and of the constant ``max``): ``amax / max`` is never formed, so
  a quotient below the FP32 normal range (amax under ~5e-36 for E4M3, which
  XLA:CPU flushes to zero) cannot lose its exponent. For a normal quotient
  this is the FP32-quotient rule exactly: ``fl(amax / max) > 2**k`` iff
  ``amax > max * 2**k``. Exponents clamp to [-127, 127]; zero blocks get
  code 0 (2**-127); Inf/NaN blocks get 0xFF.

  Example:
    >>> import jax.numpy as jnp
    >>> from qlayers import formats
    >>> a = jnp.array([480.0, 448.0, 0.0, jnp.inf])
    >>> mx_scale_codes(a, formats.E4M3, "mx_rceil")
    Array([128, 127,   0, 255], dtype=uint8)
    >>> mx_scale_codes(a, formats.E4M3, "mx_floor")
    Array([127, 127,   0, 255], dtype=uint8)
  """
  bits = _bits(amax_value)
  eb = (bits >> 23) & 0xFF  # biased: floor(log2 a) + 127; 0 for zero
  # code = max(e + 127, 0) with e the unbiased scale exponent, in unsigned
  # arithmetic: max(eb + d, k) - k for e + 127 = eb + d - k. A finite amax
  # never reaches the upper clamp (eb <= 254, k >= 2: every element format's
  # max is at least 4), and zero or subnormal amaxes (eb = 0) give code 0.
  if rule == "mx_floor":
    k = fmt.emax
    code = jnp.maximum(eb, k) - k
  elif rule == "mx_rceil":
    k, m_max = _f32_fields(fmt.max)
    above = ((bits & 0x7FFFFF) > m_max).astype(jnp.uint32)
    code = jnp.maximum(eb + above, k) - k
  else:
    raise ValueError(f"{rule!r} is not an MX scale rule.")
  code = jnp.where(eb == 255, 255, code)  # Inf or NaN
  return code.astype(dtype)


def e8m0_decode(codes: jax.Array) -> jax.Array:
  """FP32 values ``2**(code - 127)``, from bits; code 0xFF is NaN.

  Never ``astype(float8_e8m0fnu)`` a float: that rounds to nearest and maps 0
  to NaN. Code 0 is the FP32 subnormal 2**-127, which XLA:CPU reads as 0, so
  on CPU a block scaled by it (amax below ~2**-118) dequantizes to zeros.

  Example:
    >>> import jax.numpy as jnp
    >>> e8m0_decode(jnp.array([127, 128, 124, 255], jnp.uint8))
    Array([1.   , 2.   , 0.125,   nan], dtype=float32)
  """
  c = codes.astype(jnp.uint32)
  return jnp.where(c == 255, jnp.nan, _from_bits(_e8m0_bits(c)))


def _e8m0_bits(c: jax.Array) -> jax.Array:
  """FP32 bits of ``2**(c - 127)`` for uint32 ``c`` in [0, 254]: the exponent
  field ``c``, or for code 0 the subnormal 2**-127 (0x400000, the only
  pattern below 0x800000 that it can be)."""
  return jnp.maximum(c << 23, jnp.uint32(0x400000))


def _materialized(*values: jax.Array) -> tuple[jax.Array, ...]:
  """``values`` behind an optimization barrier off CPU.

  Without the barrier XLA clones a scale's chain (the amax history's
  reduction, the two divisions) into every fusion that reads the scale.
  Behind it they are one small fusion whose results the casts read: for an
  H200 target a 1-block fp8_delayed train step has 5,061 optimized HLO
  instructions instead of 5,495 (and did 8,426 instead of 12,633 while the
  divisions were `rdivide_rn_integer`'s). Values are unchanged.
  """
  return jax.lax.platform_dependent(
      *values, cpu=lambda *v: v,
      default=lambda *v: jax.lax.optimization_barrier(v))


# Jitted so that an eager `quantize` compiles the scale rule once per (grid
# shape, spec) rather than each of its integer steps; inlined under jit.
@functools.partial(jax.jit, static_argnums=1)
def unit_scales(a: jax.Array, spec) -> tuple[jax.Array, jax.Array]:
  """(multiplier applied to ``x``, stored scale) per scaling unit of amax ``a``
  under ``spec`` (a `qlayers.scaling.QuantSpec`).

  * ``te``: multiplier ``s`` = `te_multiplier`, stored ``1 / s`` (TE's
    ``scale_inv``).
  * ``deepseek``: stored ``s`` = `deepseek_scale`, multiplier ``1 / s``
    (DeepGEMM's casts: ``x * (1.0 / sf)``; DeepSeek-V3's inference kernel
    divides, ``x / s``, which can differ by 1 ulp before the cast).
  * MX: stored E8M0 code, multiplier ``2**-e`` (exact); 0 for a NaN code (the
    scale carries the NaN).

  Example:
    >>> import jax.numpy as jnp
    >>> from qlayers.scaling import QuantSpec
    >>> unit_scales(jnp.float32(224.0), QuantSpec(format="e4m3"))
    (Array(2., dtype=float32), Array(0.5, dtype=float32))
  """
  fmt = spec.fmt
  if spec.scale_rule == "te":
    mult = te_multiplier(a, fmt, margin=spec.margin, pow2=spec.pow2)
    return _materialized(mult, rdivide_rn(1.0, mult))
  if spec.scale_rule == "deepseek":
    scale = deepseek_scale(a, fmt, spec.pow2)
    return _materialized(rdivide_rn(1.0, scale), scale)
  codes = mx_scale_codes(a, fmt, spec.scale_rule)
  # 2**-e = 2**(127 - code), the E8M0 value of code 254 - code, exact; code
  # 255 wraps around (uint32) and is replaced.
  mult = _from_bits(_e8m0_bits(254 - codes.astype(jnp.uint32)))
  return jnp.where(codes == 255, 0.0, mult), codes


# NVFP4: the per-tensor encode scale maps the tensor's amax to the largest
# E4M3 block scale times the largest E2M1 element.
NVFP4_RANGE = 448.0 * 6.0
F32_SIXTH = np.float32(1.0 / 6.0)


def nvfp4_encode_scale(tensor_amax: jax.Array) -> jax.Array:
  """NVFP4's per-tensor (second-level) FP32 encode scale ``S_enc``.

  ``S_enc = min(448 * 6 / amax, FLT_MAX)`` (one correctly rounded FP32
  division), and 1 where ``amax`` is 0 or ``S_enc`` is 0 (an infinite
  amax): Transformer Engine's ``compute_global_encode_scaling_factor_FP4``
  (transformer_engine/common/cast/nvfp4/core_nvfp4.cuh); the paper's
  (arXiv 2509.25149, appendix B) ``s_enc = 6 * 448 / amax_x``.

  Example:
    >>> import jax.numpy as jnp
    >>> nvfp4_encode_scale(jnp.array([2688.0, 0.0]))
    Array([1., 1.], dtype=float32)
  """
  a = jnp.asarray(tensor_amax, jnp.float32)
  s = jnp.minimum(rdivide_rn(NVFP4_RANGE, a), F32_MAX)
  return jnp.where((a == 0) | (s == 0), 1.0, s)


@jax.jit
def nvfp4_scales(block_amax: jax.Array, tensor_amax: jax.Array
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(multiplier applied to ``x``, stored FP32 scale, E4M3 block scale) per
  16-element block of amax ``block_amax`` in a tensor of amax ``tensor_amax``.

  Transformer Engine's NVFP4 quantizer, step by step (core_nvfp4.cuh):

  * ``S_enc`` = `nvfp4_encode_scale` (tensor amax), ``S_dec = 1 / S_enc``;
  * block decode scale ``e4m3(block_amax * (S_enc * fl(1/6)))``, a
    saturating round-to-nearest-even cast (``compute_decoding_scaling_factor``;
    the paper writes ``e4m3(amax_b / 6 * s_enc)``, which can differ by one
    FP32 rounding before the cast: TE's order is followed);
  * block encode multiplier ``min(1 / (float(e4m3) * S_dec), FLT_MAX)``
    (``compute_scaling_coefficient<float>``; the paper's ``s_enc,b``), and
    the payload is ``e2m1(x * multiplier)`` (RNE or stochastic, saturating).

  The stored scale is the dequantization factor ``float(e4m3) * S_dec`` in
  FP32: the per-tensor decode factor is folded into each block's scale (a
  native GEMM applies it once to the output instead; the products differ
  by FP32 rounding only). A block, or tensor, whose amax is not finite gets
  a NaN scale (and multiplier 0), so its GEMMs are non-finite.

  Example:
    >>> import jax.numpy as jnp
    >>> mult, scale, e4m3 = nvfp4_scales(jnp.array([6.0, 3.0]),
    ...                                  jnp.float32(6.0))
    >>> e4m3.tolist(), scale.tolist(), mult.tolist()
    ([448.0, 224.0], [1.0, 0.5], [1.0, 2.0])
  """
  s_enc = nvfp4_encode_scale(tensor_amax)
  s_dec = rdivide_rn(1.0, s_enc)
  block = block_amax.astype(jnp.float32) * (s_enc * F32_SIXTH)
  e4m3 = formats.saturate(block, formats.E4M3).astype(jnp.float8_e4m3fn)
  e4m3 = e4m3.astype(jnp.float32)
  scale = e4m3 * s_dec
  mult = jnp.minimum(rdivide_rn(1.0, scale), F32_MAX)
  finite = jnp.isfinite(block_amax) & jnp.isfinite(tensor_amax)
  return (jnp.where(finite, mult, 0.0), jnp.where(finite, scale, jnp.nan),
          jnp.where(finite, e4m3, jnp.nan))
