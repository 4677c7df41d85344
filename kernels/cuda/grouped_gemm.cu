// CUDA FFI handlers of the grouped GEMM (the semantics of jax.lax.ragged_dot):
//   turbo_moe_grouped_gemm:             out[r] = lhs[r] @ rhs[g(r)]            (M,K) x (G,K,N)|(G,N,K) -> (M,N)
//   turbo_moe_grouped_gemm_weight_grad: dw[g]  = lhs[rows_g]^T @ d_out[rows_g]  (M,K),(M,N) -> (G,K,N)
// Same contract as kernels/cpu/grouped_gemm.cc. Group sizes stay on the device: a small kernel
// turns them into clamped offsets in the call's workspace (on Hopper, with the GEMM's arguments and the
// zeros below), the GEMM reads those, and rows past sum(group_sizes) are zeroed on the device. The workspace is an extra result that Python sizes with
// turbo_moe_grouped_gemm_workspace_bytes (below), not XLA scratch: scratch is per call, and a handler
// that takes it cannot be recorded into XLA's command buffers (CUDA graphs). Hopper + bf16/f16 runs the CUTLASS wgmma kernels;
// everything else (fp32, other GPUs, K or N not a multiple of 8) the portable kernels.
#include "grouped_gemm.h"

#include "../contracts/grouped_gemm.h"
#include "../contracts/registration.h"

namespace turbo_moe {
namespace {

bool use_sm90(const GroupedGemmArgs& a, int device) {
  const bool half_type = a.in_type == ffi::DataType::BF16 || a.in_type == ffi::DataType::F16;
  return sm90_available() && compute_capability_major(device) == 9 && half_type &&
         a.out_type == a.in_type && a.K > 0 && a.K % 8 == 0 && a.N % 8 == 0 &&
         a.M < (int64_t{1} << 31) && a.K < (int64_t{1} << 31) && a.N < (int64_t{1} << 31) &&
         a.batch * a.G < (int64_t{1} << 31);
}

// The workspace: offsets and tile prefix (batch x (G+1) int32 each), then the sm90 arrays.
struct CallWorkspace {
  int32_t* offsets = nullptr;
  int32_t* tile_prefix = nullptr;
  void* sm90 = nullptr;
  size_t sm90_bytes = 0;
};

size_t table_bytes(int64_t batch, int64_t groups) {
  const size_t table = static_cast<size_t>(batch * (groups + 1)) * sizeof(int32_t);
  return (table + 255) & ~size_t(255);
}

// The offset tables, then the sm90 arrays (`sm90_bytes`), + 256 for aligning the base.
size_t workspace_bytes(int64_t batch, int64_t groups, size_t sm90_bytes) {
  return 2 * table_bytes(batch, groups) + sm90_bytes + 256;
}

ffi::Error carve_workspace(ffi::AnyBuffer workspace,
                           const GroupedGemmArgs& a, bool fast, bool weight_grad, int device, const char* what,
                           CallWorkspace* w) {
  const size_t sm90_bytes = fast ? sm90_scratch_bytes(a, weight_grad, device) : 0;
  const size_t need = workspace_bytes(a.batch, a.G, sm90_bytes);
  if (workspace.size_bytes() < need)
    return invalid(std::string(what) + ": workspace of " + std::to_string(workspace.size_bytes()) +
                   " bytes, this call needs " + std::to_string(need) +
                   " (turbo_moe/ops/grouped_gemm.py sizes it with turbo_moe_grouped_gemm_workspace_bytes)");
  // 256-byte alignment for the TMA descriptors and 16-byte vectors in the sm90 arrays.
  const uintptr_t raw = reinterpret_cast<uintptr_t>(workspace.untyped_data());
  char* base = reinterpret_cast<char*>((raw + 255) & ~uintptr_t(255));
  const size_t table = table_bytes(a.batch, a.G);
  w->offsets = reinterpret_cast<int32_t*>(base);
  w->tile_prefix = reinterpret_cast<int32_t*>(base + table);
  w->sm90 = base + 2 * table;
  w->sm90_bytes = sm90_bytes;
  return ffi::Error::Success();
}

}  // namespace

ffi::Error run_grouped_gemm(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                            ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer out, ffi::AnyBuffer workspace,
                            bool transpose_rhs, bool zero_tail, const int32_t** offsets) {
  if (offsets) *offsets = nullptr;
  auto dims = check_grouped_gemm(lhs, rhs, group_sizes, out, transpose_rhs);
  if (!dims) return dims.error();
  GroupedGemmArgs a;
  a.batch = dims->batch;
  a.M = dims->M;
  a.K = dims->K;
  a.N = dims->N;
  a.G = dims->G;
  a.lhs = lhs.untyped_data();
  a.rhs = rhs.untyped_data();
  a.out = out.untyped_data();
  a.transpose_rhs = transpose_rhs;
  a.zero_tail = zero_tail;
  a.in_type = lhs.element_type();
  a.out_type = out.element_type();
  if (a.batch == 0 || a.M == 0 || a.N == 0) return ffi::Error::Success();

  int device = 0;
  cudaGetDevice(&device);
  const bool fast = use_sm90(a, device);
  CallWorkspace s;
  if (auto err = carve_workspace(workspace, a, fast, false, device, "grouped_gemm", &s); err.failure()) return err;
  if (offsets) *offsets = s.offsets;
  a.sizes = group_sizes.typed_data();
  a.offsets = s.offsets;
  a.tile_prefix = s.tile_prefix;
  // Rows that belong to no group are zero (the sm90 prologue zeroes them) unless the caller lets them stay
  // unwritten: a worst-case EP buffer is mostly tail (P * T * k rows, ~T * k real), and its zeros cost more
  // than the GEMM at EP=4 (docs/notes/step-time.md).
  if (fast) return launch_grouped_gemm_sm90(a, s.sm90, s.sm90_bytes, device, stream);
  launch_group_offsets(a.sizes, a.batch, a.G, a.M, s.offsets, s.tile_prefix, kSimtTileRows, stream);
  if (ffi::Error err = launch_grouped_gemm_simt(a, stream); err.failure()) return err;
  if (a.zero_tail)
    launch_zero_tail_rows(a.out, a.batch, a.M, a.N * byte_width(a.out_type), s.offsets + a.G, a.G + 1, stream);
  return last_cuda_error("grouped_gemm");
}

namespace {

ffi::Error GroupedGemmImpl(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> workspace, bool transpose_rhs, bool zero_tail) {
  return run_grouped_gemm(stream, lhs, rhs, group_sizes, *out, *workspace, transpose_rhs, zero_tail, nullptr);
}

ffi::Error GroupedGemmWeightGradImpl(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer d_out,
                                     ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> d_rhs,
                                     ffi::Result<ffi::AnyBuffer> workspace) {
  auto dims = check_grouped_gemm_weight_grad(lhs, d_out, group_sizes, *d_rhs);
  if (!dims) return dims.error();
  GroupedGemmArgs a;
  a.batch = dims->batch;
  a.M = dims->M;
  a.K = dims->K;
  a.N = dims->N;
  a.G = dims->G;
  a.lhs = lhs.untyped_data();
  a.rhs = d_out.untyped_data();
  a.out = d_rhs->untyped_data();
  a.transpose_rhs = false;
  a.in_type = lhs.element_type();
  a.out_type = d_rhs->element_type();
  if (a.batch == 0 || a.G == 0 || a.K == 0 || a.N == 0) return ffi::Error::Success();

  int device = 0;
  cudaGetDevice(&device);
  const bool fast = use_sm90(a, device);
  CallWorkspace s;
  if (auto err = carve_workspace(*workspace, a, fast, true, device, "grouped_gemm_weight_grad", &s); err.failure())
    return err;
  a.sizes = group_sizes.typed_data();
  a.offsets = s.offsets;
  a.tile_prefix = s.tile_prefix;
  if (fast) return launch_weight_grad_sm90(a, s.sm90, s.sm90_bytes, device, stream);  // its prologue: the offsets
  launch_group_offsets(a.sizes, a.batch, a.G, a.M, s.offsets, nullptr, kSimtTileRows, stream);
  if (ffi::Error err = launch_weight_grad_simt(a, stream); err.failure()) return err;
  return last_cuda_error("grouped_gemm_weight_grad");
}

}  // namespace
}  // namespace turbo_moe

