// Element formats shared by every backend: names, bit layouts, packed sizes.
//
// Bit layouts follow the OCP 8-bit Floating Point Specification (OFP8) v1.0
// and the OCP Microscaling Formats (MX) Specification v1.0, section 5.3
// (FP6 E3M2/E2M3, FP4 E2M1) and 5.4 (E8M0 scales). The FNUZ variants are the
// AMD/Graphcore formats used by gfx942 (bias one larger, no inf, no -0, the
// code 0x80 is the only NaN).
#ifndef QLAYERS_FFI_COMMON_ELEM_FORMAT_H_
#define QLAYERS_FFI_COMMON_ELEM_FORMAT_H_

#include <cstdint>
#include <optional>
#include <string_view>

namespace qlayers {

enum class Elem : int {
  kE4M3 = 0,      // OCP E4M3FN: bias 7, max 448, NaN = S.1111.111, no inf
  kE5M2 = 1,      // OCP E5M2: bias 15, max 57344, IEEE-like inf/NaN
  kE3M2 = 2,      // MX FP6 E3M2: bias 3, max 28, no inf/NaN
  kE2M3 = 3,      // MX FP6 E2M3: bias 1, max 7.5, no inf/NaN
  kE2M1 = 4,      // MX FP4 E2M1: bias 1, max 6, no inf/NaN
  kE4M3FNUZ = 5,  // bias 8, max 240, NaN = 0x80
  kE5M2FNUZ = 6,  // bias 16, max 57344, NaN = 0x80
};

struct ElemInfo {
  const char* name;
  int bits;      // storage bits of one element: 8, 6 or 4
  int exp_bits;
  int man_bits;
  int bias;
  float max_finite;
  bool fnuz;     // 0x80 is NaN, no negative zero
  bool ieee_inf; // all-ones exponent encodes inf/NaN (E5M2 only)
};

inline constexpr ElemInfo kElemInfo[] = {
    {"e4m3", 8, 4, 3, 7, 448.0f, false, false},
    {"e5m2", 8, 5, 2, 15, 57344.0f, false, true},
    {"e3m2", 6, 3, 2, 3, 28.0f, false, false},
    {"e2m3", 6, 2, 3, 1, 7.5f, false, false},
    {"e2m1", 4, 2, 1, 1, 6.0f, false, false},
    {"e4m3fnuz", 8, 4, 3, 8, 240.0f, true, false},
    {"e5m2fnuz", 8, 5, 2, 16, 57344.0f, true, false},
};

inline constexpr int kNumElem = sizeof(kElemInfo) / sizeof(kElemInfo[0]);

inline const ElemInfo& Info(Elem e) { return kElemInfo[static_cast<int>(e)]; }

// Accepts the names above plus a few common spellings ("e4m3fn", "fp4", ...).
inline std::optional<Elem> ParseElem(std::string_view s) {
  if (s == "e4m3" || s == "e4m3fn" || s == "float8_e4m3fn") return Elem::kE4M3;
  if (s == "e5m2" || s == "float8_e5m2") return Elem::kE5M2;
  if (s == "e3m2" || s == "fp6_e3m2" || s == "float6_e3m2fn") return Elem::kE3M2;
  if (s == "e2m3" || s == "fp6_e2m3" || s == "float6_e2m3fn") return Elem::kE2M3;
  if (s == "e2m1" || s == "fp4" || s == "fp4_e2m1" || s == "float4_e2m1fn")
    return Elem::kE2M1;
  if (s == "e4m3fnuz" || s == "float8_e4m3fnuz") return Elem::kE4M3FNUZ;
  if (s == "e5m2fnuz" || s == "float8_e5m2fnuz") return Elem::kE5M2FNUZ;
  return std::nullopt;
}

// Bytes of one row of `k` elements in the packed storage contract:
// fp8 one byte each; fp6 four elements in three bytes; fp4 two per byte.
// Returns -1 when `k` does not fill whole bytes/groups.
inline int64_t PackedRowBytes(Elem e, int64_t k) {
  switch (Info(e).bits) {
    case 8:
      return k;
    case 6:
      return (k % 4 == 0) ? k / 4 * 3 : -1;
    case 4:
      return (k % 2 == 0) ? k / 2 : -1;
  }
  return -1;
}

// MX block size (OCP MX v1.0: k = 32) and the DeepSeek-V3 K-chunk.
inline constexpr int64_t kMxBlock = 32;
inline constexpr int64_t kBlockwiseChunk = 128;

}  // namespace qlayers

#endif  // QLAYERS_FFI_COMMON_ELEM_FORMAT_H_
