// Block-wide inclusive scan used by the layout and permute kernels.
#pragma once

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

}  // namespace turbo_moe
