// The grouped GEMMs' prologue helpers (grouped_gemm_sm90.cuh, grouped_gemm_fp8.cu): a block-wide walk over the group
// sizes and a grid-strided zero fill of what the GEMM does not write.
#pragma once

#include <cstdint>

#include "block_scan.cuh"

namespace turbo_moe {

// Visits (g, start, rows) for every group, a chunk of blockDim.x groups at a time (all threads take part, so visit may
// hold block barriers; g >= G past the last group), with the sizes clamped to M rows in all. `start` is the group's
// first row in the plain layout, or with kRound > 1 in the padded one where every group's rows are rounded up to
// kRound (the FP8 weight gradient's 128-row scale tiles). Returns min(sum(sizes), M).
template <int64_t kRound = 1, typename Visit>
__device__ int64_t scan_group_rows(const int32_t* sizes, int64_t G, int64_t M, Visit visit) {
  __shared__ long long warp_sums[32];
  long long carry = 0, padded_carry = 0;
  for (int64_t g0 = 0; g0 < G; g0 += blockDim.x) {
    const int64_t g = g0 + threadIdx.x;
    const long long size = g < G ? max(sizes[g], 0) : 0;
    long long chunk_total;
    const long long end = carry + block_inclusive_scan(size, warp_sums, &chunk_total);
    const long long start = min(end - size, static_cast<long long>(M)), stop = min(end, static_cast<long long>(M));
    const long long rows = stop - start;
    if constexpr (kRound == 1) {
      visit(g, static_cast<int64_t>(start), static_cast<int64_t>(rows));
    } else {
      const long long padded = (rows + kRound - 1) / kRound * kRound;
      long long padded_total;
      const long long padded_end = padded_carry + block_inclusive_scan(padded, warp_sums, &padded_total);
      visit(g, static_cast<int64_t>(padded_end - padded), static_cast<int64_t>(rows));
      padded_carry += padded_total;
    }
    carry += chunk_total;
  }
  return min(carry, static_cast<long long>(M));
}

// Zeroes bytes [begin, end) of `base` (both multiples of 16, base 16-aligned) with `blocks` blocks, this one `rank`.
inline __device__ void zero_span(char* base, int64_t begin, int64_t end, int64_t rank, int64_t blocks) {
  uint4* v = reinterpret_cast<uint4*>(base + begin);
  const int64_t n = (end - begin) / 16;
  for (int64_t i = rank * blockDim.x + threadIdx.x; i < n; i += blocks * blockDim.x) v[i] = make_uint4(0, 0, 0, 0);
}

}  // namespace turbo_moe
