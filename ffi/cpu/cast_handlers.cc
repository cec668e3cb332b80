// XLA FFI handlers for the fused "rowwise + columnwise" casts.
//
// Both read a high-precision X (R, C) (float32 or bfloat16) once, in 32x32
// tiles, and write two quantized copies:
//   row: (R, C)  quantized along C (the copy consumed with C as contraction)
//   col: (C, R)  quantized along R and stored transposed, so it is again
//                contraction-last (the copy for the GEMM that contracts R)
//
// QlayersCastFp8RowCol (per-tensor fp8; output format = result dtype,
// float8_e4m3fn / float8_e5m2 / *_fnuz):
//   s = the f32 scalar input `scale`
//   q = RNE(clip(x / s, -max, max))   (attribute multiply = false: s is the
//                                       dequantization scale)
//   q = RNE(clip(x * s, -max, max))   (multiply = true: s is the
//                                       quantization scale, TE convention)
//   x / s and x * s are evaluated in f32 first; NaN -> NaN, +-Inf -> +-max.
//   col is exactly the transpose of row.
//
// QlayersCastMxRowCol (MX with 32-element blocks; format = result dtype,
// float8_e4m3fn or float8_e5m2; R and C multiples of 32):
//   per block: amax = max |x|; if any element is Inf/NaN the code is 0xFF
//   and every payload byte of the block is the format's NaN (0x7F for e4m3,
//   0x7E for e5m2). Otherwise code = RCEIL(amax / max) (numerics.h:
//   smallest c in [0, 254] with 2^(c-127) >= amax / max, so a zero block
//   gets code 0 = 2^-127 and zero payload) and q = RNE(clip(x * 2^(127-c))).
//   row_scales (R, C/32) and col_scales (C, R/32) are uint8 E8M0 codes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "../common/elem_format.h"
#include "../common/ffi_util.h"
#include "numerics.h"
#include "parallel.h"

