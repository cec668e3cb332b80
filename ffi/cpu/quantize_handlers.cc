// XLA FFI handlers for per-tensor FP8 quantization on CPU: the two passes of
// `qlayers.scaling.quantize` for granularity "tensor" with Transformer
// Engine's scale rule, one custom call each instead of a chain of XLA
// fusions, with the same bits as that chain's CPU lowering.
//
// QlayersAmax (x f32 / bf16 / f16 of any shape -> f32 scalar):
//   max |x| as `scaling.amax` takes it: an integer max over the magnitude
//   bits (exact, subnormals included), +Inf when x holds Inf or NaN, 0 for
//   an empty x.
//
// QlayersQuantizeFp8Tensor (x, amax f32 scalar -> payload fp8 of x's shape,
//   scale f32 scalar; attributes margin (int), pow2 (bool)):
//   s       = `scaling.te_multiplier(amax, fmt, margin, pow2)`
//   scale   = 1 / s, as `scaling.rdivide_rn(1.0, s)` computes it on CPU
//   payload = RNE(clip(x * s, -max, max)) in the format of the payload's
//             dtype (float8_e4m3fn, float8_e5m2 or their fnuz variants);
//             x * s is rounded to f32 first, NaN stays NaN, and a NaN s
//             (a non-finite amax) makes every element the positive NaN.
//
// QlayersQuantizeFp8Delayed (x, history f32 (H,), running f32 scalar ->
//   payload, scale, amax f32 scalar, running f32 scalar; attributes margin,
//   pow2): one use of a delayed-scaling role, `scaling.delayed_amax` with
//   the history max (as QlayersMaxF32) and the operand's amax (as
//   QlayersAmax), then QlayersQuantizeFp8Tensor with the amax it chose.
//   The scalar logic follows XLA:CPU's: its `maximum` reads subnormal
//   operands as zeros of their sign (so a running amax below 2^-126 is
//   recorded as 0) and puts +0 above -0; `stored > 0` is false for a
//   subnormal stored amax.
//
// QlayersMaxF32 (x f32 of any shape -> f32 scalar): max(x) as a float max
//   (negative values included), NaN if x holds a NaN, -Inf for an empty x:
//   the value delayed scaling compares with zero (`scaling.history_amax`).
//
// QlayersQuantizeMx (x (R, C) f32 / bf16 / f16 -> payload fp8 (R, C) padded
//   to whole blocks along `axis`, codes uint8 E8M0 one per block; attributes
//   axis (0 or 1), block (32), rceil (bool: RCEIL, else FLOOR)):
//   `scaling.quantize` with granularity "mx": per block amax as above, code
//   from its f32 bits (`scaling.mx_scale_codes`), multiplier 2^(127 - code)
//   (0 for the NaN code 0xFF), payload RNE(clip(x * multiplier)); padding
//   is zeros.
//
// XLA:CPU runs its executables with flush-to-zero and denormals-are-zero
// (a subnormal amax reads as zero there), so both handlers compute under
// the same mode.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string_view>
#include <vector>

#include "../common/elem_format.h"
#include "../common/ffi_util.h"
#include "numerics.h"
#include "parallel.h"

namespace qlayers::cpu {
namespace {

constexpr std::string_view kOpAmax = "qlayers_amax";
constexpr std::string_view kOpQuantize = "qlayers_quantize_fp8_tensor";
constexpr std::string_view kOpMax = "qlayers_max_f32";
constexpr std::string_view kOpMx = "qlayers_quantize_mx";
constexpr std::string_view kOpDelayed = "qlayers_quantize_fp8_delayed";
// Elements per thread below which a pass stays on the calling thread.
constexpr double kPerThread = 1 << 16;

// IEEE binary16 -> f32, exact (f16 subnormals are f32 normals).
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0x1F) return BitsFloat(sign | 0x7F800000u | (m << 13));
  if (e != 0) return BitsFloat(sign | ((e + 112u) << 23) | (m << 13));
  // Subnormal: m * 2^-24, exact in f32.
  const float v = static_cast<float>(m) * 5.9604644775390625e-8f;
  return sign ? -v : v;
}

enum class Wide { kF32, kBF16, kF16 };

