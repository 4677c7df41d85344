// CPU FFI handler of the grouped GEMM with SwiGLU (the expert FFN's first half):
//   turbo_moe_grouped_gemm_swiglu: h = lhs @ rhs[g(r)] (M, 2F) as turbo_moe_grouped_gemm computes it, and
//   act[r, j] = silu(h[r, j]) * h[r, F + j] (M, F), from h as stored (rounded to its dtype), in float32.
// Why one call returns both: the caller keeps h for its backward pass and feeds act to the next GEMM. Inside
// a layer scan XLA writes a custom call's result straight into the scan's stacked residuals only when that
// result has no other reader; with SwiGLU as a separate XLA fusion reading h it copied h instead (a copy
// of h per layer). Same contract as kernels/cuda/grouped_gemm_swiglu.cu.
#include <cmath>

#include "../contracts/grouped_gemm_swiglu.h"
#include "../contracts/registration.h"
#include "grouped_gemm.h"

namespace turbo_moe {
namespace {

ffi::Error GroupedGemmSwigluImpl(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                                 ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> h,
                                 ffi::Result<ffi::AnyBuffer> act,
                                 ffi::Result<ffi::AnyBuffer> /*workspace: the CUDA handler's, unused here*/,
                                 bool transpose_rhs, bool zero_tail) {
  auto dims = check_grouped_gemm_swiglu(lhs, rhs, group_sizes, *h, *act, transpose_rhs);
  if (!dims) return dims.error();
  const int64_t F = dims->F, batch = dims->gemm.batch, M = dims->gemm.M;
  const Dtype dt = dtype_of(h->element_type());
  std::vector<int64_t> totals;
  if (auto err = run_grouped_gemm(&pool, lhs, rhs, group_sizes, *h, transpose_rhs, zero_tail, &totals);
      err.failure())
    return err;

  const char* h_p = static_cast<const char*>(h->untyped_data());
  char* act_p = static_cast<char*>(act->untyped_data());
  const int64_t w = byte_width(dt);
  constexpr int64_t kRowsPerItem = 64;
  const int64_t items = (M + kRowsPerItem - 1) / kRowsPerItem;
  parallel_for(&pool, batch * items, [&](int64_t item) {  // act of the group rows, from h as stored
    const int64_t b = item / items, first = (item % items) * kRowsPerItem;
    std::vector<float> in(2 * F), out(F);
    for (int64_t r = b * M + first; r < b * M + std::min(totals[b], first + kRowsPerItem); ++r) {
      load_f32(dt, h_p + r * 2 * F * w, 2 * F, in.data());
      for (int64_t j = 0; j < F; ++j) {
        const float g = in[j];
        out[j] = g / (1.0f + std::exp(-g)) * in[F + j];
      }
      store_f32(dt, out.data(), F, act_p + r * F * w);
    }
  });
  // Rows past the groups: zeros (SwiGLU of h's zero rows), or NaN like h's when !zero_tail.
  for (int64_t b = 0; b < batch; ++b)
    std::memset(act_p + (b * M + totals[b]) * F * w, tail_fill(zero_tail), (M - totals[b]) * F * w);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CPU_HANDLER(turbo_moe_grouped_gemm_swiglu, turbo_moe::GroupedGemmSwigluImpl,
                      turbo_moe::grouped_gemm_swiglu_signature);
