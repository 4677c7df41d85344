// CUDA FFI handler turbo_moe_quantize_rows (contract: kernels/contracts/quantize_rows.h; CPU:
// kernels/cpu/quantize_rows.cc): activations quantised to FP8 per 1x128 tile in one pass, in place of XLA's
// reduction and elementwise passes. One warp per row runs row_quantize.cuh's warp step (permute_fp8.cu's too),
// bit-identical to the jnp quantiser; 8 rows a block, and a grid-stride loop for row counts past the grid's bound.
#include "../contracts/quantize_rows.h"
#include "../contracts/registration.h"
#include "common.cuh"
#include "row_quantize.cuh"

namespace turbo_moe {
namespace {

static_assert(kRowQuantizeTile == kQuantizeRowsTile);

constexpr int kThreads = 256;                 // 8 warps, 8 rows at a time
constexpr int64_t kMaxBlocks = int64_t{1} << 30;

template <__nv_fp8_interpretation_t kFormat, typename T>
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(const T* __restrict__ x, uint32_t* __restrict__ q,
                                                                 float* __restrict__ scale, int64_t rows,
                                                                 int64_t K) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32; r < rows; r += warps)
    warp_quantize_row<kFormat>(x + r * K, K, q + r * (K / 4), scale + r * (K / kQuantizeRowsTile), lane);
}

template <__nv_fp8_interpretation_t kFormat>
void launch(cudaStream_t stream, ffi::AnyBuffer x, uint32_t* q, float* scale, int64_t rows, int64_t K) {
  const unsigned blocks = static_cast<unsigned>(min64(ceil_div(rows, kThreads / 32), kMaxBlocks));
  dispatch_float(x.element_type(), [&](auto tag) {
    using Elem = decltype(tag);
    quantize_rows_kernel<kFormat, Elem><<<blocks, kThreads, 0, stream>>>(static_cast<const Elem*>(x.untyped_data()),
                                                                         q, scale, rows, K);
  });
}

ffi::Error QuantizeRowsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                            ffi::Result<ffi::AnyBuffer> scale) {
  auto dims = check_quantize_rows(x, *q, *scale);
  if (!dims) return dims.error();
  if (dims->rows == 0) return ffi::Error::Success();
  auto* q_p = static_cast<uint32_t*>(q->untyped_data());
  auto* s_p = static_cast<float*>(scale->untyped_data());
  if (dims->e4m3)
    launch<__NV_E4M3>(stream, x, q_p, s_p, dims->rows, dims->K);
  else
    launch<__NV_E5M2>(stream, x, q_p, s_p, dims->rows, dims->K);
  return last_cuda_error("quantize_rows");
}

}  // namespace
}  // namespace turbo_moe

// No scratch, no host synchronisation, one launch on `stream`: command-buffer compatible.
TURBO_MOE_CUDA_HANDLER(turbo_moe_quantize_rows, turbo_moe::QuantizeRowsImpl, turbo_moe::quantize_rows_signature);
