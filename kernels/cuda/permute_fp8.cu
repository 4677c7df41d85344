// CUDA FFI handlers (contract: kernels/contracts/permute_fp8.h; CPU: kernels/cpu/permute_fp8.cc) of permute_rows'
// copy step writing FP8 rows and their 1x128 scales, so no separate pass reads the permuted rows again to quantise
// them:
//   turbo_moe_permute_fp8:      q and scale (E4M3), the grouped FP8 GEMM's lhs in the forward;
//   turbo_moe_permute_rows_fp8: rows (x's dtype, as permute_rows writes them) and q and scale (E4M3 or E5M2) from one
//                               read of x, the FP8 expert block's backward (the bf16 weight gradient reads the rows).
// One warp per token copy quantises it with row_quantize.cuh's warp step (quantize_rows.cu's too), bit-identical to
// the jnp quantiser.
#include "../contracts/permute_fp8.h"
#include "../contracts/registration.h"
#include "block_scan.cuh"
#include "common.cuh"
#include "row_quantize.cuh"

namespace turbo_moe {
namespace {

static_assert(kRowQuantizeTile == kPermuteFp8Tile && fp8_max<__NV_E4M3>() == kE4m3Max);

constexpr int kThreads = 256;  // 8 warps: 8 token copies a block

// One warp per slot: q[row_index[s]] and scale[row_index[s]] from x[s / k].
template <typename T>
__global__ void permute_quantize_kernel(const T* __restrict__ x, const int32_t* __restrict__ row_index,
                                        uint32_t* __restrict__ q, float* __restrict__ scale, int64_t tokens,
                                        int64_t k, int64_t H, int64_t total_slots) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (warp >= total_slots) return;
  const int64_t slots = tokens * k, b = warp / slots, s = warp % slots;
  const int32_t r = row_index[warp];
  if (r < 0 || r >= slots) return;  // a dropped copy
  warp_quantize_row<__NV_E4M3>(x + (b * tokens + s / k) * H, H, q + (b * slots + r) * (H / 4),
                               scale + (b * slots + r) * (H / kPermuteFp8Tile), lane);
}

// warp_quantize_row's loop (row_quantize.cuh: the same loads, tile amax, scale and quantize4) that also stores each
// loaded vector to `copy`, so the row and its FP8 codes come from one read of src.
template <__nv_fp8_interpretation_t kFormat, typename T>
__device__ __forceinline__ void warp_copy_quantize_row(const T* __restrict__ src, T* __restrict__ copy, int64_t H,
                                                       uint32_t* __restrict__ dst, float* __restrict__ dst_scale,
                                                       int lane) {
  constexpr int kValues = kRowQuantizeLaneValues, kInFlight = kRowQuantizeTilesInFlight;
  using Vec = Pack<T, kValues>;
  const Vec* vec = reinterpret_cast<const Vec*>(src);
  Vec* out = reinterpret_cast<Vec*>(copy);
  const int64_t tiles = H / kRowQuantizeTile;
  const float inv_max = static_cast<float>(1.0 / static_cast<double>(fp8_max<kFormat>()));
  for (int64_t t0 = 0; t0 < tiles; t0 += kInFlight) {
    float v[kInFlight][kValues];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j)
      if (t0 + j < tiles) {
        const Vec p = vec[(t0 + j) * 32 + lane];
        out[(t0 + j) * 32 + lane] = p;
#pragma unroll
        for (int i = 0; i < kValues; ++i) v[j][i] = to_f32(p.v[i]);
      }
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {
      if (t0 + j >= tiles) break;
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < kValues; ++i) amax = fmaxf(amax, fabsf(v[j][i]));
#pragma unroll
      for (int d = 16; d > 0; d >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
      const float s = amax > 0.0f ? __fmul_rn(amax, inv_max) : 1.0f;
      dst[(t0 + j) * 32 + lane] = quantize4<kFormat>(v[j], __frcp_rn(s));
      if (lane == 0) dst_scale[t0 + j] = s;
    }
  }
}

// One warp per slot: rows[row_index[s]], q[row_index[s]] and scale[row_index[s]] from x[s / k].
template <__nv_fp8_interpretation_t kFormat, typename T>
__global__ void __launch_bounds__(kThreads)
    permute_copy_quantize_kernel(const T* __restrict__ x, const int32_t* __restrict__ row_index, T* __restrict__ rows,
                                 uint32_t* __restrict__ q, float* __restrict__ scale, int64_t tokens, int64_t k,
                                 int64_t H, int64_t total_slots) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (warp >= total_slots) return;
  const int64_t slots = tokens * k, b = warp / slots, s = warp % slots;
  const int32_t r = row_index[warp];
  if (r < 0 || r >= slots) return;  // a dropped copy (any row outside the output)
  const int64_t row = b * slots + r;
  warp_copy_quantize_row<kFormat>(x + (b * tokens + s / k) * H, rows + row * H, H, q + row * (H / 4),
                                  scale + row * (H / kPermuteFp8Tile), lane);
}

