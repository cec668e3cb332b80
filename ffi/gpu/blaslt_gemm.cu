// GPU GEMM handlers on cuBLASLt / hipBLASLt (one source, see blaslt_compat.h).
//
// Same contract as the CPU handlers: OUT (M, N) = A (M, K) @ B (N, K)^T,
// both operands contraction-last, FP32 accumulation, f32 or bf16 output.
//
//   QlayersGemmFp8TensorGpu  per-tensor fp8 through the A/B scale pointers
//                            (sm_89/sm_90/sm_100 OCP; gfx942 FNUZ, gfx950 OCP)
//   QlayersGemmMxGpu         MXFP8 (e4m3/e5m2) with VEC32_UE8M0 block scales
//                            (sm_100, gfx950)
//   QlayersGemmFp8RowwiseGpu row-wise fp8: OUTER_VEC_32F, one f32 scale per
//                            row of A and of B (CUDA: sm_90, cuBLAS >= 12.9)
//   QlayersGemmBlockwiseGpu  DeepSeek-style fp8: VEC128_32F (1x128 tiles) and
//                            BLK128x128_32F (128x128 blocks) f32 scales
//                            (CUDA: sm_90, cuBLAS >= 12.9)
//
// The last two use the Hopper scale modes that cuBLAS 12.9 added
// (cublasLtMatmulMatrixScale_t in cublasLt.h; NVIDIA technical blog
// "Boosting Matrix Multiplication Speed and Flexibility with NVIDIA cuBLAS
// 12.9": channel- and block-scaled FP8 on Hopper). They are compiled only
// against such a cuBLASLt and registered only when the library has them
// (qlayers/_native.py). None of these handlers has run on a GPU yet.
//
// The BLAS libraries are column-major. Our row-major OUT (M, N) is the
// column-major matrix OUT^T (N x M) = B (N x K) . A^T, so the library's "A"
// is our B read transposed (K x N column-major, ld = K, op T) and its "B" is
// our A (K x M column-major, ld = K, op N): the TN layout fp8 kernels need.
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>

#include "../common/elem_format.h"
#include "../common/ffi_util.h"
#include "blaslt_compat.h"