namespace qlayers::cpu {
namespace {

constexpr std::string_view kOpCast = "qlayers_cast_fp8_rowcol";
constexpr std::string_view kOpCastMx = "qlayers_cast_mxfp8_rowcol";
constexpr int kTile = 32;

// The encode loops vectorize well with AVX2/AVX-512 integer ops but not with
// baseline SSE2; build them per ISA and let the loader pick (GCC/Clang
// function multi-versioning, an ifunc on ELF).
// QLAYERS_TARGET_CLONES is set by CMake after a test compile.
#if defined(QLAYERS_TARGET_CLONES) && !defined(__SANITIZE_ADDRESS__)
#define QL_ISA_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define QL_ISA_CLONES
#endif

// Loads a tile of up to 32 x 32 elements as f32, row-major with stride 32.
template <typename T>
inline void LoadTile(const T* x, int64_t ld, int rows, int cols, float* t) {
  for (int i = 0; i < rows; ++i) {
    const T* src = x + i * ld;
    float* dst = t + i * kTile;
    if constexpr (sizeof(T) == 2) {
      for (int j = 0; j < cols; ++j) dst[j] = Bf16ToFloat(src[j]);
    } else {
      for (int j = 0; j < cols; ++j) dst[j] = src[j];
    }
  }
}

ffi::Error CheckInput(std::string_view op, const ffi::AnyBuffer& x,
                      int64_t* R, int64_t* C) {
  auto t = x.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16) {
    return InvalidArg(op, "x must be float32 or bfloat16, got ", DtypeName(t));
  }
  return Rank2(op, "x", x, R, C);
}

ffi::Error CheckFp8Outputs(std::string_view op, const ffi::AnyBuffer& row,
                           const ffi::AnyBuffer& col, int64_t R, int64_t C,
                           Elem* e) {
  auto er = ElemOfFp8Dtype(row.element_type());
  if (!er) {
    return InvalidArg(op, "row output must be an fp8 dtype, got ",
                      DtypeName(row.element_type()));
  }
  if (col.element_type() != row.element_type()) {
    return InvalidArg(op, "row and col outputs must have the same dtype, got ",
                      DtypeName(row.element_type()), " and ",
                      DtypeName(col.element_type()));
  }
  QLAYERS_RETURN_IF_ERROR(ExpectShape2(op, "row output", row, R, C));
  QLAYERS_RETURN_IF_ERROR(ExpectShape2(op, "col output", col, C, R));
  *e = *er;
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Per-tensor.

// Encodes n values v[j] * s (or / s); a plain loop so that it vectorizes.
// The encoder is taken by value: stores through uint8_t* may alias anything,
// and a local copy keeps its fields in registers.
QL_ISA_CLONES void EncodeRow(const Fp8Encoder enc, const float* __restrict v, float s,
                      bool multiply, int n, uint8_t* __restrict q) {
  if (multiply) {
    for (int j = 0; j < n; ++j) q[j] = enc(v[j] * s);
  } else {
    for (int j = 0; j < n; ++j) q[j] = enc(v[j] / s);
  }
}

// Writes the transpose of a rows x cols tile of codes (stride kTile).
inline void StoreTransposed(const uint8_t* q, int rows, int cols, uint8_t* dst,
                            int64_t ld) {
  for (int j = 0; j < cols; ++j) {
    uint8_t* d = dst + j * ld;
    for (int i = 0; i < rows; ++i) d[i] = q[i * kTile + j];
  }
}

template <typename T>
void CastTensorTiles(const T* x, int64_t R, int64_t C, float s, bool multiply,
                     Elem e, uint8_t* row, uint8_t* col) {
  const Fp8Encoder enc(e);
  const int64_t ntr = CeilDiv(R, kTile), ntc = CeilDiv(C, kTile);
  const int nthreads = ThreadsFor(static_cast<double>(R) * C, 1 << 16);
#pragma omp parallel num_threads(nthreads)
  {
    ScopedIeeeSubnormals ieee;
    alignas(64) float t[kTile * kTile];
    alignas(64) uint8_t q[kTile * kTile];
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < ntr * ntc; ++tile) {
      const int64_t r0 = (tile / ntc) * kTile, c0 = (tile % ntc) * kTile;
      const int rows = static_cast<int>(std::min<int64_t>(kTile, R - r0));
      const int cols = static_cast<int>(std::min<int64_t>(kTile, C - c0));
      LoadTile(x + r0 * C + c0, C, rows, cols, t);
      for (int i = 0; i < rows; ++i) {
        EncodeRow(enc, t + i * kTile, s, multiply, cols, q + i * kTile);
        std::memcpy(row + (r0 + i) * C + c0, q + i * kTile, cols);
      }
      StoreTransposed(q, rows, cols, col + c0 * R + r0, R);
    }
  }
}

ffi::Error CastFp8RowColImpl(ffi::AnyBuffer x, ffi::AnyBuffer scale,
                             ffi::Result<ffi::AnyBuffer> row,
                             ffi::Result<ffi::AnyBuffer> col, bool multiply) {
  const std::string_view op = kOpCast;
  int64_t R = 0, C = 0;
  Elem e = Elem::kE4M3;
  QLAYERS_RETURN_IF_ERROR(CheckInput(op, x, &R, &C));
  QLAYERS_RETURN_IF_ERROR(ExpectScalarF32(op, "scale", scale));
  QLAYERS_RETURN_IF_ERROR(CheckFp8Outputs(op, *row, *col, R, C, &e));
  const float s = *static_cast<const float*>(scale.untyped_data());
  auto* qr = static_cast<uint8_t*>(row->untyped_data());
  auto* qc = static_cast<uint8_t*>(col->untyped_data());
  if (x.element_type() == ffi::DataType::BF16) {
    CastTensorTiles(static_cast<const uint16_t*>(x.untyped_data()), R, C, s,
                    multiply, e, qr, qc);
  } else {
    CastTensorTiles(static_cast<const float*>(x.untyped_data()), R, C, s,
                    multiply, e, qr, qc);
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// MX (block 32, RCEIL).

// 2^(127 - code) for code in [0, 254]; exact in f32 (2^-127 is subnormal).
inline float InvScale(uint8_t code) {
  return code == 254 ? BitsFloat(0x00400000u)
                     : BitsFloat(static_cast<uint32_t>(254 - code) << 23);
}

// |x| as f32 bits: non-negative floats order like their bit patterns, and
// Inf/NaN are the patterns >= 0x7F800000, so one integer max per block gives
// both the amax and "holds Inf/NaN" (and vectorizes, unlike an f32 max that
// must respect NaN).
inline uint32_t AbsBits(float v) { return FloatBits(v) & 0x7FFFFFFFu; }

// E8M0 code of a block from the max of AbsBits over it.
inline uint8_t MxCode(uint32_t amax_bits, float max_elem) {
  if (amax_bits >= 0x7F800000u) return 0xFF;
  return RceilScaleCode(BitsFloat(amax_bits), max_elem);
}

// Payload of one block of n values with code c (stride 1).
QL_ISA_CLONES void EncodeMx(const Fp8Encoder enc, const float* __restrict v, uint8_t c,
                     uint8_t* __restrict q) {
  if (c == 0xFF) {
    std::memset(q, static_cast<int>(enc.nan_code), kTile);
    return;
  }
  const float inv = InvScale(c);
  for (int j = 0; j < kTile; ++j) q[j] = enc(v[j] * inv);
}

// q[i][j] = enc(t[i][j] * inv[j]) over a full tile.
QL_ISA_CLONES void EncodeColumns(const Fp8Encoder enc, const float* __restrict t,
                          const float* __restrict inv, uint8_t* __restrict q) {
  for (int i = 0; i < kTile; ++i) {
    for (int j = 0; j < kTile; ++j) q[i * kTile + j] = enc(t[i * kTile + j] * inv[j]);
  }
}

template <typename T>
void CastMxTiles(const T* x, int64_t R, int64_t C, Elem e, uint8_t* row,
                 uint8_t* row_s, uint8_t* col, uint8_t* col_s) {
  const Fp8Encoder enc(e);
  const float max_elem = Info(e).max_finite;
  const int64_t ntr = R / kTile, ntc = C / kTile;
  const int nthreads = ThreadsFor(static_cast<double>(R) * C, 1 << 16);
#pragma omp parallel num_threads(nthreads)
  {
    ScopedIeeeSubnormals ieee;
    alignas(64) float t[kTile * kTile];
    alignas(64) uint8_t q[kTile * kTile];
    alignas(64) uint32_t colmax[kTile];
    alignas(64) float inv[kTile];
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < ntr * ntc; ++tile) {
      const int64_t r0 = (tile / ntc) * kTile, c0 = (tile % ntc) * kTile;
      LoadTile(x + r0 * C + c0, C, kTile, kTile, t);
      // Row blocks: the 32 columns of each tile row.
      for (int i = 0; i < kTile; ++i) {
        const float* v = t + i * kTile;
        uint32_t m = 0;
        for (int j = 0; j < kTile; ++j) m = std::max(m, AbsBits(v[j]));
        const uint8_t c = MxCode(m, max_elem);
        row_s[(r0 + i) * ntc + c0 / kTile] = c;
        EncodeMx(enc, v, c, row + (r0 + i) * C + c0);
      }
      // Column blocks: the 32 rows of each tile column, vectorized across
      // columns, then stored transposed.
      for (int j = 0; j < kTile; ++j) colmax[j] = 0;
      for (int i = 0; i < kTile; ++i) {
        for (int j = 0; j < kTile; ++j) colmax[j] = std::max(colmax[j], AbsBits(t[i * kTile + j]));
      }
      uint8_t codes[kTile];
      bool any_nan = false;
      for (int j = 0; j < kTile; ++j) {
        codes[j] = MxCode(colmax[j], max_elem);
        col_s[(c0 + j) * ntr + r0 / kTile] = codes[j];
        any_nan |= codes[j] == 0xFF;
        inv[j] = codes[j] == 0xFF ? 1.0f : InvScale(codes[j]);
      }
      EncodeColumns(enc, t, inv, q);
      if (any_nan) {
        for (int j = 0; j < kTile; ++j) {
          if (codes[j] != 0xFF) continue;
          for (int i = 0; i < kTile; ++i) q[i * kTile + j] = static_cast<uint8_t>(enc.nan_code);
        }
      }
      StoreTransposed(q, kTile, kTile, col + c0 * R + r0, R);
    }
  }
}

ffi::Error CastMxRowColImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> row,
                            ffi::Result<ffi::AnyBuffer> row_scales,
                            ffi::Result<ffi::AnyBuffer> col,
                            ffi::Result<ffi::AnyBuffer> col_scales) {
  const std::string_view op = kOpCastMx;
  int64_t R = 0, C = 0;
  Elem e = Elem::kE4M3;
  QLAYERS_RETURN_IF_ERROR(CheckInput(op, x, &R, &C));
  if (R % kMxBlock != 0 || C % kMxBlock != 0) {
    return InvalidArg(op, "x shape ", ShapeStr(x.dimensions()),
                      " must have both dimensions multiples of 32 (pad with "
                      "zeros)");
  }
  QLAYERS_RETURN_IF_ERROR(CheckFp8Outputs(op, *row, *col, R, C, &e));
  if (e != Elem::kE4M3 && e != Elem::kE5M2) {
    return InvalidArg(op, "MX payload dtype must be float8_e4m3fn or "
                      "float8_e5m2, got ", DtypeName(row->element_type()));
  }
  QLAYERS_RETURN_IF_ERROR(ExpectDtype(op, "row_scales", *row_scales, ffi::DataType::U8));
  QLAYERS_RETURN_IF_ERROR(ExpectDtype(op, "col_scales", *col_scales, ffi::DataType::U8));
  QLAYERS_RETURN_IF_ERROR(ExpectShape2(op, "row_scales", *row_scales, R, C / kMxBlock));
  QLAYERS_RETURN_IF_ERROR(ExpectShape2(op, "col_scales", *col_scales, C, R / kMxBlock));
  auto* qr = static_cast<uint8_t*>(row->untyped_data());
  auto* sr = static_cast<uint8_t*>(row_scales->untyped_data());
  auto* qc = static_cast<uint8_t*>(col->untyped_data());
  auto* sc = static_cast<uint8_t*>(col_scales->untyped_data());
  if (x.element_type() == ffi::DataType::BF16) {
    CastMxTiles(static_cast<const uint16_t*>(x.untyped_data()), R, C, e, qr,
                sr, qc, sc);
  } else {
    CastMxTiles(static_cast<const float*>(x.untyped_data()), R, C, e, qr, sr,
                qc, sc);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace qlayers::cpu

namespace ffi = ::xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(QlayersCastFp8RowCol,
                              qlayers::cpu::CastFp8RowColImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // scale
                                  .Ret<ffi::AnyBuffer>()  // row
                                  .Ret<ffi::AnyBuffer>()  // col
                                  .Attr<bool>("multiply"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QlayersCastMxRowCol,
                              qlayers::cpu::CastMxRowColImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>()  // row
                                  .Ret<ffi::AnyBuffer>()  // row_scales
                                  .Ret<ffi::AnyBuffer>()  // col
                                  .Ret<ffi::AnyBuffer>()); // col_scales
