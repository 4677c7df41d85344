// Block-wide scan and sum used by the layout, permute and dispatch kernels.
#pragma once

#include <cstdint>

namespace turbo_moe {

// Inclusive scan of one int64 per thread across the block; *total gets the block's sum.
__device__ __forceinline__ long long block_inclusive_scan(long long v, long long* warp_sums, long long* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int d = 1; d < 32; d <<= 1) {
    long long n = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += n;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    long long w = lane < warps ? warp_sums[lane] : 0;
    for (int d = 1; d < 32; d <<= 1) {
      long long n = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += n;
    }
    warp_sums[lane] = w;
  }
  __syncthreads();
  if (warp > 0) v += warp_sums[warp - 1];
  *total = warp_sums[warps - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return v;
}

// Sum of batch b's E group sizes (negatives count as 0), known to every thread of the block (blockDim.x a multiple
// of 32): the tail-filling kernels find where a batch's group rows end with it.
__device__ __forceinline__ long long block_group_total(const int32_t* group_sizes, int64_t b, int64_t E) {
  __shared__ long long warp_sums[32];
  long long mine = 0;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) mine += max(group_sizes[b * E + e], 0);
  for (int d = 16; d > 0; d >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, d);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = mine;
  __syncthreads();
  long long total = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += warp_sums[w];
  return total;
}

}  // namespace turbo_moe
