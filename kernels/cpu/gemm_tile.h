// A cache-blocked float32 GEMM tile for the CPU handlers: C[m, n] = sum_k A(i, k) * B(k, j).
// Operands are packed (converted to float32) into panels by caller-supplied packers, then a
// register-blocked micro-kernel written with GCC vector extensions does the FMAs; it compiles to
// AVX-512 or AVX2 depending on the -march of the including translation unit. Included only by
// gemm_kernels.cc, once per ISA variant: everything here is in the inline namespace TURBO_MOE_ISA
// (isa.h), and the blocking constants differ per variant (gemm_kernels.h exports them).
#pragma once

#include <cstdint>
#include <cstring>

#include "isa.h"

namespace turbo_moe {
inline namespace TURBO_MOE_ISA {

#if defined(__AVX512F__)
constexpr int kVecWidth = 16;
constexpr int kMR = 8;   // rows per micro-tile
constexpr int kNV = 2;   // vectors per micro-tile row: NR = 32
#elif defined(__AVX__) || !(defined(__x86_64__) || defined(__i386__))
constexpr int kVecWidth = 8;
constexpr int kMR = 6;
constexpr int kNV = 2;   // NR = 16
#else
// x86 without AVX: 16-byte registers. 32-byte vector types would be split by GCC through the stack
// (far slower: docs/performance.md, "CPU kernels"), so the tile uses SSE-sized vectors.
// 6 x 2 accumulators + 2 loads fit the 16 xmm registers. Each output element still sums over k in
// the same order (blocks of kKC), whatever the tile shape.
constexpr int kVecWidth = 4;
constexpr int kMR = 6;
constexpr int kNV = 2;   // NR = 8
#endif
constexpr int kNR = kVecWidth * kNV;
constexpr int64_t kMC = kMR * 16;  // rows of A per cache block
constexpr int64_t kNC = kNR * 8;   // columns of B per cache block
constexpr int64_t kKC = 256;       // depth per cache block

typedef float VecF __attribute__((vector_size(kVecWidth * sizeof(float))));

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

inline VecF load_vec(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// c[kMR x kNR] (+)= a_panel[kc x kMR] * b_panel[kc x kNR]; c has leading dimension ldc.
inline void micro_kernel(int64_t kc, const float* __restrict a, const float* __restrict b,
                         float* __restrict c, int64_t ldc, bool accumulate) {
  VecF acc[kMR][kNV];
  for (int i = 0; i < kMR; ++i)
    for (int v = 0; v < kNV; ++v) acc[i][v] = VecF{} ;
  for (int64_t k = 0; k < kc; ++k) {
    VecF bv[kNV];
    for (int v = 0; v < kNV; ++v) bv[v] = load_vec(b + k * kNR + v * kVecWidth);
    const float* ak = a + k * kMR;
    for (int i = 0; i < kMR; ++i) {
      float av = ak[i];
      for (int v = 0; v < kNV; ++v) acc[i][v] += av * bv[v];
    }
  }
  for (int i = 0; i < kMR; ++i) {
    for (int v = 0; v < kNV; ++v) {
      float* dst = c + i * ldc + v * kVecWidth;
      VecF out = acc[i][v];
      if (accumulate) out += load_vec(dst);
      std::memcpy(dst, &out, sizeof(out));
    }
  }
}

// Per-worker scratch (allocated by the caller, sizes from gemm_kernels.h): packed panels of
// kMC x kKC and kKC x kNC floats and the float32 output block of kMC x kNC.
struct TilePanels {
  float* a_pack;
  float* b_pack;
  float* c_block;
};

// Computes one (mc x nc) output block, mc <= kMC, nc <= kNC, over depth `depth`, into
// s.c_block (leading dimension kNC). Packers fill zero-padded panels:
//   pack_a(k0, kc, dst): for each panel p of kMR rows, dst[p*kc*kMR + k*kMR + i] = A(p*kMR+i, k0+k)
//   pack_b(k0, kc, dst): for each panel q of kNR cols, dst[q*kc*kNR + k*kNR + j] = B(k0+k, q*kNR+j)
template <class PackA, class PackB>
void gemm_block(int64_t mc, int64_t nc, int64_t depth, PackA&& pack_a, PackB&& pack_b,
                const TilePanels& s) {
  const int64_t m_panels = (mc + kMR - 1) / kMR;
  const int64_t n_panels = (nc + kNR - 1) / kNR;
  if (depth <= 0) {
    std::memset(s.c_block, 0, sizeof(float) * kMC * kNC);
    return;
  }
  for (int64_t k0 = 0; k0 < depth; k0 += kKC) {
    const int64_t kc = imin(kKC, depth - k0);
    pack_a(k0, kc, s.a_pack);
    pack_b(k0, kc, s.b_pack);
    for (int64_t q = 0; q < n_panels; ++q) {
      for (int64_t p = 0; p < m_panels; ++p) {
        micro_kernel(kc, s.a_pack + p * kc * kMR, s.b_pack + q * kc * kNR,
                     s.c_block + p * kMR * kNC + q * kNR, kNC, k0 > 0);
      }
    }
  }
}

}  // namespace TURBO_MOE_ISA
}  // namespace turbo_moe