namespace qlayers::gpu {
namespace {

constexpr std::string_view kOpTensor = "qlayers_gemm_fp8_tensor";
constexpr std::string_view kOpMx = "qlayers_gemm_mx";
constexpr std::string_view kOpRowwise = "qlayers_gemm_fp8_rowwise";
constexpr std::string_view kOpBlockwise = "qlayers_gemm_blockwise";
constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // cuBLAS guidance for sm_90+

std::string StatusText(LtStatus s) {
#if defined(QLAYERS_ROCM)
  return "hipblas status " + std::to_string(static_cast<int>(s));
#else
  return std::string(cublasLtGetStatusName(s)) + " (" +
         cublasLtGetStatusString(s) + ")";
#endif
}

#define QL_LT_CHECK(expr)                                                  \
  do {                                                                     \
    LtStatus st_ = (expr);                                                 \
    if (st_ != kLtSuccess) {                                               \
      return ffi::Error::Internal(std::string(kLibrary) + " call " #expr   \
                                  " failed: " + StatusText(st_));          \
    }                                                                      \
  } while (0)

// One library handle per device, created on first use.
ffi::ErrorOr<LtHandle> HandleForCurrentDevice() {
  static std::mutex mu;
  static std::map<int, LtHandle> handles;
  int dev = 0;
  if (QL_GPU(GetDevice)(&dev) != QL_GPU(Success)) {
    return ffi::Unexpected(ffi::Error::Internal("qlayers: no current GPU device"));
  }
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles.find(dev);
  if (it != handles.end()) return it->second;
  LtHandle h;
  LtStatus st = QL_LT(Create)(&h);
  if (st != kLtSuccess) {
    return ffi::Unexpected(ffi::Error::Internal(
        std::string(kLibrary) + " handle creation failed: " + StatusText(st)));
  }
  handles.emplace(dev, h);
  return h;
}

// RAII owners for the descriptors.
struct Desc {
  LtMatmulDesc op = nullptr;
  LtLayout a = nullptr, b = nullptr, d = nullptr;
  LtPreference pref = nullptr;
  ~Desc() {
    if (pref) QL_LT(MatmulPreferenceDestroy)(pref);
    if (d) QL_LT(MatrixLayoutDestroy)(d);
    if (b) QL_LT(MatrixLayoutDestroy)(b);
    if (a) QL_LT(MatrixLayoutDestroy)(a);
    if (op) QL_LT(MatmulDescDestroy)(op);
  }
};

// Heuristic results depend on the problem, not on pointers: cache them.
using AlgoKey = std::tuple<int, int, int, int64_t, int64_t, int64_t, int, int, int>;

// Scale mode of one operand (cublasLtMatmulMatrixScale_t values); scalar
// per-tensor scales leave the attribute unset.
constexpr int32_t kScaleScalar = 0;

struct Problem {
  int64_t M, N, K;
  DataType a_type, b_type, out_type;
  int32_t a_mode = kScaleScalar;  // scale mode of our A / our B
  int32_t b_mode = kScaleScalar;
  const char* what;    // for errors: "fp8", "MX", ...
  const void* a;       // our A (M, K)
  const void* b;       // our B (N, K)
  const void* a_scale; // device pointer (scalar f32, vector or scale tensor)
  const void* b_scale;
  void* out;
};

ffi::Error RunLt(Stream stream, ffi::ScratchAllocator& scratch,
                 const Problem& p) {
  auto handle = HandleForCurrentDevice();
  if (!handle) return handle.error();

  Desc desc;
  QL_LT_CHECK(QL_LT(MatmulDescCreate)(&desc.op, QL_BLAS_ENUM(COMPUTE_32F), kF32));
  const LtOperation op_t = QL_BLAS_ENUM(OP_T), op_n = QL_BLAS_ENUM(OP_N);
  QL_LT_CHECK(QL_LT(MatmulDescSetAttribute)(desc.op, QL_LT_ENUM(MATMUL_DESC_TRANSA),
                                            &op_t, sizeof(op_t)));
  QL_LT_CHECK(QL_LT(MatmulDescSetAttribute)(desc.op, QL_LT_ENUM(MATMUL_DESC_TRANSB),
                                            &op_n, sizeof(op_n)));
  // The library's A is our B and vice versa (see the file comment).
  QL_LT_CHECK(QL_LT(MatmulDescSetAttribute)(desc.op, QL_LT_ENUM(MATMUL_DESC_A_SCALE_POINTER),
                                            &p.b_scale, sizeof(p.b_scale)));
  QL_LT_CHECK(QL_LT(MatmulDescSetAttribute)(desc.op, QL_LT_ENUM(MATMUL_DESC_B_SCALE_POINTER),
                                            &p.a_scale, sizeof(p.a_scale)));
  // Scale modes swap with the operands, like the pointers.
  if (p.b_mode != kScaleScalar) {
    QL_LT_CHECK(QL_LT(MatmulDescSetAttribute)(desc.op, QL_LT_ENUM(MATMUL_DESC_A_SCALE_MODE),
                                              &p.b_mode, sizeof(p.b_mode)));
  }
  if (p.a_mode != kScaleScalar) {
    QL_LT_CHECK(QL_LT(MatmulDescSetAttribute)(desc.op, QL_LT_ENUM(MATMUL_DESC_B_SCALE_MODE),
                                              &p.a_mode, sizeof(p.a_mode)));
  }
  QL_LT_CHECK(QL_LT(MatrixLayoutCreate)(&desc.a, p.b_type, p.K, p.N, p.K));
  QL_LT_CHECK(QL_LT(MatrixLayoutCreate)(&desc.b, p.a_type, p.K, p.M, p.K));
  QL_LT_CHECK(QL_LT(MatrixLayoutCreate)(&desc.d, p.out_type, p.N, p.M, p.N));
  QL_LT_CHECK(QL_LT(MatmulPreferenceCreate)(&desc.pref));
  const uint64_t ws_limit = kWorkspaceBytes;
  QL_LT_CHECK(QL_LT(MatmulPreferenceSetAttribute)(desc.pref,
                                                  QL_LT_ENUM(MATMUL_PREF_MAX_WORKSPACE_BYTES),
                                                  &ws_limit, sizeof(ws_limit)));

  int dev = 0;
  QL_GPU(GetDevice)(&dev);
  const AlgoKey key{dev, p.a_mode, p.b_mode, p.M, p.N, p.K, static_cast<int>(p.a_type),
                    static_cast<int>(p.b_type), static_cast<int>(p.out_type)};
  static std::mutex mu;
  static std::map<AlgoKey, LtHeuristic> cache;
  LtHeuristic algo;
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) {
      algo = it->second;
      cached = true;
    }
  }
  if (!cached) {
    int found = 0;
    std::memset(&algo, 0, sizeof(algo));
    QL_LT_CHECK(QL_LT(MatmulAlgoGetHeuristic)(*handle, desc.op, desc.a, desc.b, desc.d,
                                              desc.d, desc.pref, 1, &algo, &found));
    if (found == 0) {
      return ffi::Error(ffi::ErrorCode::kUnimplemented,
                        std::string(kLibrary) + " has no kernel for this " + p.what +
                            " GEMM (M=" + std::to_string(p.M) + ", N=" + std::to_string(p.N) +
                            ", K=" + std::to_string(p.K) +
                            ") on this device; fp8 needs sm_89+/gfx942+, MX sm_100+/gfx950, "
                            "row-wise and blockwise fp8 sm_90");
    }
    std::lock_guard<std::mutex> lock(mu);
    cache.emplace(key, algo);
  }