ffi::Error WideInput(std::string_view op, const ffi::AnyBuffer& x, Wide* w) {
  switch (x.element_type()) {
    case ffi::DataType::F32: *w = Wide::kF32; break;
    case ffi::DataType::BF16: *w = Wide::kBF16; break;
    case ffi::DataType::F16: *w = Wide::kF16; break;
    default:
      return InvalidArg(op, "x must be float32, bfloat16 or float16, got ",
                        DtypeName(x.element_type()));
  }
  return ffi::Error::Success();
}

template <typename U>
U MaxBits(const U* x, int64_t n, U magnitude_mask) {
  U m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const U v = x[i] & magnitude_mask;
    m = v > m ? v : m;
  }
  return m;
}

// max |x| from the magnitude bits, in x's own type, then as f32 (exact).
template <typename U>
float AmaxOf(const void* data, int64_t n, U magnitude_mask, U inf_bits,
             float (*to_float)(U)) {
  const U* x = static_cast<const U*>(data);
  const int threads = ThreadsFor(static_cast<double>(n), kPerThread);
  std::vector<U> part(threads, 0);
  ForRanges(n, threads, [&](int64_t b, int64_t e, int t) {
    part[t] = MaxBits(x + b, e - b, magnitude_mask);
  });
  U m = *std::max_element(part.begin(), part.end());
  return to_float(m > inf_bits ? inf_bits : m);  // NaN patterns -> +Inf
}

float F32FromBits(uint32_t u) { return BitsFloat(u); }
float F32FromBf16(uint16_t u) { return Bf16ToFloat(u); }
float F32FromF16(uint16_t u) { return HalfToFloat(u); }

float Amax(const ffi::AnyBuffer& x, Wide w) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  const void* d = x.untyped_data();
  switch (w) {
    case Wide::kF32:
      return AmaxOf<uint32_t>(d, n, 0x7FFFFFFFu, 0x7F800000u, F32FromBits);
    case Wide::kBF16:
      return AmaxOf<uint16_t>(d, n, 0x7FFF, 0x7F80, F32FromBf16);
    case Wide::kF16:
      return AmaxOf<uint16_t>(d, n, 0x7FFF, 0x7C00, F32FromF16);
  }
  return 0.0f;
}

// `scaling.te_multiplier`: s = min((max / a0) * 2^-margin, FLT_MAX) with a0
// the amax (max * 2^-margin for a zero one, NaN for a non-finite one unless
// pow2), pow2 clearing the mantissa. Runs under ScopedFlushSubnormals.
float TeMultiplier(float amax, float fmax, int margin, bool pow2) {
  const float down = std::ldexp(1.0f, -margin);  // exact: margin <= 126
  const bool finite = std::isfinite(amax);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float a0 = amax == 0.0f ? fmax * down : amax;
  if (!pow2 && !finite) a0 = nan;
  float s = fmax / a0;
  s = s * down;
  const float big = std::numeric_limits<float>::max();
  s = std::isnan(s) ? s : (s < big ? s : big);  // XLA's min keeps NaN
  if (pow2) {
    s = BitsFloat(FloatBits(s) & 0xFF800000u);
    if (!finite) s = nan;
  }
  return s;
}

// `scaling.rdivide_rn(1.0, s)` on CPU: |s| > 2^126 gives a zero quotient.
float Reciprocal(float s) {
  const float b = std::fabs(s) > 0x1p126f
                      ? s * std::numeric_limits<float>::infinity()
                      : s;
  return 1.0f / b;
}

QL_ISA_CLONES void EncodeF32(const Fp8Encoder enc, const float* __restrict x,
                             float s, int64_t n, uint8_t* __restrict q) {
  for (int64_t i = 0; i < n; ++i) q[i] = enc(x[i] * s);
}

QL_ISA_CLONES void EncodeBf16(const Fp8Encoder enc,
                              const uint16_t* __restrict x, float s, int64_t n,
                              uint8_t* __restrict q) {
  for (int64_t i = 0; i < n; ++i) q[i] = enc(Bf16ToFloat(x[i]) * s);
}

void EncodeF16(const Fp8Encoder enc, const uint16_t* __restrict x, float s,
               int64_t n, uint8_t* __restrict q) {
  for (int64_t i = 0; i < n; ++i) q[i] = enc(HalfToFloat(x[i]) * s);
}

