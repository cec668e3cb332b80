// Register-blocked f32 GEMM micro-kernels (one per ISA, chosen at run time).
//
// The structure is the classic Goto/BLIS one (K. Goto and R. van de Geijn,
// "Anatomy of High-Performance Matrix Multiplication", ACM TOMS 34(3), 2008;
// F. Van Zee and R. van de Geijn, "BLIS", ACM TOMS 41(3), 2015): operands
// are decoded into packed panels, A as MR-row micro-panels (a[k*MR + i]) and
// B as NR-column micro-panels (b[k*NR + j]), and the micro-kernel keeps an
// MR x NR tile of FP32 accumulators in registers over `kc` rank-1 updates.
#ifndef QLAYERS_FFI_CPU_MICROKERNEL_H_
#define QLAYERS_FFI_CPU_MICROKERNEL_H_

#include <cstdint>

namespace qlayers::cpu {

// What the micro-kernel does with its MR x NR tile `acc` after the K loop:
//   if (rs)          acc[i][j] *= rs[i] * cs[j]   (per-chunk scale product)
//   if (accumulate)  acc += ws tile
//   if (!last)       ws tile = acc
//   else             out tile = convert(alpha * acc)   (f32 or bf16)
// Only the top-left m_valid x n_valid part of the tiles is read or written.
struct Epilogue {
  float* ws;            // f32 accumulator (may alias `out` for f32 output)
  int64_t ld_ws;
  void* out;
  int64_t ld_out;
  const float* rs;      // MR row scales or nullptr
  const float* cs;      // NR column scales (with rs)
  float alpha;
  int m_valid;
  int n_valid;
  bool accumulate;
  bool last;
  bool out_bf16;
};

using MicroKernelFn = void (*)(int64_t kc, const float* a, const float* b,
                               const Epilogue& ep);

struct MicroKernel {
  const char* isa;
  int mr, nr;        // register tile
  int64_t mc, kc, nc;  // cache blocking (mc % mr == 0, nc % nr == 0, kc % 128 == 0)
  MicroKernelFn fn;
};

// The best kernel this CPU supports (AVX-512, AVX2+FMA, or portable).
const MicroKernel& SelectMicroKernel();

// Declared per ISA in microkernel_*.cc.
const MicroKernel& MicroKernelGeneric();
#if defined(__x86_64__) || defined(_M_X64)
const MicroKernel& MicroKernelAvx2();
const MicroKernel& MicroKernelAvx512();
#endif

}  // namespace qlayers::cpu

#endif  // QLAYERS_FFI_CPU_MICROKERNEL_H_
