// Run-time choice of the micro-kernel from CPUID.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "microkernel.h"

namespace qlayers::cpu {

namespace {

bool Supported(const char* isa) {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (std::strcmp(isa, "avx512") == 0) return __builtin_cpu_supports("avx512f");
  if (std::strcmp(isa, "avx2") == 0) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
#endif
  return std::strcmp(isa, "generic") == 0;
}

const MicroKernel* ByName(const char* isa) {
  if (isa == nullptr || !Supported(isa)) return nullptr;
#if defined(__x86_64__) || defined(_M_X64)
  if (std::strcmp(isa, "avx512") == 0) return &MicroKernelAvx512();
  if (std::strcmp(isa, "avx2") == 0) return &MicroKernelAvx2();
#endif
  return &MicroKernelGeneric();
}

const MicroKernel& Detect() {
  // QLAYERS_CPU_ISA=generic|avx2|avx512 picks a kernel the CPU supports.
  if (const MicroKernel* k = ByName(std::getenv("QLAYERS_CPU_ISA"))) return *k;
  for (const char* isa : {"avx512", "avx2"}) {
    if (const MicroKernel* k = ByName(isa)) return *k;
  }
  return MicroKernelGeneric();
}

std::atomic<const MicroKernel*> g_forced{nullptr};

}  // namespace

const MicroKernel& SelectMicroKernel() {
  if (const MicroKernel* k = g_forced.load(std::memory_order_acquire)) return *k;
  static const MicroKernel& detected = Detect();
  return detected;
}

}  // namespace qlayers::cpu

// Test hook: use the kernel for `isa` ("avx512", "avx2", "generic") from now
// on; nullptr or "" returns to the detected one. Returns 0 if the CPU lacks
// that ISA (nothing changes), 1 otherwise.
extern "C" int QlayersCpuForceIsa(const char* isa) {
  using qlayers::cpu::g_forced;
  if (isa == nullptr || *isa == '\0') {
    g_forced.store(nullptr, std::memory_order_release);
    return 1;
  }
  const qlayers::cpu::MicroKernel* k = qlayers::cpu::ByName(isa);
  if (k == nullptr) return 0;
  g_forced.store(k, std::memory_order_release);
  return 1;
}