// max(v) with jnp.max's NaN propagation; -Inf for n == 0.
float MaxF32(const float* v, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    nan |= std::isnan(v[i]);
    m = v[i] > m ? v[i] : m;
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

// `x > 0` under DAZ: positive, not NaN, not subnormal.
bool PositiveNormalOrInf(float v) {
  const uint32_t u = FloatBits(v);
  return !(u & 0x80000000u) && (u & 0x7F800000u) != 0 && !std::isnan(v);
}

ffi::Error AmaxImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  Wide w = Wide::kF32;
  QLAYERS_RETURN_IF_ERROR(WideInput(kOpAmax, x, &w));
  QLAYERS_RETURN_IF_ERROR(ExpectScalarF32(kOpAmax, "output", *out));
  *static_cast<float*>(out->untyped_data()) = Amax(x, w);
  return ffi::Error::Success();
}

ffi::Error MaxImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  QLAYERS_RETURN_IF_ERROR(ExpectDtype(kOpMax, "x", x, ffi::DataType::F32));
  QLAYERS_RETURN_IF_ERROR(ExpectScalarF32(kOpMax, "output", *out));
  *static_cast<float*>(out->untyped_data()) =
      MaxF32(static_cast<const float*>(x.untyped_data()),
             static_cast<int64_t>(x.element_count()));
  return ffi::Error::Success();
}

// Checks a per-tensor quantize's payload against x.
ffi::Error CheckPayload(std::string_view op, const ffi::AnyBuffer& x,
                        const ffi::AnyBuffer& payload, int64_t margin,
                        Elem* elem) {
  auto e = ElemOfFp8Dtype(payload.element_type());
  if (!e) {
    return InvalidArg(op, "the payload must be an fp8 dtype, got ",
                      DtypeName(payload.element_type()));
  }
  auto xd = x.dimensions();
  auto pd = payload.dimensions();
  if (!std::equal(xd.begin(), xd.end(), pd.begin(), pd.end())) {
    return InvalidArg(op, "the payload has shape ", ShapeStr(pd),
                      " but x has shape ", ShapeStr(xd));
  }
  if (margin < 0 || margin > 126) {
    return InvalidArg(op, "margin must be in [0, 126], got ", margin);
  }
  *elem = *e;
  return ffi::Error::Success();
}

// payload = RNE(clip(x * s)) with s = TeMultiplier(amax); returns 1 / s.
float EncodeTensor(const ffi::AnyBuffer& x, Wide w, float amax, Elem elem,
                   int64_t margin, bool pow2, uint8_t* q) {
  const Fp8Encoder enc(elem);
  const int64_t n = static_cast<int64_t>(x.element_count());
  float s = 0.0f, scale = 0.0f;
  {
    ScopedFlushSubnormals mode;
    s = TeMultiplier(amax, Info(elem).max_finite, static_cast<int>(margin),
                     pow2);
    scale = Reciprocal(s);
  }
  if (std::isnan(s)) {
    // XLA's x * NaN is the NaN operand, positive (and the clip keeps it).
    std::memset(q, static_cast<int>(enc.nan_code), static_cast<size_t>(n));
    return scale;
  }
  const int threads = ThreadsFor(static_cast<double>(n), kPerThread);
  const void* d = x.untyped_data();
  ForRanges(n, threads, [&](int64_t b, int64_t e, int) {
    ScopedFlushSubnormals mode;
    switch (w) {
      case Wide::kF32:
        EncodeF32(enc, static_cast<const float*>(d) + b, s, e - b, q + b);
        break;
      case Wide::kBF16:
        EncodeBf16(enc, static_cast<const uint16_t*>(d) + b, s, e - b, q + b);
        break;
      case Wide::kF16:
        EncodeF16(enc, static_cast<const uint16_t*>(d) + b, s, e - b, q + b);
        break;
    }
  });
  return scale;
}