  void* workspace = nullptr;
  if (algo.workspaceSize > 0) {
    auto ws = scratch.Allocate(algo.workspaceSize, 256);
    if (!ws) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        "qlayers: could not allocate GEMM workspace");
    }
    workspace = *ws;
  }
  const float alpha = 1.0f, beta = 0.0f;
  QL_LT_CHECK(QL_LT(Matmul)(*handle, desc.op, &alpha, p.b, desc.a, p.a, desc.b, &beta,
                            p.out, desc.d, p.out, desc.d, &algo.algo, workspace,
                            algo.workspaceSize, stream));
  return ffi::Error::Success();
}

ffi::Error CheckAligned16(std::string_view op, int64_t M, int64_t N, int64_t K,
                          int64_t k_multiple) {
  if (M % 16 != 0 || N % 16 != 0 || K % k_multiple != 0) {
    return InvalidArg(op, kLibrary, " needs M and N multiples of 16 and K a multiple of ",
                      k_multiple, "; got M=", M, ", N=", N, ", K=", K,
                      " (pad the operands, or use the CPU/XLA path)");
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<DataType> OutType(std::string_view op, const ffi::AnyBuffer& out,
                               int64_t M, int64_t N) {
  ffi::Error e = ExpectWideOutput(op, out, M, N);
  if (e.failure()) return ffi::Unexpected(std::move(e));
  return out.element_type() == ffi::DataType::BF16 ? kBF16 : kF32;
}

ffi::Error OperandType(std::string_view op, std::string_view what, Elem e,
                       DataType* t) {
  auto dt = Fp8Type(e);
  if (!dt) {
    return InvalidArg(op, what, " format ", Info(e).name, " is not supported by ",
                      kLibrary, " on ", kPlatform);
  }
  *t = *dt;
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------

ffi::Error GemmFp8TensorGpuImpl(Stream stream, ffi::ScratchAllocator scratch,
                                ffi::AnyBuffer a, ffi::AnyBuffer a_scale,
                                ffi::AnyBuffer b, ffi::AnyBuffer b_scale,
                                ffi::Result<ffi::AnyBuffer> out) {
  const std::string_view op = kOpTensor;
  int64_t M = 0, K = 0, N = 0, Kb = 0;
  QLAYERS_RETURN_IF_ERROR(Rank2(op, "a", a, &M, &K));
  QLAYERS_RETURN_IF_ERROR(Rank2(op, "b", b, &N, &Kb));
  auto ea = ElemOfFp8Dtype(a.element_type());
  auto eb = ElemOfFp8Dtype(b.element_type());
  if (!ea || !eb) {
    return InvalidArg(op, "a and b must be fp8 arrays, got ", DtypeName(a.element_type()),
                      " and ", DtypeName(b.element_type()));
  }
  if (Kb != K) {
    return InvalidArg(op, "a ", ShapeStr(a.dimensions()), " and b ",
                      ShapeStr(b.dimensions()), ": contraction sizes differ");
  }
  if ((*ea == Elem::kE5M2 || *ea == Elem::kE5M2FNUZ) &&
      (*eb == Elem::kE5M2 || *eb == Elem::kE5M2FNUZ)) {
    return InvalidArg(op, "e5m2 x e5m2 has no fp8 BLAS kernel; use e4m3 for one operand");
  }
  QLAYERS_RETURN_IF_ERROR(ExpectScalarF32(op, "a_scale", a_scale));
  QLAYERS_RETURN_IF_ERROR(ExpectScalarF32(op, "b_scale", b_scale));
  auto out_type = OutType(op, *out, M, N);
  if (!out_type) return out_type.error();
  QLAYERS_RETURN_IF_ERROR(CheckAligned16(op, M, N, K, 16));
  Problem p{};
  QLAYERS_RETURN_IF_ERROR(OperandType(op, "a", *ea, &p.a_type));
  QLAYERS_RETURN_IF_ERROR(OperandType(op, "b", *eb, &p.b_type));
  p.M = M; p.N = N; p.K = K;
  p.out_type = *out_type;
  p.what = "fp8";
  p.a = a.untyped_data();
  p.b = b.untyped_data();
  p.a_scale = a_scale.untyped_data();
  p.b_scale = b_scale.untyped_data();
  p.out = out->untyped_data();
  return RunLt(stream, scratch, p);
}

// Row-major (rows, cols) E8M0 codes -> cuBLASLt's tiled layout: 128 x 4
// tiles stored tile-row-major, and inside a tile the entry (r, c) at byte
// (r % 32) * 16 + (r / 32) * 4 + c (cuBLAS documentation, "1D Block Scaling
// Factors Layout"). Padding entries are zero.
__global__ void SwizzleMxScales(const uint8_t* in, int64_t rows, int64_t cols,
                                int64_t padded_rows, int64_t padded_cols,
                                uint8_t* out) {
  const int64_t n = padded_rows * padded_cols;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / padded_cols, c = idx % padded_cols;
    const uint8_t v = (r < rows && c < cols) ? in[r * cols + c] : uint8_t{0};
    const int64_t tile = (r / 128) * (padded_cols / 4) + c / 4;
    const int64_t rr = r % 128;
    out[tile * 512 + (rr % 32) * 16 + (rr / 32) * 4 + (c % 4)] = v;
  }
}

ffi::ErrorOr<const void*> PrepareMxScales(Stream stream, ffi::ScratchAllocator& scratch,
                                          const ffi::AnyBuffer& s, int64_t rows,
                                          int64_t cols) {
  if (!kSwizzleMxScales) return static_cast<const void*>(s.untyped_data());
  const int64_t pr = (rows + 127) / 128 * 128, pc = (cols + 3) / 4 * 4;
  auto buf = scratch.Allocate(static_cast<size_t>(pr * pc), 256);
  if (!buf) {
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kResourceExhausted,
                                      "qlayers: could not allocate MX scale buffer"));
  }
  const int threads = 256;
  const int64_t blocks64 = (pr * pc + threads - 1) / threads;
  const int blocks = static_cast<int>(blocks64 < 4096 ? blocks64 : 4096);
  SwizzleMxScales<<<blocks, threads, 0, stream>>>(
      static_cast<const uint8_t*>(s.untyped_data()), rows, cols, pr, pc,
      static_cast<uint8_t*>(*buf));
  if (QL_GPU(GetLastError)() != QL_GPU(Success)) {
    return ffi::Unexpected(ffi::Error::Internal("qlayers: MX scale swizzle launch failed"));
  }
  return static_cast<const void*>(*buf);
}

