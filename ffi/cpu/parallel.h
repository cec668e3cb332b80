// Threading, floating-point environment and ISA-dispatch helpers for the CPU
// kernels.
#ifndef QLAYERS_FFI_CPU_PARALLEL_H_
#define QLAYERS_FFI_CPU_PARALLEL_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

// The element loops of the quantize kernels vectorize with AVX2/AVX-512
// integer ops but not with baseline SSE2: build them per ISA and let the
// loader pick (GCC/Clang function multi-versioning). QLAYERS_TARGET_CLONES
// is set by CMake after a test compile.
#if defined(QLAYERS_TARGET_CLONES) && !defined(__SANITIZE_ADDRESS__)
#define QL_ISA_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define QL_ISA_CLONES
#endif

namespace qlayers::cpu {

inline int MaxThreads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

inline int ThreadId() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// Threads worth using for `work` multiply-adds (or element operations):
// small problems stay on the calling thread, where waking a team costs more
// than it saves.
inline int ThreadsFor(double work, double per_thread_min) {
  const int t = MaxThreads();
  if (work < per_thread_min) return 1;
  const double want = work / per_thread_min;
  return want < t ? static_cast<int>(want) : t;
}

// The kernels rely on IEEE subnormals (MX scales reach 2^-127, fp8
// subnormals times small scales are f32 subnormals). The host may have set
// flush-to-zero / denormals-are-zero on the calling thread; clear them for
// the duration of a kernel on every participating thread and restore after.
class ScopedIeeeSubnormals {
 public:
  ScopedIeeeSubnormals() {
#if defined(__x86_64__) || defined(_M_X64)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~(0x8000u | 0x0040u));  // FTZ (bit 15), DAZ (bit 6)
#endif
  }
  ~ScopedIeeeSubnormals() {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_setcsr(saved_);
#endif
  }
  ScopedIeeeSubnormals(const ScopedIeeeSubnormals&) = delete;
  ScopedIeeeSubnormals& operator=(const ScopedIeeeSubnormals&) = delete;

 private:
  unsigned saved_ = 0;
};

// Flush-to-zero and denormals-are-zero for the life of the object, on the
// calling thread (XLA:CPU's own floating-point mode).
class ScopedFlushSubnormals {
 public:
  ScopedFlushSubnormals() {
#if defined(__x86_64__) || defined(_M_X64)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | 0x8000u | 0x0040u);  // FTZ (bit 15), DAZ (bit 6)
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr | (1ull << 24)));  // FZ
#endif
  }
  ~ScopedFlushSubnormals() {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_setcsr(static_cast<unsigned>(saved_));
#elif defined(__aarch64__)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  ScopedFlushSubnormals(const ScopedFlushSubnormals&) = delete;
  ScopedFlushSubnormals& operator=(const ScopedFlushSubnormals&) = delete;

 private:
  uint64_t saved_ = 0;
};

// A 64-byte aligned float buffer kept per calling thread and grown on
// demand, so repeated calls do not pay for fresh pages.
class ScratchBuffer {
 public:
  ~ScratchBuffer() { std::free(ptr_); }
  float* Get(size_t n) {
    if (n <= cap_) return ptr_;
    std::free(ptr_);
    const size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
    ptr_ = static_cast<float*>(std::aligned_alloc(64, bytes));
    cap_ = ptr_ ? n : 0;
    return ptr_;
  }

 private:
  float* ptr_ = nullptr;
  size_t cap_ = 0;
};

inline float* ThreadScratch(size_t n) {
  thread_local ScratchBuffer buf;
  return buf.Get(n);
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

// Splits [0, n) into one range per thread and runs fn(begin, end, thread).
template <typename Fn>
void ForRanges(int64_t n, int threads, Fn fn) {
  if (threads <= 1) {
    fn(int64_t{0}, n, 0);
    return;
  }
  const int64_t step = CeilDiv(n, threads);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
  for (int t = 0; t < threads; ++t) {
    const int64_t begin = std::min(n, t * step);
    fn(begin, std::min(n, begin + step), t);
  }
}

}  // namespace qlayers::cpu

#endif  // QLAYERS_FFI_CPU_PARALLEL_H_
