// Scalar numerics for the CPU kernels: exact decode tables, E8M0 scales,
// bfloat16 rounding and the saturating round-to-nearest-even fp8 encoder.
#ifndef QLAYERS_FFI_CPU_NUMERICS_H_
#define QLAYERS_FFI_CPU_NUMERICS_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "../common/elem_format.h"

namespace qlayers::cpu {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Value of one code, computed from the bit definition (sign, exponent,
// mantissa; subnormals when the exponent field is zero), OFP8 v1.0 section 3
// and OCP MX v1.0 section 5.3.
inline float DecodeFromBits(Elem e, uint32_t code) {
  const ElemInfo& f = Info(e);
  const uint32_t sign = (code >> (f.bits - 1)) & 1u;
  const uint32_t exp = (code >> f.man_bits) & ((1u << f.exp_bits) - 1u);
  const uint32_t man = code & ((1u << f.man_bits) - 1u);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (f.fnuz && code == 0x80u) return nan;
  if (e == Elem::kE4M3 && exp == 15u && man == 7u) return nan;
  if (f.ieee_inf && exp == (1u << f.exp_bits) - 1u) {
    return man ? nan
               : (sign ? -std::numeric_limits<float>::infinity()
                       : std::numeric_limits<float>::infinity());
  }
  const float mag =
      exp == 0 ? std::ldexp(static_cast<float>(man), 1 - f.bias - f.man_bits)
               : std::ldexp(static_cast<float>((1u << f.man_bits) + man),
                            static_cast<int>(exp) - f.bias - f.man_bits);
  return sign ? -mag : mag;
}

// One 256-entry table per format, indexed by the code (fp6/fp4 use the low
// 64/16 entries). Built once on first use.
struct DecodeTables {
  alignas(64) float lut[kNumElem][256];
  DecodeTables() {
    for (int e = 0; e < kNumElem; ++e) {
      const int n = 1 << kElemInfo[e].bits;
      for (int c = 0; c < 256; ++c) {
        lut[e][c] = c < n ? DecodeFromBits(static_cast<Elem>(e), c) : 0.0f;
      }
    }
  }
};

inline const float* DecodeLut(Elem e) {
  static const DecodeTables tables;
  return tables.lut[static_cast<int>(e)];
}

// E8M0 scale code -> 2^(code - 127); 0xFF is NaN (OCP MX v1.0, 5.4.1).
// Code 0 is 2^-127, an f32 subnormal (exact).
inline float E8M0ToFloat(uint8_t code) {
  if (code == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  if (code == 0) return BitsFloat(0x00400000u);
  return BitsFloat(static_cast<uint32_t>(code) << 23);
}

inline float Bf16ToFloat(uint16_t h) {
  return BitsFloat(static_cast<uint32_t>(h) << 16);
}

// Round-to-nearest-even f32 -> bf16, NaN stays NaN (quietened).
inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Saturating, round-to-nearest-even encoder from f32 into an fp8 format:
// code(x) = RNE(clip(x, -max, +max)); NaN -> the format's NaN.
//
// Normal range: the classic bias-and-truncate RNE on the f32 bit pattern
// (add 0x7F..F plus the lowest kept bit, then shift). Subnormal range: add a
// power of two whose f32 ulp equals the target's subnormal spacing, so the
// FPU performs the RNE, then subtract its bit pattern (the same device as the
// well-known f32 -> f16 conversions, e.g. F. Giesen, "float->half variants").
// Both are computed and one is selected, which keeps the code vectorizable.
struct Fp8Encoder {
  uint32_t shift;        // 23 - man_bits
  uint32_t round_bias;   // (1 << (shift - 1)) - 1
  uint32_t exp_adjust;   // (127 - bias) << man_bits
  uint32_t min_normal;   // f32 bits of 2^(1 - bias)
  uint32_t max_bits;     // f32 bits of the largest finite value
  float magic;           // 2^(24 - bias - man_bits)
  uint32_t magic_bits;
  uint32_t nan_code;     // positive NaN code
  bool fnuz;

  explicit Fp8Encoder(Elem e) {
    const ElemInfo& f = Info(e);
    shift = 23u - static_cast<uint32_t>(f.man_bits);
    round_bias = (1u << (shift - 1)) - 1u;
    exp_adjust = static_cast<uint32_t>(127 - f.bias) << f.man_bits;
    min_normal = static_cast<uint32_t>(127 + 1 - f.bias) << 23;
    max_bits = FloatBits(f.max_finite);
    magic = std::ldexp(1.0f, 24 - f.bias - f.man_bits);
    magic_bits = FloatBits(magic);
    fnuz = f.fnuz;
    nan_code = f.fnuz ? 0x80u : (e == Elem::kE5M2 ? 0x7Eu : 0x7Fu);
  }

  // Branch-free so that loops over it vectorize.
  inline uint8_t operator()(float x) const {
    const uint32_t u = FloatBits(x);
    const uint32_t sign = (u >> 24) & 0x80u;
    const uint32_t abs_bits = u & 0x7FFFFFFFu;
    const bool nan = abs_bits > 0x7F800000u;
    // Positive floats order like their bit patterns: clip (Inf too) in ints.
    const uint32_t a = abs_bits < max_bits ? abs_bits : max_bits;
    const uint32_t sub = FloatBits(BitsFloat(a) + magic) - magic_bits;
    const uint32_t nrm = ((a + round_bias + ((a >> shift) & 1u)) >> shift) - exp_adjust;
    const uint32_t code = a < min_normal ? sub : nrm;
    const uint32_t s = (fnuz && code == 0) ? 0u : sign;
    const uint32_t nan_out = fnuz ? nan_code : (sign | nan_code);
    return static_cast<uint8_t>(nan ? nan_out : (s | code));
  }
};

// A subnormal as the zero of its sign (how XLA:CPU's ops read it, DAZ).
inline float ReadAsDaz(float v) {
  const uint32_t u = FloatBits(v);
  return (u & 0x7F800000u) == 0 ? BitsFloat(u & 0x80000000u) : v;
}

// XLA:CPU's `maximum` of two f32 scalars: a NaN operand propagates (the
// first one's bits), subnormals read as signed zeros, +0 above -0.
inline float XlaMaximum(float a, float b) {
  if (std::isnan(a)) return a;
  if (std::isnan(b)) return b;
  a = ReadAsDaz(a);
  b = ReadAsDaz(b);
  if (FloatBits(a) != FloatBits(b) && a == b) return 0.0f;  // +0 and -0
  return a > b ? a : b;
}

// MX scale by the RCEIL rule (DESIGN.md, numerics 9; the rule used by
// Transformer Engine, cuBLAS and JAX): d = amax / max_elem in f32, and the
// E8M0 code is the smallest c with 2^(c - 127) >= d, clamped to [0, 254].
// For a normal d this is the biased exponent of d, plus one when its mantissa
// bits are non-zero; amax == 0 gives code 0 (2^-127). Non-finite amax is
// handled by the caller (code 0xFF).
inline uint8_t RceilScaleCode(float amax, float max_elem) {
  const float d = amax / max_elem;
  const uint32_t b = FloatBits(d);
  const uint32_t exp = b >> 23;  // d >= 0
  const uint32_t man = b & 0x7FFFFFu;
  uint32_t code;
  if (exp == 0) {
    code = man > 0x400000u ? 1u : 0u;  // subnormal d: 2^-127 covers d <= 2^-127
  } else {
    code = exp + (man != 0 ? 1u : 0u);
  }
  return static_cast<uint8_t>(code > 254u ? 254u : code);
}

}  // namespace qlayers::cpu

#endif  // QLAYERS_FFI_CPU_NUMERICS_H_
