// XLA FFI handler for the end of a training step of delayed scaling on CPU:
// every role of every layer in one custom call, instead of one XLA fusion
// per role (`qlayers.update_scales`), with the same bits as XLA:CPU.
//
// QlayersEndStep (variadic: histories h_0 .. h_{N-1} f32 (H_i,), running
//   amaxes a_0 .. a_{N-1} f32 scalars, gradient amaxes m_0 .. m_{K-1} f32
//   scalars -> new histories f32 (H_i,), then the N cleared running amaxes
//   f32 scalars (0); attribute merged = K):
//   for the first K roles the gradient amax is folded in first, as
//   `qlayers.update_scales` writes a gradient state: a = max(a, m) with a
//   non-finite m read as 0; then `scaling.update_scales`: the history
//   shifts one step (index 0 most recent) and takes a at index 0, or 0 for
//   a non-finite a. `max` is XLA:CPU's (subnormals read as zeros, see
//   `XlaMaximum`); the select passes a through bit for bit. Writing the
//   cleared amaxes here spares XLA one copy of a zero per role (the step's
//   outputs need a buffer each).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "../common/ffi_util.h"
#include "numerics.h"

namespace qlayers::cpu {
namespace {

constexpr std::string_view kOp = "qlayers_end_step";

ffi::ErrorOr<float> Scalar(const ffi::RemainingArgs& args, size_t i,
                           std::string_view what) {
  auto b = args.get<ffi::AnyBuffer>(i);
  if (b.has_error()) return ffi::Unexpected(b.error());
  if (b->element_type() != ffi::DataType::F32 || b->element_count() != 1) {
    return ffi::Unexpected(InvalidArg(kOp, what, " ", i, " must be an f32 "
                                      "scalar, got ",
                                      DtypeName(b->element_type()),
                                      ShapeStr(b->dimensions())));
  }
  return *static_cast<const float*>(b->untyped_data());
}

ffi::Error EndStepImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                       int64_t merged) {
  if (rets.size() % 2 != 0) {
    return InvalidArg(kOp, "expected as many cleared amaxes as histories "
                      "among the ", rets.size(), " results");
  }
  const int64_t n = static_cast<int64_t>(rets.size()) / 2;
  if (merged < 0 || merged > n ||
      static_cast<int64_t>(args.size()) != 2 * n + merged) {
    return InvalidArg(kOp, "expected ", n, " histories, ", n,
                      " running amaxes and ", merged,
                      " gradient amaxes, got ", args.size(), " operands");
  }
  for (int64_t i = 0; i < n; ++i) {
    auto h = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (h.has_error()) return h.error();
    if (out.has_error()) return out.error();
    if (h->element_type() != ffi::DataType::F32 ||
        h->dimensions().size() != 1 || h->element_count() == 0 ||
        (*out)->element_type() != ffi::DataType::F32 ||
        (*out)->element_count() != h->element_count()) {
      return InvalidArg(kOp, "history ", i, " must be a non-empty 1-D f32 "
                        "array with an output of its shape, got ",
                        DtypeName(h->element_type()),
                        ShapeStr(h->dimensions()));
    }
    auto cleared = rets.get<ffi::AnyBuffer>(n + i);
    if (cleared.has_error()) return cleared.error();
    if ((*cleared)->element_type() != ffi::DataType::F32 ||
        (*cleared)->element_count() != 1) {
      return InvalidArg(kOp, "cleared amax ", i, " must be an f32 scalar, "
                        "got ", DtypeName((*cleared)->element_type()),
                        ShapeStr((*cleared)->dimensions()));
    }
    auto a = Scalar(args, n + i, "running amax");
    if (a.has_error()) return a.error();
    float amax = *a;
    if (i < merged) {
      auto m = Scalar(args, 2 * n + i, "gradient amax");
      if (m.has_error()) return m.error();
      amax = XlaMaximum(amax, std::isfinite(*m) ? *m : 0.0f);
    }
    const float* src = static_cast<const float*>(h->untyped_data());
    float* dst = static_cast<float*>((*out)->untyped_data());
    const size_t len = h->element_count();
    // memmove: XLA may give the output the history's buffer.
    std::memmove(dst + 1, src, (len - 1) * sizeof(float));
    dst[0] = std::isfinite(amax) ? amax : 0.0f;
    *static_cast<float*>((*cleared)->untyped_data()) = 0.0f;
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace qlayers::cpu

namespace ffi = ::xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(QlayersEndStep, qlayers::cpu::EndStepImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("merged"));
