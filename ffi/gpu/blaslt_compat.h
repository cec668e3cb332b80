// Thin portability layer over cuBLASLt (CUDA) and hipBLASLt (ROCm).
//
// hipBLASLt mirrors the cuBLASLt C API name for name (cublasLt* <->
// hipblasLt*, CUBLASLT_* <-> HIPBLASLT_*, CUBLAS_* <-> HIPBLAS_*), so the
// GEMM source is written once against the macros below. Define QLAYERS_ROCM
// to build for ROCm; the default is CUDA.
#ifndef QLAYERS_FFI_GPU_BLASLT_COMPAT_H_
#define QLAYERS_FFI_GPU_BLASLT_COMPAT_H_

#include <cstdint>
#include <optional>

#include "../common/elem_format.h"

#if defined(QLAYERS_ROCM)

#include <hip/hip_runtime.h>
#include <hipblaslt/hipblaslt.h>

#define QL_LT(name) hipblasLt##name               // hipblasLtMatmul, ...
#define QL_LT_ENUM(name) HIPBLASLT_##name         // HIPBLASLT_MATMUL_DESC_*
#define QL_BLAS(name) hipblas##name               // hipblasStatus_t, ...
#define QL_BLAS_ENUM(name) HIPBLAS_##name         // HIPBLAS_OP_T, ...
#define QL_GPU(name) hip##name                    // hipStream_t, ...

namespace qlayers::gpu {
inline constexpr const char* kPlatform = "ROCM";
inline constexpr const char* kLibrary = "hipBLASLt";
using DataType = hipDataType;
inline constexpr DataType kF32 = HIP_R_32F;
inline constexpr DataType kBF16 = HIP_R_16BF;
// Element type of an fp8 operand; gfx942 uses the FNUZ variants, gfx950
// the OCP ones (the library rejects the other at heuristic time).
inline std::optional<DataType> Fp8Type(Elem e) {
  switch (e) {
    case Elem::kE4M3: return HIP_R_8F_E4M3;
    case Elem::kE5M2: return HIP_R_8F_E5M2;
    case Elem::kE4M3FNUZ: return HIP_R_8F_E4M3_FNUZ;
    case Elem::kE5M2FNUZ: return HIP_R_8F_E5M2_FNUZ;
    default: return std::nullopt;
  }
}
// hipBLASLt (gfx950) takes MX scales as plain row-major (rows, K/32).
inline constexpr bool kSwizzleMxScales = false;
// gfx950 MX kernels need K to be a multiple of 128.
inline constexpr int64_t kMxKMultiple = 128;
}  // namespace qlayers::gpu

// hipBLASLt has no counterpart of cuBLASLt's sm_90 row/block scale modes here.
#define QLAYERS_HAVE_LT_BLOCK_SCALING 0

#else  // CUDA

#include <cublasLt.h>
#include <cuda_runtime.h>

#define QL_LT(name) cublasLt##name
#define QL_LT_ENUM(name) CUBLASLT_##name
#define QL_BLAS(name) cublas##name
#define QL_BLAS_ENUM(name) CUBLAS_##name
#define QL_GPU(name) cuda##name

namespace qlayers::gpu {
inline constexpr const char* kPlatform = "CUDA";
inline constexpr const char* kLibrary = "cuBLASLt";
using DataType = cudaDataType_t;
inline constexpr DataType kF32 = CUDA_R_32F;
inline constexpr DataType kBF16 = CUDA_R_16BF;
// OCP fp8 only (sm_89 / sm_90 / sm_100); CUDA has no FNUZ types.
inline std::optional<DataType> Fp8Type(Elem e) {
  switch (e) {
    case Elem::kE4M3: return CUDA_R_8F_E4M3;
    case Elem::kE5M2: return CUDA_R_8F_E5M2;
    default: return std::nullopt;
  }
}
// cuBLASLt wants VEC32_UE8M0 scales in its tiled 128x4 layout (cuBLAS
// documentation, "1D Block Scaling Factors Layout").
inline constexpr bool kSwizzleMxScales = true;
inline constexpr int64_t kMxKMultiple = 32;
}  // namespace qlayers::gpu

// OUTER_VEC_32F, VEC128_32F and BLK128x128_32F (Hopper row-wise and
// DeepSeek-style block scaling) arrived in cuBLAS 12.9.
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120900
#define QLAYERS_HAVE_LT_BLOCK_SCALING 1
#else
#define QLAYERS_HAVE_LT_BLOCK_SCALING 0
#endif

#endif

namespace qlayers::gpu {
using Stream = QL_GPU(Stream_t);
using LtHandle = QL_LT(Handle_t);
using LtStatus = QL_BLAS(Status_t);
using LtMatmulDesc = QL_LT(MatmulDesc_t);
using LtLayout = QL_LT(MatrixLayout_t);
using LtPreference = QL_LT(MatmulPreference_t);
using LtHeuristic = QL_LT(MatmulHeuristicResult_t);
using LtOperation = QL_BLAS(Operation_t);
inline constexpr LtStatus kLtSuccess = QL_BLAS_ENUM(STATUS_SUCCESS);
}  // namespace qlayers::gpu

#endif  // QLAYERS_FFI_GPU_BLASLT_COMPAT_H_
