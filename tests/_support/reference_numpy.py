"""An independent NumPy reference of the quantization numerics (NumPy and
ml_dtypes only; nothing from qlayers).

Written from the specifications, not from qlayers' code:

* Element formats and their rounding: ml_dtypes (round to nearest even),
  after clipping to +-max (a saturating cast).
* Per-tensor / row scales: Transformer Engine. Multiplier
  ``s = (max / amax) / 2**margin`` as one IEEE FP32 division
  (transformer_engine/common/recipe/recipe_common.cuh,
  ``compute_scale_from_amax``; recipe/delayed_scaling.cu), ``s = 1`` for a
  zero amax, the FP32 max when ``max / amax`` overflows, mantissa cleared for
  power-of-two scales; payload ``sat(x * s)``; stored ``1 / s`` (TE's
  ``scale_inv``). A non-finite amax gives NaN (qlayers' rule for operands
  holding Inf/NaN).
* Tile / block scales: DeepSeek-V3 / DeepGEMM (deep_gemm/utils/math.py,
  ``per_token_cast_to_fp8``): ``sf = max(amax, 1e-4) / 448`` in FP32,
  UE8M0: rounded up to a power of two; payload ``x * (1 / sf)``.
* MX: OCP MX v1.0 sec. 6.3 (FLOOR: ``2**(floor(log2 amax) - emax_elem)``)
  and RCEIL (``2**ceil(log2(amax / max))``, the rule of TE and cuBLAS), both
  evaluated here in exact arithmetic (float64 frexp), exponents clamped to
  [-127, 127], zero blocks code 0, Inf/NaN blocks code 0xFF.
* NVFP4: Transformer Engine's NVFP4 quantizer
  (transformer_engine/common/cast/nvfp4/core_nvfp4.cuh): per-tensor encode
  scale ``S_enc = min(448 * 6 / amax, FLT_MAX)`` (1 for a zero or infinite
  amax), ``S_dec = 1 / S_enc``; per block of 16 the E4M3 decode scale
  ``e4m3(block_amax * (S_enc * fl(1/6)))`` (saturating, RNE) and the
  multiplier ``min(1 / (e4m3 * S_dec), FLT_MAX)``; payload
  ``e2m1(x * multiplier)``; stored FP32 scale ``e4m3 * S_dec``.
* Packing: E2M1 two codes per byte (element 2i in the low nibble), FP6 four
  codes per three bytes (the 24-bit little-endian word
  ``v0 | v1 << 6 | v2 << 12 | v3 << 18``).

``ftz=True`` models a platform that treats FP32 subnormals as zero (XLA on
CPU): inputs, stored scales and dequantized values below 2**-126 read as
signed zeros.
"""

import math

import ml_dtypes
import numpy as np

F32_TINY = np.float32(2.0**-126)
F32_MAX = np.finfo(np.float32).max

_DTYPES = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "e3m2": ml_dtypes.float6_e3m2fn,
    "e2m3": ml_dtypes.float6_e2m3fn,
    "e2m1": ml_dtypes.float4_e2m1fn,
}
BITS = {"e4m3": 8, "e5m2": 8, "e4m3fnuz": 8, "e5m2fnuz": 8, "e3m2": 6,
        "e2m3": 6, "e2m1": 4}


def fmt_max(fmt: str) -> float:
  return float(ml_dtypes.finfo(_DTYPES[fmt]).max)


def fmt_emax(fmt: str) -> int:
  return math.floor(math.log2(fmt_max(fmt)))


def flush(v, ftz: bool):
  """FP32 subnormals to signed zero when ``ftz``."""
  v = np.asarray(v, np.float32)
  if not ftz:
    return v
  return np.where(np.abs(v) < F32_TINY, np.copysign(np.float32(0), v), v)


def cast_codes(v, fmt: str) -> np.ndarray:
  """Saturating RNE cast of FP32 ``v`` to ``fmt``: one uint8 code each."""
  m = np.float32(fmt_max(fmt))
  v = np.asarray(v, np.float32)
  with np.errstate(invalid="ignore"):
    clipped = np.where(np.isnan(v), v, np.clip(v, -m, m))
  return clipped.astype(_DTYPES[fmt]).view(np.uint8)


def decode(codes, fmt: str) -> np.ndarray:
  """FP64 values of uint8 codes (the low BITS[fmt] bits)."""
  return np.asarray(codes, np.uint8).view(_DTYPES[fmt]).astype(np.float64)


# ----------------------------------------------------------------------------
# Scale rules, per unit amax (FP32 arrays)


