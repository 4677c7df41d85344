// The interface between the grouped GEMM handlers (grouped_gemm.cc, baseline ISA) and the per-ISA
// compute variants (gemm_kernels.cc compiled once per variant: isa.h). Plain data only: no code here
// is compiled into more than one variant. dispatch.cc picks one table at first use.
#pragma once

#include <cstdint>

#include "convert.h"

namespace turbo_moe {

struct GemmTile {  // rows [row0, row0 + rows) of one group of one batch element
  int64_t batch, group, row0, rows;
};

struct GemmScratch {  // per-worker buffers of a_pack_floats, b_pack_floats, c_block_floats
  float* a_pack;
  float* b_pack;
  float* c_block;
};

// out[r] = lhs[r] @ rhs[g(r)]; work item i = (tiles[i / n_blocks], column block i % n_blocks).
struct GemmFwdArgs {
  Dtype in_dt, out_dt;
  const char* lhs;  // [batch, M, K]
  const char* rhs;  // [batch, G, K, N], or [batch, G, N, K] when transpose_rhs
  char* out;        // [batch, M, N]
  int64_t M, K, N, G;
  bool transpose_rhs;
  const GemmTile* tiles;  // row blocks of at most `mc` rows, none crossing a group boundary
  int64_t n_blocks;       // ceil(N / nc)
};

// dw[g] = lhs[rows_g]^T @ d_out[rows_g]; item i = (batch * G + g, K block, N block), row-major.
struct GemmWgradArgs {
  Dtype in_dt, out_dt;
  const char* lhs;    // [batch, M, K]
  const char* d_out;  // [batch, M, N]
  char* out;          // [batch, G, K, N]
  int64_t M, K, N, G;
  const int64_t* starts;       // [batch, G + 1]: group_starts() per batch element
  int64_t k_blocks, n_blocks;  // ceil(K / mc), ceil(N / nc)
};

struct GemmKernels {
  const char* isa;  // "base", "x86-64-v3", "x86-64-v4"
  int64_t mc, nc;   // output block: rows, columns
  int64_t a_pack_floats, b_pack_floats, c_block_floats;
  void (*fwd_item)(const GemmFwdArgs& args, int64_t item, const GemmScratch& scratch);
  void (*wgrad_item)(const GemmWgradArgs& args, int64_t item, const GemmScratch& scratch);
};

// One table per compiled variant (defined by gemm_kernels.cc; the x86 ones exist only when
// CMakeLists.txt built them: TURBO_MOE_CPU_HAS_X86_64_V3 / _V4).
extern const GemmKernels gemm_kernels_base;
extern const GemmKernels gemm_kernels_x86_64_v3;
extern const GemmKernels gemm_kernels_x86_64_v4;

// The variant this process uses (dispatch.cc): the best one that was built and that the CPU runs,
// capped by the environment variable TURBO_MOE_CPU_ISA (base, x86-64-v3, x86-64-v4) when set.
const GemmKernels& gemm_kernels();

}  // namespace turbo_moe