// Rows [sum(group_sizes[b]), slots) of each batch: q 0 and scale 1 (a zero row's quantisation), and rows (when not
// null, row_bytes a row) 0. Every block sums the E sizes itself (a few KB from L2).
__global__ void fill_tail_kernel(char* rows, int64_t row_bytes, uint8_t* q, float* scale, int64_t slots, int64_t H,
                                 const int32_t* group_sizes, int64_t E) {
  const int64_t b = blockIdx.y;
  const long long total = block_group_total(group_sizes, b, E);
  const int64_t begin = b * slots + min(static_cast<int64_t>(total), slots), n = (b + 1) * slots - begin;
  const int64_t nb = H / kPermuteFp8Tile;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // H % 128 == 0: a row of q (and of rows) is a whole number of 16-byte vectors, and XLA's buffers are 16-byte
  // aligned.
  const uint4 zero = make_uint4(0, 0, 0, 0);
  uint4* qv = reinterpret_cast<uint4*>(q + begin * H);
  for (int64_t i = tid; i < n * H / 16; i += stride) qv[i] = zero;
  float* sv = scale + begin * nb;
  for (int64_t i = tid; i < n * nb; i += stride) sv[i] = 1.0f;
  if (rows == nullptr) return;
  uint4* rv = reinterpret_cast<uint4*>(rows + begin * row_bytes);
  for (int64_t i = tid; i < n * row_bytes / 16; i += stride) rv[i] = zero;
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
    permute_quantize_kernel<Elem><<<static_cast<unsigned>(ceil_div(total_slots, kThreads / 32)), kThreads, 0,
                                    stream>>>(static_cast<const Elem*>(x.untyped_data()), row_index.typed_data(),
                                              reinterpret_cast<uint32_t*>(q_p), s_p, T, k, H, total_slots);
  });
  if (zero_tail)
    fill_tail_kernel<<<dim3(32, static_cast<unsigned>(batch)), kThreads, 0, stream>>>(
        /*rows=*/nullptr, 0, q_p, s_p, slots, H, group_sizes.typed_data(), E);
  return last_cuda_error("permute_fp8");
}

template <__nv_fp8_interpretation_t kFormat>
void launch_copy_quantize(cudaStream_t stream, ffi::AnyBuffer x, const int32_t* row_index, void* rows, uint32_t* q,
                          float* scale, const PermuteFp8Dims& d) {
  const int64_t total_slots = d.batch * d.slots;
  dispatch_float(x.element_type(), [&](auto tag) {
    using Elem = decltype(tag);
    permute_copy_quantize_kernel<kFormat, Elem>
        <<<static_cast<unsigned>(ceil_div(total_slots, kThreads / 32)), kThreads, 0, stream>>>(
            static_cast<const Elem*>(x.untyped_data()), row_index, static_cast<Elem*>(rows), q, scale, d.T, d.k, d.H,
            total_slots);
  });
}

ffi::Error PermuteRowsFp8Impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> row_index,
                              ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> rows,
                              ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> scale, bool zero_tail) {
  auto dims = check_permute_rows_fp8(x, row_index, group_sizes, *rows, *q, *scale);
  if (!dims) return dims.error();
  if (dims->batch == 0 || dims->slots == 0) return ffi::Error::Success();
  auto* rows_p = static_cast<char*>(rows->untyped_data());
  auto* q_p = static_cast<uint8_t*>(q->untyped_data());
  auto* s_p = static_cast<float*>(scale->untyped_data());
  auto* q_words = reinterpret_cast<uint32_t*>(q_p);
  if (dims->e4m3)
    launch_copy_quantize<__NV_E4M3>(stream, x, row_index.typed_data(), rows_p, q_words, s_p, *dims);
  else
    launch_copy_quantize<__NV_E5M2>(stream, x, row_index.typed_data(), rows_p, q_words, s_p, *dims);
  if (zero_tail)
    fill_tail_kernel<<<dim3(32, static_cast<unsigned>(dims->batch)), kThreads, 0, stream>>>(
        rows_p, dims->H * byte_width(x.element_type()), q_p, s_p, dims->slots, dims->H, group_sizes.typed_data(),
        dims->E);
  return last_cuda_error("permute_rows_fp8");
}

}  // namespace
}  // namespace turbo_moe

// No scratch, no host synchronisation, every launch on `stream`: command-buffer compatible.
TURBO_MOE_CUDA_HANDLER(turbo_moe_permute_fp8, turbo_moe::PermuteFp8Impl, turbo_moe::permute_fp8_signature);

TURBO_MOE_CUDA_HANDLER(turbo_moe_permute_rows_fp8, turbo_moe::PermuteRowsFp8Impl,
                       turbo_moe::permute_rows_fp8_signature);
