// XLA FFI handlers for the CPU GEMMs. All compute OUT = A @ B^T with A
// (M, K), B (N, K) contraction-last, FP32 accumulation, f32 or bf16 output
// (taken from the result buffer's dtype).
//
//   QlayersGemmFp8Tensor   per-tensor fp8:  OUT = (A @ B^T) * (a_scale * b_scale)
//   QlayersGemmMx          OCP MX: 32-element blocks along K, E8M0 scales
//   QlayersGemmBlockwise   DeepSeek-V3 fine-grained fp8 (1x128 / 128x128)
#include <cstdint>
#include <string>
#include <string_view>

#include "../common/elem_format.h"
#include "../common/ffi_util.h"
#include "decoders.h"
#include "gemm_driver.h"
#include "microkernel.h"
#include "numerics.h"

namespace qlayers::cpu {
namespace {

constexpr std::string_view kOpTensor = "qlayers_gemm_fp8_tensor";
constexpr std::string_view kOpMx = "qlayers_gemm_mx";
constexpr std::string_view kOpBlockwise = "qlayers_gemm_blockwise";

const uint8_t* Bytes(const ffi::AnyBuffer& b) {
  return static_cast<const uint8_t*>(b.untyped_data());
}

ffi::Error Fp8Operand(std::string_view op, std::string_view what,
                      const ffi::AnyBuffer& x, Elem* elem) {
  auto e = ElemOfFp8Dtype(x.element_type());
  if (!e) {
    return InvalidArg(op, what,
                      " must be an fp8 array (float8_e4m3fn, float8_e5m2, "
                      "float8_e4m3fnuz or float8_e5m2fnuz), got ",
                      DtypeName(x.element_type()));
  }
  *elem = *e;
  return ffi::Error::Success();
}

bool IsBf16(const ffi::AnyBuffer& out) {
  return out.element_type() == ffi::DataType::BF16;
}

// ---------------------------------------------------------------------------
// Per-tensor FP8.

ffi::Error GemmFp8TensorImpl(ffi::AnyBuffer a, ffi::AnyBuffer a_scale,
                             ffi::AnyBuffer b, ffi::AnyBuffer b_scale,
                             ffi::Result<ffi::AnyBuffer> out) {
  const std::string_view op = kOpTensor;
  int64_t M = 0, K = 0, N = 0, Kb = 0;
  Elem ea = Elem::kE4M3, eb = Elem::kE4M3;
  QLAYERS_RETURN_IF_ERROR(Rank2(op, "a", a, &M, &K));
  QLAYERS_RETURN_IF_ERROR(Rank2(op, "b", b, &N, &Kb));
  QLAYERS_RETURN_IF_ERROR(Fp8Operand(op, "a", a, &ea));
  QLAYERS_RETURN_IF_ERROR(Fp8Operand(op, "b", b, &eb));
  if (Kb != K) {
    return InvalidArg(op, "a is (M, K) = ", ShapeStr(a.dimensions()),
                      " and b is (N, K) = ", ShapeStr(b.dimensions()),
                      ": contraction sizes differ");
  }
  QLAYERS_RETURN_IF_ERROR(ExpectScalarF32(op, "a_scale", a_scale));
  QLAYERS_RETURN_IF_ERROR(ExpectScalarF32(op, "b_scale", b_scale));
  QLAYERS_RETURN_IF_ERROR(ExpectWideOutput(op, *out, M, N));

  const float alpha = *static_cast<const float*>(a_scale.untyped_data()) *
                      *static_cast<const float*>(b_scale.untyped_data());
  Fp8Rows ra{Bytes(a), K, DecodeLut(ea)};
  Fp8Rows rb{Bytes(b), K, DecodeLut(eb)};
  return RunGemm(ra, rb, M, N, K, alpha, nullptr, out->untyped_data(),
                 IsBf16(*out));
}

// ---------------------------------------------------------------------------
// OCP MX.

ffi::Error MxElem(std::string_view op, std::string_view what,
                  std::string_view name, Elem* elem) {
  auto e = ParseElem(name);
  if (!e || *e == Elem::kE4M3FNUZ || *e == Elem::kE5M2FNUZ) {
    return InvalidArg(op, what, " must be one of e4m3, e5m2, e3m2, e2m3, "
                      "e2m1, got '", name, "'");
  }
  *elem = *e;
  return ffi::Error::Success();
}

ffi::Error MxScales(std::string_view op, std::string_view what,
                    const ffi::AnyBuffer& s, int64_t* rows, int64_t* blocks) {
  auto t = s.element_type();
  if (t != ffi::DataType::U8 && t != ffi::DataType::F8E8M0FNU) {
    return InvalidArg(op, what, " must hold E8M0 codes as uint8 (or "
                      "float8_e8m0fnu), got ", DtypeName(t));
  }
  return Rank2(op, what, s, rows, blocks);
}

// Payload of an MX operand with `rows` rows and K elements per row.
ffi::Error MxPayload(std::string_view op, std::string_view what,
                     const ffi::AnyBuffer& x, Elem e, int64_t rows,
                     int64_t K) {
  const int64_t want_cols = PackedRowBytes(e, K);
  const auto t = x.element_type();
  if (Info(e).bits == 8) {
    auto xe = ElemOfFp8Dtype(t);
    if (t != ffi::DataType::U8 && !(xe && *xe == e)) {
      return InvalidArg(op, what, " has format ", Info(e).name,
                        " and must be ", e == Elem::kE4M3 ? "float8_e4m3fn" : "float8_e5m2",
                        " (or uint8 codes), got ", DtypeName(t));
    }
  } else if (t != ffi::DataType::U8) {
    return InvalidArg(op, what, " has format ", Info(e).name,
                      " and must be packed uint8, got ", DtypeName(t));
  }
  auto d = x.dimensions();
  if (d.size() != 2 || d[0] != rows || d[1] != want_cols) {
    return InvalidArg(op, what, " (", Info(e).name, ", K = ", K,
                      " from the scales) must have shape (", rows, ", ",
                      want_cols, "), got ", ShapeStr(d));
  }
  return ffi::Error::Success();
}

template <class ADec>
ffi::Error MxDispatchB(const ADec& ra, const ffi::AnyBuffer& b,
                       const ffi::AnyBuffer& bs, Elem eb, int64_t M, int64_t N,
                       int64_t K, ffi::AnyBuffer& out) {
  const int64_t ldb = PackedRowBytes(eb, K);
  const uint8_t* s = Bytes(bs);
  const float* lut = DecodeLut(eb);
  switch (Info(eb).bits) {
    case 8:
      return RunGemm(ra, MxRows<8>{Bytes(b), ldb, s, K / kMxBlock, lut}, M, N,
                     K, 1.0f, nullptr, out.untyped_data(), IsBf16(out));
    case 6:
      return RunGemm(ra, MxRows<6>{Bytes(b), ldb, s, K / kMxBlock, lut}, M, N,
                     K, 1.0f, nullptr, out.untyped_data(), IsBf16(out));
    default:
      return RunGemm(ra, MxRows<4>{Bytes(b), ldb, s, K / kMxBlock, lut}, M, N,
                     K, 1.0f, nullptr, out.untyped_data(), IsBf16(out));
  }
}

ffi::Error GemmMxImpl(ffi::AnyBuffer a, ffi::AnyBuffer a_scales,
                      ffi::AnyBuffer b, ffi::AnyBuffer b_scales,
                      ffi::Result<ffi::AnyBuffer> out,
                      std::string_view a_format, std::string_view b_format) {
  const std::string_view op = kOpMx;
  Elem ea = Elem::kE4M3, eb = Elem::kE4M3;
  QLAYERS_RETURN_IF_ERROR(MxElem(op, "a_format", a_format, &ea));
  QLAYERS_RETURN_IF_ERROR(MxElem(op, "b_format", b_format, &eb));
  int64_t M = 0, KB = 0, N = 0, KBb = 0;
  QLAYERS_RETURN_IF_ERROR(MxScales(op, "a_scales", a_scales, &M, &KB));
  QLAYERS_RETURN_IF_ERROR(MxScales(op, "b_scales", b_scales, &N, &KBb));
  if (KBb != KB) {
    return InvalidArg(op, "a_scales ", ShapeStr(a_scales.dimensions()),
                      " and b_scales ", ShapeStr(b_scales.dimensions()),
                      " disagree on K / 32");
  }
  const int64_t K = KB * kMxBlock;
  QLAYERS_RETURN_IF_ERROR(MxPayload(op, "a", a, ea, M, K));
  QLAYERS_RETURN_IF_ERROR(MxPayload(op, "b", b, eb, N, K));
  QLAYERS_RETURN_IF_ERROR(ExpectWideOutput(op, *out, M, N));

  const int64_t lda = PackedRowBytes(ea, K);
  const uint8_t* s = Bytes(a_scales);
  const float* lut = DecodeLut(ea);
  switch (Info(ea).bits) {
    case 8:
      return MxDispatchB(MxRows<8>{Bytes(a), lda, s, KB, lut}, b, b_scales, eb,
                         M, N, K, *out);
    case 6:
      return MxDispatchB(MxRows<6>{Bytes(a), lda, s, KB, lut}, b, b_scales, eb,
                         M, N, K, *out);
    default:
      return MxDispatchB(MxRows<4>{Bytes(a), lda, s, KB, lut}, b, b_scales, eb,
                         M, N, K, *out);
  }
}

// ---------------------------------------------------------------------------
// Fine-grained (blockwise) FP8.

ffi::Error GemmBlockwiseImpl(ffi::AnyBuffer a, ffi::AnyBuffer a_scales,
                             ffi::AnyBuffer b, ffi::AnyBuffer b_scales,
                             ffi::Result<ffi::AnyBuffer> out,
                             int64_t a_rows_per_scale,
                             int64_t b_rows_per_scale) {
  const std::string_view op = kOpBlockwise;
  for (auto [name, r] : {std::pair<const char*, int64_t>{"a_rows_per_scale", a_rows_per_scale},
                         std::pair<const char*, int64_t>{"b_rows_per_scale", b_rows_per_scale}}) {
    if (r != 1 && r != 128) {
      return InvalidArg(op, name, " must be 1 (1x128 tiles) or 128 "
                        "(128x128 blocks), got ", r);
    }
  }
  int64_t M = 0, K = 0, N = 0, Kb = 0;
  Elem ea = Elem::kE4M3, eb = Elem::kE4M3;
  QLAYERS_RETURN_IF_ERROR(Rank2(op, "a", a, &M, &K));
  QLAYERS_RETURN_IF_ERROR(Rank2(op, "b", b, &N, &Kb));
  QLAYERS_RETURN_IF_ERROR(Fp8Operand(op, "a", a, &ea));
  QLAYERS_RETURN_IF_ERROR(Fp8Operand(op, "b", b, &eb));
  if (Kb != K) {
    return InvalidArg(op, "a is (M, K) = ", ShapeStr(a.dimensions()),
                      " and b is (N, K) = ", ShapeStr(b.dimensions()),
                      ": contraction sizes differ");
  }
  if (K % kBlockwiseChunk != 0) {
    return InvalidArg(op, "K = ", K, " must be a multiple of 128 (pad the "
                      "operands with zeros)");
  }
  const int64_t KB = K / kBlockwiseChunk;
  QLAYERS_RETURN_IF_ERROR(ExpectDtype(op, "a_scales", a_scales, ffi::DataType::F32));
  QLAYERS_RETURN_IF_ERROR(ExpectDtype(op, "b_scales", b_scales, ffi::DataType::F32));
  QLAYERS_RETURN_IF_ERROR(ExpectShape2(op, "a_scales", a_scales,
                                       CeilDiv(M, a_rows_per_scale), KB));
  QLAYERS_RETURN_IF_ERROR(ExpectShape2(op, "b_scales", b_scales,
                                       CeilDiv(N, b_rows_per_scale), KB));
  QLAYERS_RETURN_IF_ERROR(ExpectWideOutput(op, *out, M, N));

  BlockwiseScales bw{static_cast<const float*>(a_scales.untyped_data()), KB,
                     a_rows_per_scale,
                     static_cast<const float*>(b_scales.untyped_data()), KB,
                     b_rows_per_scale};
  Fp8Rows ra{Bytes(a), K, DecodeLut(ea)};
  Fp8Rows rb{Bytes(b), K, DecodeLut(eb)};
  return RunGemm(ra, rb, M, N, K, 1.0f, &bw, out->untyped_data(),
                 IsBf16(*out));
}

}  // namespace
}  // namespace qlayers::cpu

namespace ffi = ::xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(QlayersGemmFp8Tensor,
                              qlayers::cpu::GemmFp8TensorImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // a_scale
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Arg<ffi::AnyBuffer>()  // b_scale
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(QlayersGemmMx, qlayers::cpu::GemmMxImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // a_scales
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Arg<ffi::AnyBuffer>()  // b_scales
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<std::string_view>("a_format")
                                  .Attr<std::string_view>("b_format"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QlayersGemmBlockwise,
                              qlayers::cpu::GemmBlockwiseImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // a_scales
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Arg<ffi::AnyBuffer>()  // b_scales
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("a_rows_per_scale")
                                  .Attr<int64_t>("b_rows_per_scale"));

// Build/run-time description for qlayers._native.build_info().
extern "C" const char* QlayersCpuInfo() {
  thread_local std::string info;
  const auto& k = qlayers::cpu::SelectMicroKernel();
  info = std::string("isa=") + k.isa + " tile=" + std::to_string(k.mr) + "x" +
         std::to_string(k.nr) + " threads=" + std::to_string(qlayers::cpu::MaxThreads());
#ifdef _OPENMP
  info += " openmp=1";
#else
  info += " openmp=0";
#endif
  return info.c_str();
}
