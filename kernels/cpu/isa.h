// The instruction-set variant a translation unit of the CPU library is compiled for.
//
// gemm_kernels.cc is compiled once with the library's baseline flags (TURBO_MOE_ISA=base) and, on
// x86-64, once more per dispatch variant with -march=x86-64-v3 / -march=x86-64-v4 and
// TURBO_MOE_ISA=x86_64_v3 / x86_64_v4 (CMakeLists.txt); dispatch.cc picks one at run time. Every
// function such a translation unit defines, inline ones from headers included, must carry a name
// of its own variant (the inline namespace TURBO_MOE_ISA, or internal linkage): the linker keeps
// one copy of an inline function with external linkage, and an AVX-512 copy of a helper shared with
// the baseline would then run on a CPU without AVX-512 (SIGILL). Hence the variant TUs include
// only <cstdint>, <cstring> and headers that wrap their code in TURBO_MOE_ISA (no STL containers,
// no XLA FFI headers).
#pragma once

#ifndef TURBO_MOE_ISA
#define TURBO_MOE_ISA base
#endif

#define TURBO_MOE_CAT_(a, b) a##b
#define TURBO_MOE_CAT(a, b) TURBO_MOE_CAT_(a, b)
#define TURBO_MOE_STR_(a) #a
#define TURBO_MOE_STR(a) TURBO_MOE_STR_(a)
