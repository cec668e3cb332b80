// Row decoders: turn `kc` elements of one operand row, starting at `k0`,
// into f32 (payload value times its block scale where the format has one),
// written to out[k * stride] (the packed-panel layout, one store each).
// They read only the bytes of that row slice; the GEMM driver calls them
// tile by tile, so no dequantized copy of a whole operand ever exists.
#ifndef QLAYERS_FFI_CPU_DECODERS_H_
#define QLAYERS_FFI_CPU_DECODERS_H_

#include <cstdint>

#include "../common/elem_format.h"
#include "numerics.h"

namespace qlayers::cpu {

// fp8 payload, one byte per element, no block scale (per-tensor and
// blockwise GEMMs apply their scales outside the decode).
struct Fp8Rows {
  const uint8_t* data;
  int64_t ld;  // bytes per row (= K)
  const float* lut;

  inline void Decode(int64_t r, int64_t k0, int64_t kc, float* __restrict out,
                     int stride) const {
    const uint8_t* s = data + r * ld + k0;
    for (int64_t k = 0; k < kc; ++k) out[k * stride] = lut[s[k]];
  }
};

// MX operand: payload of `kBits` per element (8, 6 or 4, packed as in
// elem_format.h) with one E8M0 scale per 32 elements along K.
// Requires k0 and kc to be multiples of 32.
template <int kBits>
struct MxRows {
  const uint8_t* data;
  int64_t ld;  // packed bytes per row
  const uint8_t* scales;
  int64_t ld_scales;  // = K / 32
  const float* lut;

  inline void Decode(int64_t r, int64_t k0, int64_t kc, float* __restrict out,
                     int stride) const {
    const uint8_t* srow = scales + r * ld_scales;
    const uint8_t* prow = data + r * ld;
    for (int64_t kb = k0 / kMxBlock; kb < (k0 + kc) / kMxBlock; ++kb) {
      const float s = E8M0ToFloat(srow[kb]);
      const uint8_t* p = prow + kb * (kMxBlock * kBits / 8);
      float* o = out + (kb * kMxBlock - k0) * stride;
      if constexpr (kBits == 8) {
        for (int t = 0; t < 32; ++t) o[t * stride] = lut[p[t]] * s;
      } else if constexpr (kBits == 6) {
        // 4 elements in 3 bytes: w = v0 | v1 << 6 | v2 << 12 | v3 << 18,
        // stored little-endian.
        for (int g = 0; g < 8; ++g) {
          const uint32_t w = static_cast<uint32_t>(p[3 * g]) |
                             static_cast<uint32_t>(p[3 * g + 1]) << 8 |
                             static_cast<uint32_t>(p[3 * g + 2]) << 16;
          o[(4 * g + 0) * stride] = lut[w & 63u] * s;
          o[(4 * g + 1) * stride] = lut[(w >> 6) & 63u] * s;
          o[(4 * g + 2) * stride] = lut[(w >> 12) & 63u] * s;
          o[(4 * g + 3) * stride] = lut[(w >> 18) & 63u] * s;
        }
      } else {
        static_assert(kBits == 4, "MX payloads are 8, 6 or 4 bits");
        // Element 2i in the low nibble, 2i+1 in the high nibble.
        for (int t = 0; t < 16; ++t) {
          o[(2 * t) * stride] = lut[p[t] & 15u] * s;
          o[(2 * t + 1) * stride] = lut[p[t] >> 4] * s;
        }
      }
    }
  }
};

}  // namespace qlayers::cpu

#endif  // QLAYERS_FFI_CPU_DECODERS_H_