ffi::Error GemmMxGpuImpl(Stream stream, ffi::ScratchAllocator scratch,
                         ffi::AnyBuffer a, ffi::AnyBuffer a_scales,
                         ffi::AnyBuffer b, ffi::AnyBuffer b_scales,
                         ffi::Result<ffi::AnyBuffer> out,
                         std::string_view a_format, std::string_view b_format) {
  const std::string_view op = kOpMx;
  auto ea = ParseElem(a_format), eb = ParseElem(b_format);
  if (!ea || !eb || Info(*ea).bits != 8 || Info(*eb).bits != 8 ||
      Info(*ea).fnuz || Info(*eb).fnuz) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string(op) + ": the " + kPlatform +
                          " MX GEMM supports e4m3/e5m2 payloads only, got '" +
                          std::string(a_format) + "' x '" + std::string(b_format) + "'");
  }
  int64_t M = 0, KB = 0, N = 0, KBb = 0;
  for (const ffi::AnyBuffer* s : {&a_scales, &b_scales}) {
    if (s->element_type() != ffi::DataType::U8 &&
        s->element_type() != ffi::DataType::F8E8M0FNU) {
      return InvalidArg(op, "scales must be uint8 E8M0 codes, got ",
                        DtypeName(s->element_type()));
    }
  }
  QLAYERS_RETURN_IF_ERROR(Rank2(op, "a_scales", a_scales, &M, &KB));
  QLAYERS_RETURN_IF_ERROR(Rank2(op, "b_scales", b_scales, &N, &KBb));
  if (KB != KBb) {
    return InvalidArg(op, "a_scales ", ShapeStr(a_scales.dimensions()), " and b_scales ",
                      ShapeStr(b_scales.dimensions()), " disagree on K / 32");
  }
  const int64_t K = KB * kMxBlock;
  for (auto [x, e, rows, name] : {std::tuple{&a, *ea, M, "a"}, std::tuple{&b, *eb, N, "b"}}) {
    auto xe = ElemOfFp8Dtype(x->element_type());
    if (x->element_type() != ffi::DataType::U8 && !(xe && *xe == e)) {
      return InvalidArg(op, name, " dtype ", DtypeName(x->element_type()),
                        " does not match its format ", Info(e).name);
    }
    QLAYERS_RETURN_IF_ERROR(ExpectShape2(op, name, *x, rows, K));
  }
  if (*ea == Elem::kE5M2 && *eb == Elem::kE5M2) {
    return InvalidArg(op, "e5m2 x e5m2 has no MX BLAS kernel; use e4m3 for one operand");
  }
  auto out_type = OutType(op, *out, M, N);
  if (!out_type) return out_type.error();
  QLAYERS_RETURN_IF_ERROR(CheckAligned16(op, M, N, K, kMxKMultiple));

  auto sa = PrepareMxScales(stream, scratch, a_scales, M, KB);
  if (!sa) return sa.error();
  auto sb = PrepareMxScales(stream, scratch, b_scales, N, KB);
  if (!sb) return sb.error();
  Problem p{};
  QLAYERS_RETURN_IF_ERROR(OperandType(op, "a", *ea, &p.a_type));
  QLAYERS_RETURN_IF_ERROR(OperandType(op, "b", *eb, &p.b_type));
  p.M = M; p.N = N; p.K = K;
  p.out_type = *out_type;
  p.a_mode = p.b_mode = QL_LT_ENUM(MATMUL_MATRIX_SCALE_VEC32_UE8M0);
  p.what = "MX";
  p.a = a.untyped_data();
  p.b = b.untyped_data();
  p.a_scale = *sa;
  p.b_scale = *sb;
  p.out = out->untyped_data();
  return RunLt(stream, scratch, p);
}