ffi::Error QuantizeImpl(ffi::AnyBuffer x, ffi::AnyBuffer amax,
                        ffi::Result<ffi::AnyBuffer> payload,
                        ffi::Result<ffi::AnyBuffer> scale, int64_t margin,
                        bool pow2) {
  const std::string_view op = kOpQuantize;
  Wide w = Wide::kF32;
  Elem elem = Elem::kE4M3;
  QLAYERS_RETURN_IF_ERROR(WideInput(op, x, &w));
  QLAYERS_RETURN_IF_ERROR(ExpectScalarF32(op, "amax", amax));
  QLAYERS_RETURN_IF_ERROR(ExpectScalarF32(op, "scale output", *scale));
  QLAYERS_RETURN_IF_ERROR(CheckPayload(op, x, *payload, margin, &elem));
  *static_cast<float*>(scale->untyped_data()) = EncodeTensor(
      x, w, *static_cast<const float*>(amax.untyped_data()), elem, margin,
      pow2, static_cast<uint8_t*>(payload->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error QuantizeDelayedImpl(ffi::AnyBuffer x, ffi::AnyBuffer history,
                               ffi::AnyBuffer running,
                               ffi::Result<ffi::AnyBuffer> payload,
                               ffi::Result<ffi::AnyBuffer> scale,
                               ffi::Result<ffi::AnyBuffer> used,
                               ffi::Result<ffi::AnyBuffer> new_running,
                               int64_t margin, bool pow2) {
  const std::string_view op = kOpDelayed;
  Wide w = Wide::kF32;
  Elem elem = Elem::kE4M3;
  QLAYERS_RETURN_IF_ERROR(WideInput(op, x, &w));
  QLAYERS_RETURN_IF_ERROR(
      ExpectDtype(op, "history", history, ffi::DataType::F32));
  if (history.dimensions().size() != 1 || history.element_count() == 0) {
    return InvalidArg(op, "history must be a non-empty 1-D array, got shape ",
                      ShapeStr(history.dimensions()));
  }
  QLAYERS_RETURN_IF_ERROR(ExpectScalarF32(op, "running amax", running));
  QLAYERS_RETURN_IF_ERROR(ExpectScalarF32(op, "scale output", *scale));
  QLAYERS_RETURN_IF_ERROR(ExpectScalarF32(op, "amax output", *used));
  QLAYERS_RETURN_IF_ERROR(
      ExpectScalarF32(op, "running amax output", *new_running));
  QLAYERS_RETURN_IF_ERROR(CheckPayload(op, x, *payload, margin, &elem));

  // `scaling.delayed_amax(state, amax(x), "max", history_max(history))`.
  const float current = Amax(x, w);
  const float stored =
      MaxF32(static_cast<const float*>(history.untyped_data()),
             static_cast<int64_t>(history.element_count()));
  const float before = *static_cast<const float*>(running.untyped_data());
  const bool finite = std::isfinite(current);
  const float run = finite ? XlaMaximum(before, current) : before;
  const float use = PositiveNormalOrInf(stored) ? stored : run;
  const float amax = finite ? use : current;
  *static_cast<float*>(used->untyped_data()) = amax;
  *static_cast<float*>(new_running->untyped_data()) = run;
  *static_cast<float*>(scale->untyped_data()) = EncodeTensor(
      x, w, amax, elem, margin, pow2,
      static_cast<uint8_t*>(payload->untyped_data()));
  return ffi::Error::Success();
}

struct MxRule {
  uint32_t k;      // subtracted from the biased exponent
  uint32_t m_max;  // RCEIL: mantissa field of the format's max
  bool rceil;

  // Code of a block from the bits of its f32 amax (NaN patterns included:
  // their exponent field is all ones, as Inf's).
  uint8_t Code(uint32_t bits) const {
    const uint32_t eb = (bits >> 23) & 0xFFu;
    if (eb == 0xFFu) return 0xFF;
    const uint32_t above = rceil && (bits & 0x7FFFFFu) > m_max ? 1u : 0u;
    const uint32_t e = eb + above;
    return static_cast<uint8_t>((e > k ? e : k) - k);
  }
  static float Multiplier(uint8_t code) {
    if (code == 0xFF) return 0.0f;
    const uint32_t b = (254u - code) << 23;
    return BitsFloat(b > 0x400000u ? b : 0x400000u);
  }
};

// Widens n inputs to f32 (exact; magnitudes keep their order and NaNs stay
// NaNs, so amaxes of the widened values are those of the inputs).
void Widen(const void* x, Wide w, int64_t offset, int64_t n, float* out) {
  switch (w) {
    case Wide::kF32:
      std::memcpy(out, static_cast<const float*>(x) + offset, n * sizeof(float));
      break;
    case Wide::kBF16: {
      const uint16_t* h = static_cast<const uint16_t*>(x) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(h[i]);
      break;
    }
    case Wide::kF16: {
      const uint16_t* h = static_cast<const uint16_t*>(x) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = HalfToFloat(h[i]);
      break;
    }
  }
}

// m[i] = max(m[i], magnitude bits of v[i]).
QL_ISA_CLONES void MaxInto(const float* __restrict v, int64_t n,
                           uint32_t* __restrict m) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = FloatBits(v[i]) & 0x7FFFFFFFu;
    m[i] = b > m[i] ? b : m[i];
  }
}

// Magnitude-bit max of each bs-long block of v (n a multiple of bs).
QL_ISA_CLONES void BlockMax(const float* __restrict v, int64_t n, int64_t bs,
                            uint32_t* __restrict m) {
  for (int64_t j = 0; j < n / bs; ++j) {
    uint32_t b = 0;
    for (int64_t i = 0; i < bs; ++i) {
      const uint32_t u = FloatBits(v[j * bs + i]) & 0x7FFFFFFFu;
      b = u > b ? u : b;
    }
    m[j] = b;
  }
}

// q[i] = enc(v[i] * s[i / bs]).
QL_ISA_CLONES void EncodeBlocks(const Fp8Encoder enc, const float* __restrict v,
                                const float* __restrict s, int64_t n,
                                int64_t bs, uint8_t* __restrict q) {
  for (int64_t j = 0; j < n / bs; ++j) {
    const float sj = s[j];
    for (int64_t i = 0; i < bs; ++i) q[j * bs + i] = enc(v[j * bs + i] * sj);
  }
}

// q[i] = enc(v[i] * s[i]).
QL_ISA_CLONES void EncodeEach(const Fp8Encoder enc, const float* __restrict v,
                              const float* __restrict s, int64_t n,
                              uint8_t* __restrict q) {
  for (int64_t i = 0; i < n; ++i) q[i] = enc(v[i] * s[i]);
}

// Blocks along C (axis 1): row r, block j covers columns [j*bs, (j+1)*bs).
void MxRows(const void* x, Wide w, int64_t R, int64_t C, int64_t bs,
            int64_t Cp, const MxRule& rule, const Fp8Encoder& enc, uint8_t* q,
            uint8_t* codes) {
  const int64_t nb = Cp / bs;
  const int threads = ThreadsFor(static_cast<double>(R * C), kPerThread);
  ForRanges(R, threads, [&](int64_t r0, int64_t r1, int) {
    ScopedFlushSubnormals mode;
    // One row widened (zero padded), then its block maxima and multipliers.
    float* v = ThreadScratch(static_cast<size_t>(Cp + 2 * nb));
    float* s = v + Cp;
    uint32_t* m = reinterpret_cast<uint32_t*>(s + nb);
    std::fill(v + C, v + Cp, 0.0f);
    for (int64_t r = r0; r < r1; ++r) {
      Widen(x, w, r * C, C, v);
      BlockMax(v, Cp, bs, m);
      for (int64_t j = 0; j < nb; ++j) {
        codes[r * nb + j] = rule.Code(m[j]);
        s[j] = MxRule::Multiplier(codes[r * nb + j]);
      }
      EncodeBlocks(enc, v, s, Cp, bs, q + r * Cp);
    }
  });
}

// Blocks along R (axis 0): block i covers rows [i*bs, (i+1)*bs) of column c.
void MxCols(const void* x, Wide w, int64_t R, int64_t C, int64_t bs,
            int64_t Rp, const MxRule& rule, const Fp8Encoder& enc, uint8_t* q,
            uint8_t* codes) {
  const int64_t nb = Rp / bs;
  const int threads = ThreadsFor(static_cast<double>(R * C), kPerThread);
  ForRanges(nb, threads, [&](int64_t i0, int64_t i1, int) {
    ScopedFlushSubnormals mode;
    // The block's rows widened, then per-column maxima and multipliers.
    float* v = ThreadScratch(static_cast<size_t>((bs + 2) * C));
    float* s = v + bs * C;
    uint32_t* m = reinterpret_cast<uint32_t*>(s + C);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r0 = i * bs, rows = std::min(R, r0 + bs) - r0;
      std::fill(m, m + C, 0u);
      for (int64_t r = 0; r < rows; ++r) {
        Widen(x, w, (r0 + r) * C, C, v + r * C);
        MaxInto(v + r * C, C, m);
      }
      std::fill(v + rows * C, v + bs * C, 0.0f);
      for (int64_t c = 0; c < C; ++c) {
        codes[i * C + c] = rule.Code(m[c]);
        s[c] = MxRule::Multiplier(codes[i * C + c]);
      }
      for (int64_t r = 0; r < bs; ++r) {
        EncodeEach(enc, v + r * C, s, C, q + (r0 + r) * C);
      }
    }
  });
}