def te(amax, fmt: str, margin: int = 0, pow2: bool = False):
  """(multiplier s, stored scale 1/s), FP32."""
  a = np.asarray(amax, np.float32)
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    s = np.float32(fmt_max(fmt)) / a
    s = (s / np.float32(2.0**margin)).astype(np.float32)
    s = np.where(np.isinf(s), F32_MAX, s).astype(np.float32)
    if pow2:
      m, e = np.frexp(s.astype(np.float64))
      s = np.where(np.isfinite(s), np.ldexp(1.0, e - 1), s).astype(np.float32)
    s = np.where(a == 0, np.float32(1), s)
    s = np.where(np.isfinite(a), s, np.float32(np.nan)).astype(np.float32)
    return s, (np.float32(1) / s).astype(np.float32)


def deepseek(amax, fmt: str, pow2: bool = False):
  """(multiplier 1/sf, stored sf), FP32."""
  a = np.asarray(amax, np.float32)
  with np.errstate(invalid="ignore", over="ignore"):
    sf = (np.maximum(a, np.float32(1e-4)) / np.float32(fmt_max(fmt)))
    sf = sf.astype(np.float32)
    if pow2:
      m, e = np.frexp(sf.astype(np.float64))
      sf = np.where(m == 0.5, sf, np.ldexp(1.0, e)).astype(np.float32)
    sf = np.where(np.isfinite(a), sf, np.float32(np.nan)).astype(np.float32)
    return (np.float32(1) / sf).astype(np.float32), sf


def mx_exponent(amax, fmt: str, rule: str) -> np.ndarray:
  """Unclamped shared exponent (int64) of finite, non-zero amax."""
  a = np.asarray(amax, np.float64)
  if rule == "mx_floor":
    _, e = np.frexp(a)  # a = m * 2**e, m in [0.5, 1): floor(log2 a) = e - 1
    return (e - 1 - fmt_emax(fmt)).astype(np.int64)
  # a / max in float64 is exactly 2**k only when it is one: ceil is exact.
  m, e = np.frexp(a / fmt_max(fmt))
  return np.where(m == 0.5, e - 1, e).astype(np.int64)


def mx_codes(amax, fmt: str, rule: str) -> np.ndarray:
  a = np.asarray(amax, np.float32)
  finite = np.isfinite(a)
  safe = np.where(finite & (a > 0), a, np.float32(1))
  code = np.clip(mx_exponent(safe, fmt, rule), -127, 127) + 127
  code = np.where(a == 0, 0, code)
  code = np.where(finite, code, 255)
  return code.astype(np.uint8)


def nvfp4(amax, tensor_amax):
  """(multiplier, stored FP32 scale, E4M3 block scale) per block, FP32."""
  a = np.float32(tensor_amax)
  b = np.asarray(amax, np.float32)
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    s_enc = np.minimum(np.float32(448.0 * 6.0) / a, F32_MAX)
    if a == 0 or s_enc == 0:
      s_enc = np.float32(1)
    s_dec = np.float32(1) / s_enc
    block = (b * (s_enc * np.float32(1 / 6))).astype(np.float32)
    e4m3 = decode(cast_codes(block, "e4m3"), "e4m3").astype(np.float32)
    scale = (e4m3 * s_dec).astype(np.float32)
    mult = np.minimum(np.float32(1) / scale, F32_MAX).astype(np.float32)
  finite = np.isfinite(b) & np.isfinite(a)
  return (np.where(finite, mult, np.float32(0)),
          np.where(finite, scale, np.float32(np.nan)),
          np.where(finite, e4m3, np.float32(np.nan)))


# ----------------------------------------------------------------------------
# Quantize / dequantize


def _units(shape, granularity: str, axis: int, block_size: int):
  """Per-dim unit lengths (the scale grid is shape / unit, padded up)."""
  ndim = len(shape)
  unit = [1] * ndim
  if granularity == "tensor":
    return list(shape)
  if granularity == "row":
    unit[axis] = shape[axis]
    return unit
  unit[axis] = block_size
  if granularity == "block":
    other = ndim - 2 if axis == ndim - 1 else ndim - 1
    unit[other] = block_size
  return unit