#if QLAYERS_HAVE_LT_BLOCK_SCALING

ffi::Error Fp8Pair(std::string_view op, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                   Problem* p) {
  auto ea = ElemOfFp8Dtype(a.element_type());
  auto eb = ElemOfFp8Dtype(b.element_type());
  if (!ea || !eb) {
    return InvalidArg(op, "a and b must be fp8 arrays, got ", DtypeName(a.element_type()),
                      " and ", DtypeName(b.element_type()));
  }
  if (*ea == Elem::kE5M2 && *eb == Elem::kE5M2) {
    return InvalidArg(op, "e5m2 x e5m2 has no fp8 BLAS kernel; use e4m3 for one operand");
  }
  QLAYERS_RETURN_IF_ERROR(OperandType(op, "a", *ea, &p->a_type));
  return OperandType(op, "b", *eb, &p->b_type);
}

ffi::Error ExpectF32Vector(std::string_view op, std::string_view what,
                           const ffi::AnyBuffer& s, int64_t n) {
  QLAYERS_RETURN_IF_ERROR(ExpectDtype(op, what, s, ffi::DataType::F32));
  if (s.element_count() != static_cast<size_t>(n) || s.dimensions().size() > 2) {
    return InvalidArg(op, what, " must hold ", n, " float32 scales (one per row), got shape ",
                      ShapeStr(s.dimensions()));
  }
  return ffi::Error::Success();
}

