// XLA FFI handler for MX dequantization on CPU: the operands of the CPU MX
// GEMM (`qlayers.dispatch`, form ``cpu_mx``) in one custom call each
// instead of an XLA fusion per operand, with the same bits as
// `QTensor.dequantize(jnp.bfloat16)` on XLA:CPU.
//
// QlayersDequantizeMx (payload fp8 (Rp, Cp), codes uint8 E8M0 one per block
//   -> out bfloat16 (R, C), or (C, R) with `transpose`; attributes axis (0 or
//   1, the axis the blocks run along), block (32), transpose (bool)):
//   out[r, c] = bf16(decode(payload[r, c]) * 2^(code - 127)), cropped to the
//   unpadded R x C (Rp, Cp are R, C padded to whole blocks along `axis`).
//   As XLA:CPU computes it: the product in f32 under flush-to-zero and
//   denormals-are-zero (code 0, the subnormal 2^-127, reads as zero), a NaN
//   payload element is the canonical quiet NaN of its sign, and a block
//   whose code is 0xFF is the positive quiet NaN (the scale's NaN wins).
//   The product of an MX element and its scale has at most 4 significant
//   bits, so the bf16 rounding is exact.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string_view>
#include <vector>

#include "../common/elem_format.h"
#include "../common/ffi_util.h"
#include "numerics.h"
#include "parallel.h"

