// AVX-512F micro-kernel: 12 x 32 register tile (24 zmm accumulators).
// Compiled with -mavx512f -mfma; only called after a CPUID check.
#define QL_NS avx512
#define QL_GETTER MicroKernelAvx512
#define QL_ISA "avx512"
#define QL_VEC_BYTES 64
#define QL_MR 12
#define QL_NV 2
#define QL_MC 144
#define QL_KC 256
#define QL_NC 2048
#define QL_SPLAT _mm512_set1_ps
#include <immintrin.h>
#include "microkernel_impl.inc"
