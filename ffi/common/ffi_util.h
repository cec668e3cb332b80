// Small helpers for validating XLA FFI buffers with readable error messages.
// Every handler validates dtypes, ranks and shapes before touching memory and
// returns ffi::Error::InvalidArgument on the first mismatch.
#ifndef QLAYERS_FFI_COMMON_FFI_UTIL_H_
#define QLAYERS_FFI_COMMON_FFI_UTIL_H_

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>

#include "elem_format.h"
#include "xla/ffi/api/ffi.h"

namespace qlayers {

namespace ffi = ::xla::ffi;

inline const char* DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    case ffi::DataType::F8E4M3FNUZ: return "float8_e4m3fnuz";
    case ffi::DataType::F8E5M2FNUZ: return "float8_e5m2fnuz";
    case ffi::DataType::F8E4M3: return "float8_e4m3";
    case ffi::DataType::F8E3M4: return "float8_e3m4";
    case ffi::DataType::F8E8M0FNU: return "float8_e8m0fnu";
    case ffi::DataType::F4E2M1FN: return "float4_e2m1fn";
    default: return "unsupported dtype";
  }
}

// The fp8 element format stored in an XLA fp8 buffer, if any.
inline std::optional<Elem> ElemOfFp8Dtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F8E4M3FN: return Elem::kE4M3;
    case ffi::DataType::F8E5M2: return Elem::kE5M2;
    case ffi::DataType::F8E4M3FNUZ: return Elem::kE4M3FNUZ;
    case ffi::DataType::F8E5M2FNUZ: return Elem::kE5M2FNUZ;
    default: return std::nullopt;
  }
}

inline std::string ShapeStr(ffi::AnyBuffer::Dimensions d) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < d.size(); ++i) os << (i ? ", " : "") << d[i];
  if (d.size() == 1) os << ",";
  os << ")";
  return os.str();
}

template <typename... Args>
ffi::Error InvalidArg(std::string_view op, Args&&... parts) {
  std::ostringstream os;
  os << op << ": ";
  (os << ... << std::forward<Args>(parts));
  return ffi::Error::InvalidArgument(os.str());
}

// Shape (rows, cols) of a rank-2 buffer, or an error naming `what`.
inline ffi::Error Rank2(std::string_view op, std::string_view what,
                        const ffi::AnyBuffer& b, int64_t* rows,
                        int64_t* cols) {
  auto d = b.dimensions();
  if (d.size() != 2) {
    return InvalidArg(op, what, " must be rank 2, got shape ", ShapeStr(d));
  }
  *rows = d[0];
  *cols = d[1];
  return ffi::Error::Success();
}

inline ffi::Error ExpectShape2(std::string_view op, std::string_view what,
                               const ffi::AnyBuffer& b, int64_t rows,
                               int64_t cols) {
  auto d = b.dimensions();
  if (d.size() != 2 || d[0] != rows || d[1] != cols) {
    return InvalidArg(op, what, " must have shape (", rows, ", ", cols,
                      "), got ", ShapeStr(d));
  }
  return ffi::Error::Success();
}

inline ffi::Error ExpectDtype(std::string_view op, std::string_view what,
                              const ffi::AnyBuffer& b, ffi::DataType want) {
  if (b.element_type() != want) {
    return InvalidArg(op, what, " must be ", DtypeName(want), ", got ",
                      DtypeName(b.element_type()));
  }
  return ffi::Error::Success();
}

// A per-tensor scale: float32 with exactly one element, shape () or (1,).
inline ffi::Error ExpectScalarF32(std::string_view op, std::string_view what,
                                  const ffi::AnyBuffer& b) {
  if (b.element_type() != ffi::DataType::F32) {
    return InvalidArg(op, what, " must be float32, got ",
                      DtypeName(b.element_type()));
  }
  auto d = b.dimensions();
  if (d.size() > 1 || b.element_count() != 1) {
    return InvalidArg(op, what, " must have shape () or (1,), got ",
                      ShapeStr(d));
  }
  return ffi::Error::Success();
}

inline ffi::Error ExpectWideOutput(std::string_view op,
                                   const ffi::AnyBuffer& out, int64_t m,
                                   int64_t n) {
  auto t = out.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16) {
    return InvalidArg(op, "output must be float32 or bfloat16, got ",
                      DtypeName(t));
  }
  return ExpectShape2(op, "output", out, m, n);
}

#define QLAYERS_RETURN_IF_ERROR(expr)                 \
  do {                                                \
    ::xla::ffi::Error qlayers_err_ = (expr);          \
    if (qlayers_err_.failure()) return qlayers_err_;  \
  } while (0)

}  // namespace qlayers

#endif  // QLAYERS_FFI_COMMON_FFI_UTIL_H_
