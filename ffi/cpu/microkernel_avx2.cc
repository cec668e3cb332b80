// AVX2+FMA micro-kernel: 6 x 16 register tile (12 ymm accumulators).
// Compiled with -mavx2 -mfma; only called after a CPUID check.
#define QL_NS avx2
#define QL_GETTER MicroKernelAvx2
#define QL_ISA "avx2"
#define QL_VEC_BYTES 32
#define QL_MR 6
#define QL_NV 2
#define QL_MC 96
#define QL_KC 256
#define QL_NC 2048
#define QL_SPLAT _mm256_set1_ps
#include <immintrin.h>
#include "microkernel_impl.inc"
