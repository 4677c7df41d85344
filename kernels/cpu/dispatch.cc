// Picks the grouped GEMM compute variant once per process (gemm_kernels.h, isa.h): the best one this
// library was built with (TURBO_MOE_CPU_HAS_X86_64_V3 / _V4, set by CMakeLists.txt) that the CPU
// runs, as __builtin_cpu_supports tells (CPUID, and the OS's XSAVE state for AVX/AVX-512). Compiled
// for the baseline ISA. TURBO_MOE_CPU_ISA=base|x86-64-v3|x86-64-v4 caps the choice (tests, benchmarks);
// it never picks a variant the CPU lacks.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "gemm_kernels.h"

namespace turbo_moe {
namespace {

const GemmKernels* select_gemm_kernels() {
  int cap = 2;  // 0 base, 1 x86-64-v3, 2 x86-64-v4
  if (const char* want = std::getenv("TURBO_MOE_CPU_ISA"); want && *want) {
    if (!std::strcmp(want, "base")) cap = 0;
    else if (!std::strcmp(want, "x86-64-v3")) cap = 1;
    else if (!std::strcmp(want, "x86-64-v4")) cap = 2;
    else std::fprintf(stderr, "turbo_moe: ignoring TURBO_MOE_CPU_ISA=%s (base, x86-64-v3 or x86-64-v4)\n", want);
  }
#if defined(__x86_64__) && (defined(TURBO_MOE_CPU_HAS_X86_64_V3) || defined(TURBO_MOE_CPU_HAS_X86_64_V4))
  __builtin_cpu_init();
#if defined(TURBO_MOE_CPU_HAS_X86_64_V4)
  if (cap >= 2 && __builtin_cpu_supports("x86-64-v4")) return &gemm_kernels_x86_64_v4;
#endif
#if defined(TURBO_MOE_CPU_HAS_X86_64_V3)
  if (cap >= 1 && __builtin_cpu_supports("x86-64-v3")) return &gemm_kernels_x86_64_v3;
#endif
#endif
  (void)cap;
  return &gemm_kernels_base;
}

}  // namespace

const GemmKernels& gemm_kernels() {
  static const GemmKernels* const chosen = select_gemm_kernels();
  return *chosen;
}

}  // namespace turbo_moe

// Which variant the grouped GEMM uses in this process ("base", "x86-64-v3", "x86-64-v4"), for
// turbo_moe.ops (ctypes) and the tests. The baseline's flags: turbo_moe_cpu_base_arch().
extern "C" __attribute__((visibility("default"))) const char* turbo_moe_cpu_gemm_isa() {
  return turbo_moe::gemm_kernels().isa;
}
extern "C" __attribute__((visibility("default"))) const char* turbo_moe_cpu_base_arch() {
#ifdef TURBO_MOE_CPU_BASE_ARCH
  return TURBO_MOE_CPU_BASE_ARCH;
#else
  return "";
#endif
}