ffi::Error GemmFp8RowwiseGpuImpl(Stream stream, ffi::ScratchAllocator scratch,
                                 ffi::AnyBuffer a, ffi::AnyBuffer a_scales,
                                 ffi::AnyBuffer b, ffi::AnyBuffer b_scales,
                                 ffi::Result<ffi::AnyBuffer> out) {
  const std::string_view op = kOpRowwise;
  int64_t M = 0, K = 0, N = 0, Kb = 0;
  QLAYERS_RETURN_IF_ERROR(Rank2(op, "a", a, &M, &K));
  QLAYERS_RETURN_IF_ERROR(Rank2(op, "b", b, &N, &Kb));
  if (Kb != K) {
    return InvalidArg(op, "a ", ShapeStr(a.dimensions()), " and b ",
                      ShapeStr(b.dimensions()), ": contraction sizes differ");
  }
  Problem p{};
  QLAYERS_RETURN_IF_ERROR(Fp8Pair(op, a, b, &p));
  QLAYERS_RETURN_IF_ERROR(ExpectF32Vector(op, "a_scales", a_scales, M));
  QLAYERS_RETURN_IF_ERROR(ExpectF32Vector(op, "b_scales", b_scales, N));
  auto out_type = OutType(op, *out, M, N);
  if (!out_type) return out_type.error();
  QLAYERS_RETURN_IF_ERROR(CheckAligned16(op, M, N, K, 16));
  p.M = M; p.N = N; p.K = K;
  p.out_type = *out_type;
  // One scale per row of our A (cuBLASLt's n) and of our B (its m): the
  // outer-vector mode multiplies output (i, j) by the i-th and j-th.
  p.a_mode = p.b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  p.what = "row-wise fp8";
  p.a = a.untyped_data();
  p.b = b.untyped_data();
  p.a_scale = a_scales.untyped_data();
  p.b_scale = b_scales.untyped_data();
  p.out = out->untyped_data();
  return RunLt(stream, scratch, p);
}

constexpr int64_t kBlock = 128;