// No scratch, no host synchronisation, every launch on `stream`: command-buffer compatible.
TURBO_MOE_CUDA_HANDLER(turbo_moe_grouped_gemm, turbo_moe::GroupedGemmImpl, turbo_moe::grouped_gemm_signature);

TURBO_MOE_CUDA_HANDLER(turbo_moe_grouped_gemm_weight_grad, turbo_moe::GroupedGemmWeightGradImpl,
                       turbo_moe::grouped_gemm_weight_grad_signature);

// Workspace bytes one call takes for `batch` leading problems of `groups` groups (dtype: 0 bf16, 1 f16,
// 2 f32), on the current device: what turbo_moe/ops/grouped_gemm.py gives each call.
extern "C" int64_t turbo_moe_grouped_gemm_workspace_bytes(int64_t batch, int64_t groups, int dtype,
                                                          int weight_grad) {
  using namespace turbo_moe;
  int device = 0;
  cudaGetDevice(&device);
  GroupedGemmArgs a{};
  a.batch = batch;
  a.G = groups;
  a.in_type = a.out_type = dtype == 0 ? ffi::DataType::BF16 : dtype == 1 ? ffi::DataType::F16 : ffi::DataType::F32;
  const bool fast = dtype != 2 && sm90_available() && compute_capability_major(device) == 9;
  return static_cast<int64_t>(workspace_bytes(batch, groups, fast ? sm90_scratch_bytes(a, weight_grad != 0, device) : 0));
}