ffi::Error QuantizeMxImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> payload,
                          ffi::Result<ffi::AnyBuffer> codes, int64_t axis,
                          int64_t block, bool rceil) {
  const std::string_view op = kOpMx;
  Wide w = Wide::kF32;
  int64_t R = 0, C = 0;
  QLAYERS_RETURN_IF_ERROR(WideInput(op, x, &w));
  QLAYERS_RETURN_IF_ERROR(Rank2(op, "x", x, &R, &C));
  if (axis != 0 && axis != 1) {
    return InvalidArg(op, "axis must be 0 or 1, got ", axis);
  }
  if (block <= 0) return InvalidArg(op, "block must be positive, got ", block);
  auto elem = ElemOfFp8Dtype(payload->element_type());
  if (!elem || Info(*elem).fnuz) {
    return InvalidArg(op, "the payload must be float8_e4m3fn or float8_e5m2, "
                      "got ", DtypeName(payload->element_type()));
  }
  const int64_t Rp = axis == 0 ? RoundUp(R, block) : R;
  const int64_t Cp = axis == 1 ? RoundUp(C, block) : C;
  QLAYERS_RETURN_IF_ERROR(ExpectShape2(op, "payload", *payload, Rp, Cp));
  QLAYERS_RETURN_IF_ERROR(ExpectShape2(op, "codes", *codes,
                                       axis == 0 ? Rp / block : R,
                                       axis == 1 ? Cp / block : C));
  QLAYERS_RETURN_IF_ERROR(ExpectDtype(op, "codes", *codes, ffi::DataType::U8));
  const ElemInfo& info = Info(*elem);
  const uint32_t max_bits = FloatBits(info.max_finite);
  const int emax = static_cast<int>((max_bits >> 23) & 0xFFu) - 127;
  const MxRule rule{static_cast<uint32_t>(emax), max_bits & 0x7FFFFFu, rceil};
  const Fp8Encoder enc(*elem);
  uint8_t* q = static_cast<uint8_t*>(payload->untyped_data());
  uint8_t* cd = static_cast<uint8_t*>(codes->untyped_data());
  if (axis == 1) {
    MxRows(x.untyped_data(), w, R, C, block, Cp, rule, enc, q, cd);
  } else {
    MxCols(x.untyped_data(), w, R, C, block, Rp, rule, enc, q, cd);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace qlayers::cpu

namespace ffi = ::xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(QlayersAmax, qlayers::cpu::AmaxImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(QlayersMaxF32, qlayers::cpu::MaxImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(QlayersQuantizeMx, qlayers::cpu::QuantizeMxImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>()  // payload
                                  .Ret<ffi::AnyBuffer>()  // codes
                                  .Attr<int64_t>("axis")
                                  .Attr<int64_t>("block")
                                  .Attr<bool>("rceil"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QlayersQuantizeFp8Tensor,
                              qlayers::cpu::QuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // amax
                                  .Ret<ffi::AnyBuffer>()  // payload
                                  .Ret<ffi::AnyBuffer>()  // scale
                                  .Attr<int64_t>("margin")
                                  .Attr<bool>("pow2"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QlayersQuantizeFp8Delayed,
                              qlayers::cpu::QuantizeDelayedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // history
                                  .Arg<ffi::AnyBuffer>()  // running amax
                                  .Ret<ffi::AnyBuffer>()  // payload
                                  .Ret<ffi::AnyBuffer>()  // scale
                                  .Ret<ffi::AnyBuffer>()  // amax used
                                  .Ret<ffi::AnyBuffer>()  // running amax
                                  .Attr<int64_t>("margin")
                                  .Attr<bool>("pow2"));