// Our row-major block scales (ceil(rows / rows_per_scale), kb) -> the
// layouts cuBLASLt reads. cublasLt.h (13.10) only says "one FP32 factor per
// 128-element block" / "per 128x128 block"; the strides below are the ones
// PyTorch's _scaled_mm demands for these two modes before it calls cuBLASLt
// (aten/src/ATen/native/cuda/ScaledBlas.cpp, checks of scale strides), and
// they have not been run here:
//   VEC128_32F (rows_per_scale 1): outer dimension fastest, entry (r, c) at
//     c * rows + r;
//   BLK128x128_32F (rows_per_scale 128): K blocks fastest, rows of
//     round_up(kb, 4) entries, entry (r, c) at r * round_up(kb, 4) + c (the
//     padding entries are never read for K a multiple of 128; zeroed).
__global__ void RelayoutBlockScales(const float* in, int64_t rows, int64_t kb,
                                    bool blocks, float* out) {
  const int64_t kb4 = (kb + 3) / 4 * 4;
  const int64_t n = rows * (blocks ? kb4 : kb);
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (blocks) {
      const int64_t r = idx / kb4, c = idx % kb4;
      out[idx] = c < kb ? in[r * kb + c] : 0.0f;
    } else {
      const int64_t c = idx / rows, r = idx % rows;
      out[idx] = in[r * kb + c];
    }
  }
}

ffi::ErrorOr<const void*> PrepareBlockScales(Stream stream, ffi::ScratchAllocator& scratch,
                                             const ffi::AnyBuffer& s, int64_t scale_rows,
                                             int64_t kb, bool blocks) {
  const int64_t n = scale_rows * (blocks ? (kb + 3) / 4 * 4 : kb);
  auto buf = scratch.Allocate(static_cast<size_t>(n) * sizeof(float), 256);
  if (!buf) {
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kResourceExhausted,
                                      "qlayers: could not allocate the block scale buffer"));
  }
  const int threads = 256;
  const int64_t blocks64 = (n + threads - 1) / threads;
  const int grid = static_cast<int>(blocks64 < 4096 ? blocks64 : 4096);
  RelayoutBlockScales<<<grid, threads, 0, stream>>>(
      static_cast<const float*>(s.untyped_data()), scale_rows, kb, blocks,
      static_cast<float*>(*buf));
  if (QL_GPU(GetLastError)() != QL_GPU(Success)) {
    return ffi::Unexpected(ffi::Error::Internal("qlayers: block scale relayout launch failed"));
  }
  return static_cast<const void*>(*buf);
}