def _grid(x, unit):
  """(x padded with zeros to multiples of unit, view of shape
  (g0, u0, g1, u1, ...))."""
  padded = [-(-n // u) * u for n, u in zip(x.shape, unit)]
  xp = np.zeros(padded, np.float32)
  xp[tuple(slice(0, n) for n in x.shape)] = x
  dims = []
  for n, u in zip(padded, unit):
    dims += [n // u, u]
  return xp, xp.reshape(dims)


def quantize(x, fmt: str, granularity: str = "tensor", axis: int = -1, *,
             rule: str | None = None, margin: int = 0, pow2: bool = False,
             block_size: int | None = None, tensor_amax=None,
             ftz: bool = False):
  """Reference quantization of FP32 ``x``.

  Returns ``(codes, scale)``: one uint8 code per element of the padded
  tensor, and the scales as a keep-dims grid (FP32, or uint8 E8M0 codes for
  MX); per tensor a 0-d scale.
  """
  x = flush(np.asarray(x, np.float32), ftz)
  axis %= x.ndim
  rule = rule or {"tensor": "te", "row": "te", "tile": "deepseek",
                  "block": "deepseek", "mx": "mx_rceil"}[granularity]
  block_size = block_size or (16 if rule == "nvfp4" else
                              {"mx": 32}.get(granularity, 128))
  unit = _units(x.shape, granularity, axis, block_size)
  xp, g = _grid(x, unit)
  unit_axes = tuple(range(1, 2 * x.ndim, 2))
  with np.errstate(invalid="ignore"):
    amax = np.max(np.abs(g), axis=unit_axes, keepdims=True)  # NaN propagates
  if tensor_amax is not None and rule != "nvfp4":
    amax = np.full_like(amax, np.float32(tensor_amax))
  if rule == "nvfp4":  # tensor_amax: the second level's (default: max |x|)
    with np.errstate(invalid="ignore"):
      t = np.max(np.abs(xp)) if tensor_amax is None else tensor_amax
    mult, scale, _ = nvfp4(amax, t)
  elif rule == "te":
    mult, scale = te(amax, fmt, margin, pow2)
    scale = flush(scale, ftz)
  elif rule == "deepseek":
    mult, scale = deepseek(amax, fmt, pow2)
  else:
    scale = mx_codes(amax, fmt, rule)
    e = scale.astype(np.int64) - 127
    mult = np.where(scale == 255, 0.0, np.ldexp(1.0, -e))
  with np.errstate(invalid="ignore", over="ignore"):
    scaled = (g.astype(np.float64) * mult).astype(np.float32) \
        if rule.startswith("mx") else (g * mult).astype(np.float32)
  codes = cast_codes(flush(scaled, ftz), fmt).reshape(xp.shape)
  grid_shape = [d for i, d in enumerate(g.shape) if i % 2 == 0]
  scale = scale.reshape(grid_shape)
  if granularity == "tensor":
    scale = scale.reshape(())
  return codes, scale


def dequantize(codes, scale, fmt: str, shape, granularity: str, axis=-1,
               block_size=None, ftz: bool = False):
  """FP32 ``decode(codes) * scale`` (one FP32 multiply), cropped to
  ``shape`` (NVFP4: FP32 scales, ``block_size=16``)."""
  codes = np.asarray(codes, np.uint8)
  values = decode(codes, fmt).astype(np.float32)
  if granularity == "mx":
    s = np.asarray(scale).astype(np.int64)
    scale = np.where(s == 255, np.nan, np.ldexp(1.0, s - 127))
  scale = flush(np.asarray(scale, np.float32), ftz)
  if granularity == "tensor":
    with np.errstate(invalid="ignore", over="ignore"):
      out = values * scale
  else:
    axis %= len(shape)
    block_size = block_size or {"mx": 32}.get(granularity, 128)
    unit = _units(shape, granularity, axis, block_size)
    dims = []
    for n, u in zip(codes.shape, unit):
      dims += [n // u, u]
    s = scale.reshape([d for i, d in enumerate(dims) if i % 2 == 0])
    s = s.reshape([d if i % 2 == 0 else 1 for i, d in enumerate(dims)])
    with np.errstate(invalid="ignore", over="ignore"):
      out = (values.reshape(dims) * s).reshape(codes.shape)
  out = flush(out.astype(np.float32), ftz)
  return out[tuple(slice(0, n) for n in shape)]


# ----------------------------------------------------------------------------
# Packing


def pack(codes, fmt: str) -> np.ndarray:
  """Packs one code per element along the last axis (see module doc)."""
  c = np.asarray(codes, np.uint32)
  lead = c.shape[:-1]
  if BITS[fmt] == 4:
    pairs = c.reshape(*lead, -1, 2)
    return ((pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)).astype(
        np.uint8).reshape(*lead, -1)
  quads = c.reshape(*lead, -1, 4) & 0x3F
  word = quads[..., 0] | quads[..., 1] << 6 | quads[..., 2] << 12 \
      | quads[..., 3] << 18
  out = np.stack([(word >> (8 * i)) & 0xFF for i in range(3)], axis=-1)
  return out.astype(np.uint8).reshape(*lead, -1)