namespace qlayers::cpu {
namespace {

constexpr std::string_view kOp = "qlayers_dequantize_mx";
// Elements per thread below which the kernel stays on the calling thread.
constexpr double kPerThread = 1 << 16;
// Side of the square tiles a transposed copy is written in.
constexpr int64_t kTile = 64;
constexpr uint16_t kBf16NaN = 0x7FC0;  // jnp.nan as bfloat16

// Decoded codes as XLA:CPU's convert gives them: NaN codes become the
// canonical quiet NaN with the code's sign.
struct Decoder {
  alignas(64) float lut[256];
  explicit Decoder(Elem e) {
    const float* exact = DecodeLut(e);
    const int sign_bit = Info(e).bits - 1;
    for (int c = 0; c < 256; ++c) {
      lut[c] = std::isnan(exact[c])
                   ? BitsFloat(((c >> sign_bit) & 1 ? 0x80000000u : 0u) |
                               0x7FC00000u)
                   : exact[c];
    }
  }
};

// out[i] = bf16(lut[p[i]] * s[i]) (s NaN: the block's NaN).
QL_ISA_CLONES void DecodeEach(const float* __restrict lut,
                              const uint8_t* __restrict p,
                              const float* __restrict s, int64_t n,
                              uint16_t* __restrict out) {
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t v = FloatToBf16(lut[p[i]] * s[i]);
    out[i] = std::isnan(s[i]) ? kBf16NaN : v;
  }
}

// out[i] = bf16(lut[p[i]] * s) for one block's scale s (not NaN).
QL_ISA_CLONES void DecodeBlock(const float* __restrict lut,
                               const uint8_t* __restrict p, float s,
                               int64_t n, uint16_t* __restrict out) {
  for (int64_t i = 0; i < n; ++i) out[i] = FloatToBf16(lut[p[i]] * s);
}

struct MxOperand {
  const uint8_t* payload;  // (Rp, Cp)
  const float* scale;      // decoded codes, (R, Cp / bs) or (Rp / bs, C)
  int64_t R, C, Cp, bs;
  int axis;
};

// Columns [c0, c0 + n) of row r of the cropped operand into out[0, n).
void DecodeSpan(const MxOperand& x, const Decoder& d, int64_t r, int64_t c0,
                int64_t n, uint16_t* out) {
  const uint8_t* p = x.payload + r * x.Cp;
  if (x.axis == 0) {
    DecodeEach(d.lut, p + c0, x.scale + (r / x.bs) * x.C + c0, n, out);
    return;
  }
  const float* s = x.scale + r * (x.Cp / x.bs);
  for (int64_t c = c0; c < c0 + n;) {
    const int64_t j = c / x.bs, e = std::min(c0 + n, (j + 1) * x.bs);
    if (std::isnan(s[j])) {
      std::fill(out + (c - c0), out + (e - c0), kBf16NaN);
    } else {
      DecodeBlock(d.lut, p + c, s[j], e - c, out + (c - c0));
    }
    c = e;
  }
}

// Columns [c0, c1) of the transpose, out (C, R): each kTile x kTile tile is
// decoded row by row into a buffer, then written out column by column.
void DecodeTransposed(const MxOperand& x, const Decoder& d, int64_t c0,
                      int64_t c1, uint16_t* out) {
  uint16_t tile[kTile * kTile];
  for (int64_t r0 = 0; r0 < x.R; r0 += kTile) {
    const int64_t nr = std::min(x.R, r0 + kTile) - r0;
    for (int64_t t0 = c0; t0 < c1; t0 += kTile) {
      const int64_t nc = std::min(c1, t0 + kTile) - t0;
      for (int64_t r = 0; r < nr; ++r) {
        DecodeSpan(x, d, r0 + r, t0, nc, tile + r * kTile);
      }
      for (int64_t c = 0; c < nc; ++c) {
        uint16_t* o = out + (t0 + c) * x.R + r0;
        for (int64_t r = 0; r < nr; ++r) o[r] = tile[r * kTile + c];
      }
    }
  }
}

ffi::Error DequantizeMxImpl(ffi::AnyBuffer payload, ffi::AnyBuffer codes,
                            ffi::Result<ffi::AnyBuffer> out, int64_t axis,
                            int64_t block, bool transpose) {
  const std::string_view op = kOp;
  auto elem = ElemOfFp8Dtype(payload.element_type());
  if (!elem || Info(*elem).fnuz) {
    return InvalidArg(op, "the payload must be float8_e4m3fn or float8_e5m2, "
                      "got ", DtypeName(payload.element_type()));
  }
  if (axis != 0 && axis != 1) {
    return InvalidArg(op, "axis must be 0 or 1, got ", axis);
  }
  if (block <= 0) return InvalidArg(op, "block must be positive, got ", block);
  QLAYERS_RETURN_IF_ERROR(ExpectDtype(op, "codes", codes, ffi::DataType::U8));
  QLAYERS_RETURN_IF_ERROR(
      ExpectDtype(op, "output", *out, ffi::DataType::BF16));
  int64_t rows = 0, cols = 0, Rp = 0, Cp = 0;
  QLAYERS_RETURN_IF_ERROR(Rank2(op, "output", *out, &rows, &cols));
  QLAYERS_RETURN_IF_ERROR(Rank2(op, "payload", payload, &Rp, &Cp));
  const int64_t R = transpose ? cols : rows, C = transpose ? rows : cols;
  if (Rp != (axis == 0 ? RoundUp(R, block) : R) ||
      Cp != (axis == 1 ? RoundUp(C, block) : C)) {
    return InvalidArg(op, "the payload has shape ", ShapeStr(payload.dimensions()),
                      ", which is not the output's ", R, " x ", C,
                      " padded to blocks of ", block, " along axis ", axis);
  }
  QLAYERS_RETURN_IF_ERROR(ExpectShape2(op, "codes", codes,
                                       axis == 0 ? Rp / block : R,
                                       axis == 1 ? Cp / block : C));
  const Decoder dec(*elem);
  const uint8_t* cd = static_cast<const uint8_t*>(codes.untyped_data());
  std::vector<float> scale(codes.element_count());
  for (size_t i = 0; i < scale.size(); ++i) scale[i] = E8M0ToFloat(cd[i]);
  const MxOperand x{static_cast<const uint8_t*>(payload.untyped_data()),
                    scale.data(), R, C, Cp, block, static_cast<int>(axis)};
  uint16_t* o = static_cast<uint16_t*>(out->untyped_data());
  const int threads = ThreadsFor(static_cast<double>(R * C), kPerThread);
  if (!transpose) {
    ForRanges(R, threads, [&](int64_t r0, int64_t r1, int) {
      ScopedFlushSubnormals mode;
      for (int64_t r = r0; r < r1; ++r) DecodeSpan(x, dec, r, 0, C, o + r * C);
    });
  } else {
    ForRanges(CeilDiv(C, kTile), threads, [&](int64_t t0, int64_t t1, int) {
      ScopedFlushSubnormals mode;
      DecodeTransposed(x, dec, t0 * kTile, std::min(C, t1 * kTile), o);
    });
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace qlayers::cpu

namespace ffi = ::xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(QlayersDequantizeMx,
                              qlayers::cpu::DequantizeMxImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // payload
                                  .Arg<ffi::AnyBuffer>()  // codes
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Attr<int64_t>("axis")
                                  .Attr<int64_t>("block")
                                  .Attr<bool>("transpose"));
