// Device-side group layout: clamped group offsets and row-tile prefixes from group_sizes, and a
// zero-fill of the rows that belong to no group. Both read sizes on the device: no host sync.
#include "block_scan.cuh"
#include "common.cuh"

namespace turbo_moe {
namespace {

constexpr int kScanThreads = 1024;

// One block per batch element; groups are scanned in chunks of blockDim.
__global__ void group_offsets_kernel(const int32_t* sizes, int64_t groups, int64_t rows,
                                     int32_t* offsets, int32_t* tile_prefix, int tile_rows) {
  __shared__ long long warp_sums[32];
  const int64_t b = blockIdx.x;
  sizes += b * groups;
  offsets += b * (groups + 1);
  if (tile_prefix) tile_prefix += b * (groups + 1);
  long long carry = 0, tile_carry = 0;
  for (int64_t g0 = 0; g0 < groups; g0 += blockDim.x) {
    const int64_t g = g0 + threadIdx.x;
    const long long size = g < groups ? max(sizes[g], 0) : 0;
    long long chunk_total;
    const long long end = carry + block_inclusive_scan(size, warp_sums, &chunk_total);
    const long long start = end - size;
    const long long c_start = min(start, (long long)rows), c_end = min(end, (long long)rows);
    if (g < groups) offsets[g] = static_cast<int32_t>(c_start);
    carry += chunk_total;
    if (tile_prefix) {
      const long long tiles = (c_end - c_start + tile_rows - 1) / tile_rows;
      long long tiles_total;
      const long long tiles_end = tile_carry + block_inclusive_scan(tiles, warp_sums, &tiles_total);
      if (g < groups) tile_prefix[g] = static_cast<int32_t>(tiles_end - tiles);
      tile_carry += tiles_total;
    }
  }
  if (threadIdx.x == 0) {
    offsets[groups] = static_cast<int32_t>(min(carry, (long long)rows));
    if (tile_prefix) tile_prefix[groups] = static_cast<int32_t>(tile_carry);
  }
}

__global__ void zero_tail_rows_kernel(char* data, int64_t rows, int64_t row_bytes,
                                      const int32_t* row_begin_table, int64_t table_stride) {
  const int64_t b = blockIdx.y;
  char* base = data + b * rows * row_bytes;
  const int64_t begin_row = min(static_cast<int64_t>(max(row_begin_table[b * table_stride], 0)), rows);
  int64_t begin = begin_row * row_bytes;
  const int64_t end = rows * row_bytes;
  if (begin >= end) return;
  // Bytes up to the first 16-byte boundary, then 16-byte stores, then the remaining bytes.
  const int64_t misalign = (16 - (reinterpret_cast<uintptr_t>(base + begin) & 15)) & 15;
  const int64_t head_end = min(end, begin + misalign);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = begin + tid; i < head_end; i += stride) base[i] = 0;
  begin = head_end;
  const int64_t vectors = (end - begin) / 16;
  uint4* vbase = reinterpret_cast<uint4*>(base + begin);
  for (int64_t i = tid; i < vectors; i += stride) vbase[i] = make_uint4(0, 0, 0, 0);
  for (int64_t i = begin + vectors * 16 + tid; i < end; i += stride) base[i] = 0;
}

}  // namespace

void launch_group_offsets(const int32_t* sizes, int64_t batch, int64_t groups, int64_t rows,
                          int32_t* offsets, int32_t* tile_prefix, int tile_rows, cudaStream_t stream) {
  const int threads = static_cast<int>(std::min<int64_t>(kScanThreads, std::max<int64_t>(32, ceil_div(groups, 32) * 32)));
  group_offsets_kernel<<<static_cast<unsigned>(batch), threads, 0, stream>>>(sizes, groups, rows, offsets,
                                                                              tile_prefix, tile_rows);
}

void launch_zero_tail_rows(void* data, int64_t batch, int64_t rows, int64_t row_bytes,
                           const int32_t* row_begin_table, int64_t table_stride, cudaStream_t stream) {
  if (batch == 0 || rows == 0 || row_bytes == 0) return;
  int device = 0;
  cudaGetDevice(&device);
  const int64_t wanted = ceil_div(rows * row_bytes, 16 * 256 * 4);
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, 2 * sm_count(device))));
  dim3 grid(blocks, static_cast<unsigned>(batch));
  zero_tail_rows_kernel<<<grid, 256, 0, stream>>>(static_cast<char*>(data), rows, row_bytes,
                                                  row_begin_table, table_stride);
}

}  // namespace turbo_moe
