// CUDA FFI handler turbo_moe_permute_fp8 (contract: kernels/contracts/permute_fp8.h; CPU: kernels/cpu/permute_fp8.cc):
// permute_rows' copy step writing FP8 E4M3 rows and their 1x128 scales, the grouped FP8 GEMM's lhs, so no separate
// pass reads the permuted activations again to quantise them. One warp per token copy quantises it with
// row_quantize.cuh's warp step (quantize_rows.cu's too), bit-identical to the jnp quantiser.
#include "../contracts/permute_fp8.h"
#include "../contracts/registration.h"
#include "block_scan.cuh"
#include "common.cuh"
#include "row_quantize.cuh"

namespace turbo_moe {
namespace {

static_assert(kRowQuantizeTile == kPermuteFp8Tile && fp8_max<__NV_E4M3>() == kE4m3Max);

// One warp per slot: q[row_index[s]] and scale[row_index[s]] from x[s / k].
template <typename T>
__global__ void permute_quantize_kernel(const T* __restrict__ x, const int32_t* __restrict__ row_index,
                                     uint32_t* __restrict__ q, float* __restrict__ scale, int64_t tokens, int64_t k,
                                     int64_t H, int64_t total_slots) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (warp >= total_slots) return;
  const int64_t slots = tokens * k, b = warp / slots, s = warp % slots;
  const int32_t r = row_index[warp];
  if (r < 0 || r >= slots) return;  // a dropped copy
  warp_quantize_row<__NV_E4M3>(x + (b * tokens + s / k) * H, H, q + (b * slots + r) * (H / 4),
                               scale + (b * slots + r) * (H / kPermuteFp8Tile), lane);
}

// Rows [sum(group_sizes[b]), slots) of each batch: q 0 and scale 1 (a zero row's quantisation). Every block sums
// the E sizes itself (a few KB from L2).
__global__ void fill_tail_kernel(uint8_t* q, float* scale, int64_t slots, int64_t H, const int32_t* group_sizes,
                                 int64_t E) {
  const int64_t b = blockIdx.y;
  const long long total = block_group_total(group_sizes, b, E);
  const int64_t begin = min(static_cast<int64_t>(total), slots);
  const int64_t nb = H / kPermuteFp8Tile;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // H % 128 == 0: a row of q is a whole number of 16-byte vectors, and XLA's buffers are 16-byte aligned.
  uint4* qv = reinterpret_cast<uint4*>(q + (b * slots + begin) * H);
  for (int64_t i = tid; i < (slots - begin) * H / 16; i += stride) qv[i] = make_uint4(0, 0, 0, 0);
  float* sv = scale + (b * slots + begin) * nb;
  for (int64_t i = tid; i < (slots - begin) * nb; i += stride) sv[i] = 1.0f;
}

ffi::Error PermuteFp8Impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> row_index,
                          ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> q,
                          ffi::Result<ffi::AnyBuffer> scale, bool zero_tail) {
  auto dims = check_permute_fp8(x, row_index, group_sizes, *q, *scale);
  if (!dims) return dims.error();
  const int64_t batch = dims->batch, T = dims->T, H = dims->H, k = dims->k, E = dims->E, slots = dims->slots;
  if (batch == 0 || slots == 0) return ffi::Error::Success();
  const int64_t total_slots = batch * slots;
  auto* q_p = static_cast<uint8_t*>(q->untyped_data());
  auto* s_p = static_cast<float*>(scale->untyped_data());
  dispatch_float(x.element_type(), [&](auto tag) {
    using Elem = decltype(tag);
    permute_quantize_kernel<Elem><<<static_cast<unsigned>(ceil_div(total_slots, 8)), 256, 0, stream>>>(
        static_cast<const Elem*>(x.untyped_data()), row_index.typed_data(), reinterpret_cast<uint32_t*>(q_p), s_p, T,
        k, H, total_slots);
  });
  if (zero_tail)
    fill_tail_kernel<<<dim3(32, static_cast<unsigned>(batch)), 256, 0, stream>>>(q_p, s_p, slots, H,
                                                                                 group_sizes.typed_data(), E);
  return last_cuda_error("permute_fp8");
}

}  // namespace
}  // namespace turbo_moe

// No scratch, no host synchronisation, every launch on `stream`: command-buffer compatible.
TURBO_MOE_CUDA_HANDLER(turbo_moe_permute_fp8, turbo_moe::PermuteFp8Impl, turbo_moe::permute_fp8_signature);
