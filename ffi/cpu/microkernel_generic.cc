// Portable micro-kernel: 4 x 8 tile of 128-bit vectors (SSE2 / NEON).
#define QL_NS generic
#define QL_GETTER MicroKernelGeneric
#define QL_ISA "generic"
#define QL_VEC_BYTES 16
#define QL_MR 4
#define QL_NV 2
#define QL_MC 96
#define QL_KC 256
#define QL_NC 1024
#if defined(__SSE__)
#include <xmmintrin.h>
#define QL_SPLAT _mm_set1_ps
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#define QL_SPLAT vdupq_n_f32
#endif
#include "microkernel_impl.inc"
