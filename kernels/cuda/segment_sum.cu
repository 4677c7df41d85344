// CUDA FFI handler of the sorted segment sum (contract of kernels/cpu/segment_sum.cc):
//   turbo_moe_segment_sum: data (N, D), sorted_ids (N,), order (N,) -> out (V, D)
// out[v] = sum of data[order[p]] over the positions p with sorted_ids[p] == v, accumulated in float32 and
// rounded once; ids outside [0, V) are dropped. sorted_ids must be ascending (Python sorts them with XLA).
// Why not a scatter-add: XLA's GPU scatter adds with atomics, and the rows of frequent ids (real text's
// tokens) serialise on them (measured: docs/kernels.md). Here each segment is summed by
// one block per column slab, rows split over its warps, the warps' partials added in a fixed order:
// deterministic, no atomics, cost N x D reads + V x D writes whatever the ids' distribution.
#include "../contracts/registration.h"
#include "../contracts/segment_sum.h"
#include "common.cuh"

namespace turbo_moe {
namespace {

constexpr int kWarps = 8;              // warps per block; each sums every kWarps-th row of a segment
constexpr int kPositionBlocks = 1024;  // blocks over the sorted positions (per slab): each walks N / 1024

// First position q > p with ids[q] != id (ids ascending; N if none), by warp 0: one ballot over the next 32 ids
// settles most segments in one load (a binary search costs ~14 dependent loads for every segment, and short
// segments are most of them); longer segments finish with a binary search.
__device__ __forceinline__ int64_t segment_end(const int32_t* ids, int64_t p, int64_t N, int32_t id, int lane) {
  const int64_t q = p + 1 + lane;
  const unsigned same = __ballot_sync(0xffffffffu, q < N && ids[q] == id);
  if (same != 0xffffffffu) return p + 1 + (__ffs(~same) - 1);  // the same ids are a prefix: sorted
  int64_t lo = p + 33, hi = N;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (ids[mid] > id) hi = mid; else lo = mid + 1;
  }
  return lo;
}

// Grid (position blocks, column slabs, batch). A slab is 32 lanes x VEC columns. A block takes the segments
// that start at its positions p (p = blockIdx.x, + gridDim.x, ...), so every segment has exactly one owner.
template <typename T, int VEC>
__global__ void __launch_bounds__(kWarps * 32) segment_sum_kernel(const T* data, const int32_t* sorted_ids,
                                                                  const int32_t* order, T* out, int64_t N,
                                                                  int64_t D, int64_t V) {
  __shared__ float partial[kWarps][32 * VEC];
  __shared__ int64_t end_shared;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t b = blockIdx.z, col = static_cast<int64_t>(blockIdx.y) * 32 * VEC + lane * VEC;
  const int32_t* ids = sorted_ids + b * N;
  const int32_t* rows = order + b * N;
  const T* src = data + b * N * D;
  T* dst = out + b * V * D;
  for (int64_t p = blockIdx.x; p < N; p += gridDim.x) {
    const int32_t id = ids[p];
    if (id < 0 || id >= V || (p > 0 && ids[p - 1] == id)) continue;  // dropped, or not a segment's start
    if (warp == 0) {
      const int64_t end = segment_end(ids, p, N, id, lane);
      if (lane == 0) end_shared = end;
    }
    __syncthreads();
    const int64_t end = end_shared;
    float acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
    if (col < D) {
#pragma unroll 4
      for (int64_t q = p + warp; q < end; q += kWarps) {
        const int32_t r = rows[q];
        if (r < 0 || r >= N) continue;  // not a permutation of [0, N): the row is skipped, never read out of bounds
        const T* row = src + static_cast<int64_t>(r) * D + col;
        if constexpr (VEC * sizeof(T) == 16) {
          union { uint4 raw; T v[VEC]; } u;
          u.raw = *reinterpret_cast<const uint4*>(row);
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc[i] += to_f32(u.v[i]);
        } else {
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc[i] += to_f32(row[i]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) partial[warp][lane * VEC + i] = acc[i];
    __syncthreads();
    // The block's threads add the warps' partials column by column, warp 0 first: a fixed order.
    for (int c = threadIdx.x; c < 32 * VEC; c += kWarps * 32) {
      const int64_t out_col = static_cast<int64_t>(blockIdx.y) * 32 * VEC + c;
      if (out_col >= D) continue;
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += partial[w][c];
      dst[static_cast<int64_t>(id) * D + out_col] = from_f32<T>(sum);
    }
    __syncthreads();  // partial and end_shared are reused by the block's next segment
  }
}

template <typename T>
void launch(const void* data, const int32_t* sorted_ids, const int32_t* order, void* out, int64_t batch, int64_t N,
            int64_t D, int64_t V, bool vector_ok, cudaStream_t stream) {
  const auto run = [&](auto vec_tag) {
    constexpr int VEC = decltype(vec_tag)::value;
    const dim3 grid(static_cast<unsigned>(min64(N, kPositionBlocks)), static_cast<unsigned>(ceil_div(D, 32 * VEC)),
                    static_cast<unsigned>(batch));
    segment_sum_kernel<T, VEC><<<grid, kWarps * 32, 0, stream>>>(static_cast<const T*>(data), sorted_ids, order,
                                                                 static_cast<T*>(out), N, D, V);
  };
  constexpr int kVec = 16 / sizeof(T);
  if (vector_ok) run(std::integral_constant<int, kVec>{});
  else run(std::integral_constant<int, 1>{});
}

ffi::Error SegmentSumImpl(cudaStream_t stream, ffi::AnyBuffer data, ffi::Buffer<ffi::S32> sorted_ids,
                          ffi::Buffer<ffi::S32> order, ffi::Result<ffi::AnyBuffer> out) {
  auto dims = check_segment_sum(data, sorted_ids, order, *out);
  if (!dims) return dims.error();
  const int64_t batch = dims->batch, N = dims->N, D = dims->D, V = dims->V, w = byte_width(data.element_type());
  if (batch == 0 || V == 0 || D == 0) return ffi::Error::Success();
  cudaMemsetAsync(out->untyped_data(), 0, static_cast<size_t>(batch * V * D * w), stream);  // rows of absent ids
  if (N > 0) {
    const bool vector_ok = (D * w) % 16 == 0 && reinterpret_cast<uintptr_t>(data.untyped_data()) % 16 == 0;
    dispatch_float(data.element_type(), [&](auto tag) {
      launch<decltype(tag)>(data.untyped_data(), sorted_ids.typed_data(), order.typed_data(), out->untyped_data(),
                            batch, N, D, V, vector_ok, stream);
    });
  }
  return last_cuda_error("segment_sum");
}

}  // namespace
}  // namespace turbo_moe

// No scratch, no host synchronisation, every launch on `stream`: command-buffer compatible.
TURBO_MOE_CUDA_HANDLER(turbo_moe_segment_sum, turbo_moe::SegmentSumImpl, turbo_moe::segment_sum_signature);
