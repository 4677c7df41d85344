// CUDA FFI handler of the grouped GEMM with SwiGLU (the expert FFN's first half):
//   turbo_moe_grouped_gemm_swiglu: h = lhs @ rhs[g(r)] (M, 2F) as turbo_moe_grouped_gemm computes it, and
//   act[r, j] = silu(h[r, j]) * h[r, F + j] (M, F), from h as stored (rounded to its dtype), in float32.
// Why one call returns both: the caller keeps h for its backward pass and feeds act to the next GEMM. Inside
// a layer scan XLA writes a custom call's result straight into the scan's stacked residuals only when that
// result has no other reader; with SwiGLU as a separate XLA fusion reading h it copied h instead (a copy
// of h per layer). Same contract as kernels/cpu/grouped_gemm_swiglu.cc;
// the workspace is the grouped GEMM's (turbo_moe_grouped_gemm_workspace_bytes).
#include "grouped_gemm.h"

#include "../contracts/grouped_gemm_swiglu.h"
#include "../contracts/registration.h"

namespace turbo_moe {
namespace {

// Grid-stride over batch b's (M, F / V) vectors of act: rows in a group get silu(gate) * up, rows past the
// groups (offsets[b * stride + G] on) get zeros, like h's, or nothing when !zero_tail.
template <typename T, int V>
__global__ void swiglu_rows_kernel(const T* __restrict__ h, T* __restrict__ act, int64_t M, int64_t F,
                                   const int32_t* __restrict__ row_end_table, int64_t table_stride, bool zero_tail) {
  const int64_t b = blockIdx.y;
  const int64_t rows = min64(static_cast<int64_t>(max(row_end_table[b * table_stride], 0)), M);
  const int64_t per_row = F / V;
  const Pack<T, V>* hv = reinterpret_cast<const Pack<T, V>*>(h + b * M * 2 * F);
  Pack<T, V>* av = reinterpret_cast<Pack<T, V>*>(act + b * M * F);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t end = (zero_tail ? M : rows) * per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < end; i += stride) {
    const int64_t r = i / per_row, c = i - r * per_row;
    Pack<T, V> out;
    if (r < rows) {
      const Pack<T, V> gate = hv[r * 2 * per_row + c], up = hv[r * 2 * per_row + per_row + c];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float g = to_f32(gate.v[k]);
        out.v[k] = from_f32<T>(g / (1.0f + expf(-g)) * to_f32(up.v[k]));
      }
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) out.v[k] = from_f32<T>(0.0f);
    }
    av[i] = out;
  }
}

template <typename T, int V>
void launch_swiglu(const void* h, void* act, int64_t batch, int64_t M, int64_t F, const int32_t* row_end_table,
                   int64_t table_stride, bool zero_tail, cudaStream_t stream) {
  int device = 0;
  cudaGetDevice(&device);
  const int64_t vectors = M * (F / V);
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(vectors, 256), 8 * sm_count(device))));
  swiglu_rows_kernel<T, V><<<dim3(blocks, static_cast<unsigned>(batch)), 256, 0, stream>>>(
      static_cast<const T*>(h), static_cast<T*>(act), M, F, row_end_table, table_stride, zero_tail);
}

ffi::Error GroupedGemmSwigluImpl(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                                 ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> h,
                                 ffi::Result<ffi::AnyBuffer> act, ffi::Result<ffi::AnyBuffer> workspace,
                                 bool transpose_rhs, bool zero_tail) {
  auto dims = check_grouped_gemm_swiglu(lhs, rhs, group_sizes, *h, *act, transpose_rhs);
  if (!dims) return dims.error();
  const int64_t F = dims->F, batch = dims->gemm.batch, M = dims->gemm.M, G = dims->gemm.G;
  const int32_t* offsets = nullptr;
  if (auto err = run_grouped_gemm(stream, lhs, rhs, group_sizes, *h, *workspace, transpose_rhs, zero_tail, &offsets);
      err.failure())
    return err;
  if (offsets == nullptr || batch == 0 || M == 0 || F == 0) return ffi::Error::Success();
  // 16-byte vectors when every row of h and act starts on a 16-byte boundary (F a multiple of the width).
  const bool aligned = (reinterpret_cast<uintptr_t>(h->untyped_data()) % 16 == 0) &&
                       (reinterpret_cast<uintptr_t>(act->untyped_data()) % 16 == 0);
  dispatch_float(h->element_type(), [&](auto zero) {
    using T = decltype(zero);
    constexpr int kWide = 16 / sizeof(T);
    if (aligned && F % kWide == 0)
      launch_swiglu<T, kWide>(h->untyped_data(), act->untyped_data(), batch, M, F, offsets + G, G + 1, zero_tail,
                              stream);
    else
      launch_swiglu<T, 1>(h->untyped_data(), act->untyped_data(), batch, M, F, offsets + G, G + 1, zero_tail, stream);
  });
  return last_cuda_error("grouped_gemm_swiglu");
}

}  // namespace
}  // namespace turbo_moe

// No scratch, no host synchronisation, like turbo_moe_grouped_gemm: command-buffer compatible.
TURBO_MOE_CUDA_HANDLER(turbo_moe_grouped_gemm_swiglu, turbo_moe::GroupedGemmSwigluImpl,
                       turbo_moe::grouped_gemm_swiglu_signature);