ffi::Error GemmBlockwiseGpuImpl(Stream stream, ffi::ScratchAllocator scratch,
                                ffi::AnyBuffer a, ffi::AnyBuffer a_scales,
                                ffi::AnyBuffer b, ffi::AnyBuffer b_scales,
                                ffi::Result<ffi::AnyBuffer> out, int64_t a_rows_per_scale,
                                int64_t b_rows_per_scale) {
  const std::string_view op = kOpBlockwise;
  int64_t M = 0, K = 0, N = 0, Kb = 0;
  QLAYERS_RETURN_IF_ERROR(Rank2(op, "a", a, &M, &K));
  QLAYERS_RETURN_IF_ERROR(Rank2(op, "b", b, &N, &Kb));
  if (Kb != K) {
    return InvalidArg(op, "a ", ShapeStr(a.dimensions()), " and b ",
                      ShapeStr(b.dimensions()), ": contraction sizes differ");
  }
  for (int64_t r : {a_rows_per_scale, b_rows_per_scale}) {
    if (r != 1 && r != kBlock) {
      return InvalidArg(op, "rows per scale must be 1 (1x128 tiles) or 128 (128x128 blocks), got ",
                        r);
    }
  }
  if (a_rows_per_scale == kBlock && b_rows_per_scale == kBlock) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string(op) + ": cuBLASLt has no 128x128 x 128x128 block-scaled "
                                        "kernel; quantize one operand in 1x128 tiles");
  }
  if (K % kBlock != 0) {
    return InvalidArg(op, "K must be a multiple of 128 (pad with zeros), got ", K);
  }
  Problem p{};
  QLAYERS_RETURN_IF_ERROR(Fp8Pair(op, a, b, &p));
  if (p.a_type != CUDA_R_8F_E4M3 || p.b_type != CUDA_R_8F_E4M3) {
    return InvalidArg(op, "block-scaled cuBLASLt GEMMs take e4m3 x e4m3 operands");
  }
  const int64_t kb = K / kBlock;
  const int64_t a_rows = (M + a_rows_per_scale - 1) / a_rows_per_scale;
  const int64_t b_rows = (N + b_rows_per_scale - 1) / b_rows_per_scale;
  QLAYERS_RETURN_IF_ERROR(ExpectDtype(op, "a_scales", a_scales, ffi::DataType::F32));
  QLAYERS_RETURN_IF_ERROR(ExpectDtype(op, "b_scales", b_scales, ffi::DataType::F32));
  QLAYERS_RETURN_IF_ERROR(ExpectShape2(op, "a_scales", a_scales, a_rows, kb));
  QLAYERS_RETURN_IF_ERROR(ExpectShape2(op, "b_scales", b_scales, b_rows, kb));
  auto out_type = OutType(op, *out, M, N);
  if (!out_type) return out_type.error();
  QLAYERS_RETURN_IF_ERROR(CheckAligned16(op, M, N, K, kBlock));
  auto sa = PrepareBlockScales(stream, scratch, a_scales, a_rows, kb, a_rows_per_scale == kBlock);
  if (!sa) return sa.error();
  auto sb = PrepareBlockScales(stream, scratch, b_scales, b_rows, kb, b_rows_per_scale == kBlock);
  if (!sb) return sb.error();
  p.M = M; p.N = N; p.K = K;
  p.out_type = *out_type;
  p.a_mode = a_rows_per_scale == kBlock ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                        : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  p.b_mode = b_rows_per_scale == kBlock ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                        : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  p.what = "blockwise fp8";
  p.a = a.untyped_data();
  p.b = b.untyped_data();
  p.a_scale = *sa;
  p.b_scale = *sb;
  p.out = out->untyped_data();
  return RunLt(stream, scratch, p);
}

#endif  // QLAYERS_HAVE_LT_BLOCK_SCALING

}  // namespace
}  // namespace qlayers::gpu

namespace ffi = ::xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(QlayersGemmFp8TensorGpu,
                              qlayers::gpu::GemmFp8TensorGpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<qlayers::gpu::Stream>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // a_scale
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Arg<ffi::AnyBuffer>()  // b_scale
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(QlayersGemmMxGpu, qlayers::gpu::GemmMxGpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<qlayers::gpu::Stream>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // a_scales
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Arg<ffi::AnyBuffer>()  // b_scales
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<std::string_view>("a_format")
                                  .Attr<std::string_view>("b_format"));

#if QLAYERS_HAVE_LT_BLOCK_SCALING
XLA_FFI_DEFINE_HANDLER_SYMBOL(QlayersGemmFp8RowwiseGpu, qlayers::gpu::GemmFp8RowwiseGpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<qlayers::gpu::Stream>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // a_scales (M,)
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Arg<ffi::AnyBuffer>()  // b_scales (N,)
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(QlayersGemmBlockwiseGpu, qlayers::gpu::GemmBlockwiseGpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<qlayers::gpu::Stream>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // a_scales
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Arg<ffi::AnyBuffer>()  // b_scales
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("a_rows_per_scale")
                                  .Attr<int64_t>("b_rows_per_scale"));
#endif

extern "C" const char* QlayersGpuInfo() {
  static const std::string info = std::string("platform=") + qlayers::gpu::kPlatform +
                                  " library=" + qlayers::gpu::kLibrary +
                                  " block_scaling=" +
                                  (QLAYERS_HAVE_LT_BLOCK_SCALING ? "1" : "0");
  return info.c_str();
}
