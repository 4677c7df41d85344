// Launchers of the grouped GEMM kernels used by the FFI handlers in grouped_gemm.cu.
//   forward:     out[r, :] = lhs[r, :] @ rhs[g(r)]        lhs (M, K), rhs (G, K, N) | (G, N, K)
//   weight grad: dw[g] = lhs[rows_g, :]^T @ d_out[rows_g, :]   -> (G, K, N)
// offsets / tile_prefix (device memory, batch * (G + 1) each): the portable kernels read them from
// launch_group_offsets; the Hopper launchers write offsets themselves from `sizes` (one prologue kernel).
#pragma once

#include "common.cuh"

namespace turbo_moe {

// Row tile of the portable (SIMT) forward kernel: tile_prefix must be built with this.
constexpr int kSimtTileRows = 64;

struct GroupedGemmArgs {
  const void* lhs;
  const void* rhs;       // forward: weights; weight grad: d_out
  void* out;
  const int32_t* sizes;        // [batch, G] group sizes (the Hopper launchers' input)
  int32_t* offsets;            // [batch, G + 1] clamped group offsets
  const int32_t* tile_prefix;  // [batch, G + 1], forward SIMT kernel only
  int64_t batch, M, K, N, G;
  bool transpose_rhs;
  bool zero_tail = true;  // false: rows past the groups may stay unwritten (the caller reads only group rows)
  ffi::DataType in_type, out_type;
};

// Portable kernels (sm_80+, any float dtype, any shape): float32 FMA, float32 accumulation.
ffi::Error launch_grouped_gemm_simt(const GroupedGemmArgs& a, cudaStream_t stream);
ffi::Error launch_weight_grad_simt(const GroupedGemmArgs& a, cudaStream_t stream);

// Hopper kernels (CUTLASS 3 ptr-array grouped GEMM, wgmma + TMA). Only for bf16/f16 in and out,
// K and N multiples of 8. Return false when this build or this case has no sm90 kernel. Each call is two
// launches: a prologue (offsets from sizes, the GEMM's arguments, zeros for the rows / weight gradients
// no group covers) and the GEMM.
bool sm90_available();
size_t sm90_scratch_bytes(const GroupedGemmArgs& a, bool weight_grad, int device);
ffi::Error launch_grouped_gemm_sm90(const GroupedGemmArgs& a, void* scratch, size_t scratch_bytes,
                                    int device, cudaStream_t stream);
ffi::Error launch_weight_grad_sm90(const GroupedGemmArgs& a, void* scratch, size_t scratch_bytes,
                                   int device, cudaStream_t stream);

// The forward handler's whole call (grouped_gemm.cu): checks, group offsets into `workspace`, the GEMM, zero
// tail rows (unless !zero_tail: then rows past the groups are left as they were). `offsets` (may be null) gets the device offsets table [batch, G + 1] inside the workspace, or
// null when there was nothing to compute.
ffi::Error run_grouped_gemm(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                            ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer out, ffi::AnyBuffer workspace,
                            bool transpose_rhs, bool zero_tail, const int32_t** offsets);

}  // namespace turbo_moe
