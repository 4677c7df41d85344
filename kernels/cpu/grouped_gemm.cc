// CPU FFI handlers of the grouped GEMM (the semantics of jax.lax.ragged_dot):
//   turbo_moe_grouped_gemm:             out[r] = lhs[r] @ rhs[g(r)]         (M,K) x (G,K,N)|(G,N,K) -> (M,N)
//   turbo_moe_grouped_gemm_weight_grad: dw[g]  = lhs[rows_g]^T @ d_out[rows_g]  (M,K),(M,N) -> (G,K,N)
// Optional leading batch dims (vmap) are shared by all operands. Accumulation is float32; the
// work is split into (group, row block, column block) tiles run on XLA's intra-op thread pool; the
// compute of one tile is in gemm_kernels.cc, compiled per ISA and picked at run time (dispatch.cc).
// Each output element is produced by one tile with a fixed summation order: deterministic.
#include "grouped_gemm.h"

#include "../contracts/registration.h"
#include "gemm_kernels.h"

namespace turbo_moe {
namespace {

// One float32 scratch per worker thread, sized for the variant in use (fixed for the process).
const GemmScratch& thread_scratch(const GemmKernels& k) {
  thread_local std::vector<float> a_pack(k.a_pack_floats), b_pack(k.b_pack_floats),
      c_block(k.c_block_floats);
  thread_local GemmScratch s{a_pack.data(), b_pack.data(), c_block.data()};
  return s;
}

}  // namespace

ffi::Error run_grouped_gemm(ffi::ThreadPool* pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                            ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer out, bool transpose_rhs, bool zero_tail,
                            std::vector<int64_t>* totals_out) {
  auto dims = check_grouped_gemm(lhs, rhs, group_sizes, out, transpose_rhs);
  if (!dims) return dims.error();
  const int64_t batch = dims->batch, M = dims->M, K = dims->K, N = dims->N, G = dims->G;
  const Dtype in_dt = dtype_of(lhs.element_type()), out_dt = dtype_of(out.element_type());

  const char* lhs_p = static_cast<const char*>(lhs.untyped_data());
  const char* rhs_p = static_cast<const char*>(rhs.untyped_data());
  char* out_p = static_cast<char*>(out.untyped_data());
  const int32_t* gs_p = group_sizes.typed_data();
  const int64_t out_w = byte_width(out_dt);

  const GemmKernels& kern = gemm_kernels();
  std::vector<GemmTile> tiles;
  std::vector<int64_t> totals(batch);
  for (int64_t b = 0; b < batch; ++b) {
    auto starts = group_starts(gs_p + b * G, G, M);
    totals[b] = starts[G];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = starts[g]; r < starts[g + 1]; r += kern.mc)
        tiles.push_back({b, g, r, std::min(kern.mc, starts[g + 1] - r)});
  }
  const int64_t n_blocks = (N + kern.nc - 1) / kern.nc;
  const GemmFwdArgs args{in_dt, out_dt, lhs_p, rhs_p, out_p, M, K, N, G, transpose_rhs, tiles.data(), n_blocks};
  parallel_for(pool, static_cast<int64_t>(tiles.size()) * n_blocks, [&](int64_t item) {
    kern.fwd_item(args, item, thread_scratch(kern));
  });
  // Rows that belong to no group: zero, or NaN where the caller promised not to read them.
  for (int64_t b = 0; b < batch; ++b)
    std::memset(out_p + (b * M + totals[b]) * N * out_w, tail_fill(zero_tail), (M - totals[b]) * N * out_w);
  if (totals_out) *totals_out = totals;
  return ffi::Error::Success();
}

namespace {

ffi::Error GroupedGemmImpl(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> /*workspace: the CUDA handler's, unused here*/,
                           bool transpose_rhs, bool zero_tail) {
  return run_grouped_gemm(&pool, lhs, rhs, group_sizes, *out, transpose_rhs, zero_tail);
}

ffi::Error GroupedGemmWeightGradImpl(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer d_out,
                                     ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> d_rhs,
                                     ffi::Result<ffi::AnyBuffer> /*workspace: the CUDA handler's, unused here*/) {
  auto dims = check_grouped_gemm_weight_grad(lhs, d_out, group_sizes, *d_rhs);
  if (!dims) return dims.error();
  const int64_t batch = dims->batch, M = dims->M, K = dims->K, N = dims->N, G = dims->G;
  const Dtype in_dt = dtype_of(lhs.element_type()), out_dt = dtype_of(d_rhs->element_type());

  const char* lhs_p = static_cast<const char*>(lhs.untyped_data());
  const char* dout_p = static_cast<const char*>(d_out.untyped_data());
  char* out_p = static_cast<char*>(d_rhs->untyped_data());
  const int32_t* gs_p = group_sizes.typed_data();

  const GemmKernels& kern = gemm_kernels();
  std::vector<int64_t> starts;
  starts.reserve(batch * (G + 1));
  for (int64_t b = 0; b < batch; ++b) {
    auto s = group_starts(gs_p + b * G, G, M);
    starts.insert(starts.end(), s.begin(), s.end());
  }
  const int64_t k_blocks = (K + kern.mc - 1) / kern.mc, n_blocks = (N + kern.nc - 1) / kern.nc;
  const GemmWgradArgs args{in_dt, out_dt, lhs_p, dout_p, out_p, M, K, N, G, starts.data(), k_blocks, n_blocks};
  parallel_for(&pool, batch * G * k_blocks * n_blocks, [&](int64_t item) {
    kern.wgrad_item(args, item, thread_scratch(kern));
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CPU_HANDLER(turbo_moe_grouped_gemm, turbo_moe::GroupedGemmImpl, turbo_moe::grouped_gemm_signature);

TURBO_MOE_CPU_HANDLER(turbo_moe_grouped_gemm_weight_grad, turbo_moe::GroupedGemmWeightGradImpl,
                      turbo_moe::grouped_gemm_weight_grad_signature);
