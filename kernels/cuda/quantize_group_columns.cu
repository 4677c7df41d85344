// CUDA FFI handler turbo_moe_quantize_group_columns (contract: kernels/contracts/quantize_group_columns.h; CPU:
// kernels/cpu/quantize_group_columns.cc): the FP8 weight gradient's operand in one pass over x, in place of XLA's
// gather into a float32 padded copy, reduction and transpose.
// Grid: x = the 128-slot tiles of the padded layout, y = a few column blocks, each block looping over 64-column
// blocks of C. A block first finds where its tile reads from by scanning the G clamped, padded group sizes (no host
// sync, no prologue launch). Then per 64 columns: 4 row groups of 64 threads each load 32 rows of one column (a warp
// reads 32 consecutive columns of a row: coalesced along C), reduce the column's amax across the 4 row groups in
// shared memory, quantise, and pack 4 rows per 32-bit word into a shared (64 x 128 byte) tile that is then stored
// one column's 128 contiguous bytes per warp (coalesced along P). The arithmetic is the jnp reference's in IEEE
// float32 (round-to-nearest products, a correctly rounded reciprocal, the round-to-nearest-even FP8 conversion).
#include <cuda_fp8.h>

#include "../contracts/quantize_group_columns.h"
#include "../contracts/registration.h"
#include "block_scan.cuh"
#include "common.cuh"

namespace turbo_moe {
namespace {

constexpr int kThreads = 256;
constexpr int kColumns = static_cast<int>(kGroupColumnsBlock);  // 64 columns per step
constexpr int kRowGroups = kThreads / kColumns;                 // 4
constexpr int kRowsPerThread = static_cast<int>(kGroupColumnsTile) / kRowGroups;  // 32
constexpr int kTileWords = static_cast<int>(kGroupColumnsTile) / 4;             // 32 words of 4 bytes per column
constexpr int kMaxColumnBlocksPerTile = 16;  // grid.y: enough blocks for small M, one group scan per 16 steps at most

// This tile's rows: x rows [row0, row0 + rows), rows in [0, 128] (0: padding or past the groups). Every thread of the
// block scans the G sizes: ends_g = min(prefix of max(size, 0), M) is clamped_sizes' layout; the padded prefix of
// ceil(clamped / 128) * 128 places the group's tiles.
__device__ void find_tile_rows(const int32_t* group_sizes, int64_t G, int64_t M, int64_t p0, long long* row0,
                               int* rows) {
  __shared__ long long warp_sums[32];
  __shared__ long long found_row0;
  __shared__ int found_rows;
  if (threadIdx.x == 0) {
    found_row0 = 0;
    found_rows = 0;
  }
  long long carry = 0, pad_carry = 0;  // raw prefix and padded prefix before this chunk
  for (int64_t base = 0; base < G; base += blockDim.x) {
    const int64_t g = base + threadIdx.x;
    const long long size = g < G ? max(group_sizes[g], 0) : 0;
    long long total, pad_total;
    const long long end_raw = carry + block_inclusive_scan(size, warp_sums, &total);
    const long long end = min(end_raw, static_cast<long long>(M)), start = min(end_raw - size, static_cast<long long>(M));
    const long long clamped = end - start;
    const long long padded = (clamped + kGroupColumnsTile - 1) / kGroupColumnsTile * kGroupColumnsTile;
    const long long pad_end = pad_carry + block_inclusive_scan(padded, warp_sums, &pad_total);
    const long long pad_start = pad_end - padded;
    if (g < G && padded > 0 && pad_start <= p0 && p0 < pad_end) {  // at most one group holds slot p0
      found_row0 = start + (p0 - pad_start);
      found_rows = static_cast<int>(min(static_cast<long long>(kGroupColumnsTile), clamped - (p0 - pad_start)));
    }
    carry += total;
    pad_carry += pad_total;
  }
  __syncthreads();
  *row0 = found_row0;
  *rows = found_rows;
}

template <typename T, __nv_fp8_interpretation_t kFormat>
__global__ void __launch_bounds__(kThreads, 3) quantize_group_columns_kernel(const T* __restrict__ x,
                                                                          const int32_t* __restrict__ group_sizes,
                                                                          uint8_t* __restrict__ q_t,
                                                                          float* __restrict__ scale, int64_t M,
                                                                          int64_t C, int64_t G, int64_t P, float fmax) {
  __shared__ uint32_t packed[kColumns][kTileWords + 1];  // +1 word: the column-strided writes hit distinct banks
  __shared__ float part_amax[kRowGroups][kColumns];
  const int64_t tile = blockIdx.x, p0 = tile * kGroupColumnsTile;
  long long row0;
  int rows;
  find_tile_rows(group_sizes, G, M, p0, &row0, &rows);

  const int col = threadIdx.x % kColumns, group = threadIdx.x / kColumns;
  const int first = group * kRowsPerThread;  // this thread's rows of the tile: [first, first + 32)
  const float inv_max = static_cast<float>(1.0 / static_cast<double>(fmax));
  const int64_t column_blocks = ceil_div(C, kColumns);
  for (int64_t cb = blockIdx.y; cb < column_blocks; cb += gridDim.y) {
    const int64_t c = cb * kColumns + col;
    float v[kRowsPerThread];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      v[i] = (c < C && first + i < rows) ? to_f32(x[(row0 + first + i) * C + c]) : 0.0f;
      amax = fmaxf(amax, fabsf(v[i]));
    }
    part_amax[group][col] = amax;
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kRowGroups; ++r) amax = fmaxf(amax, part_amax[r][col]);
    const float s = amax > 0.0f ? __fmul_rn(amax, inv_max) : 1.0f;
    const float inv = __frcp_rn(s);  // 1 / s correctly rounded, as the reference's division
#pragma unroll
    for (int w = 0; w < kRowsPerThread / 4; ++w) {
      uint32_t word = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float q = fminf(fmax, fmaxf(-fmax, __fmul_rn(v[4 * w + i], inv)));
        word |= static_cast<uint32_t>(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, kFormat)) << (8 * i);
      }
      packed[col][group * (kRowsPerThread / 4) + w] = word;
    }
    if (group == 0 && c < C) scale[tile * C + c] = s;
    __syncthreads();
    // q_t[c, p0:p0+128]: one warp per column, 32 words of 4 bytes (P % 128 == 0 keeps them aligned).
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int k = warp; k < kColumns; k += kThreads / 32) {
      const int64_t cc = cb * kColumns + k;
      if (cc < C) reinterpret_cast<uint32_t*>(q_t + cc * P + p0)[lane] = packed[k][lane];
    }
    __syncthreads();  // packed and part_amax are reused by the next step
  }
}

ffi::Error QuantizeGroupColumnsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> group_sizes,
                                    ffi::Result<ffi::AnyBuffer> q_t, ffi::Result<ffi::AnyBuffer> scale) {
  auto dims = check_quantize_group_columns(x, group_sizes, *q_t, *scale);
  if (!dims) return dims.error();
  const int64_t M = dims->M, C = dims->C, G = dims->G, P = dims->P;
  if (P == 0) return ffi::Error::Success();
  const int64_t column_blocks = ceil_div(C, kColumns);
  const dim3 grid(static_cast<unsigned>(P / kGroupColumnsTile),
                  static_cast<unsigned>(min64(column_blocks, kMaxColumnBlocksPerTile)));
  auto* q_p = static_cast<uint8_t*>(q_t->untyped_data());
  auto* s_p = static_cast<float*>(scale->untyped_data());
  const bool e4m3 = q_t->element_type() == ffi::DataType::F8E4M3FN;
  dispatch_float(x.element_type(), [&](auto tag) {
    using Elem = decltype(tag);
    const auto* x_p = static_cast<const Elem*>(x.untyped_data());
    if (e4m3)
      quantize_group_columns_kernel<Elem, __NV_E4M3><<<grid, kThreads, 0, stream>>>(
          x_p, group_sizes.typed_data(), q_p, s_p, M, C, G, P, dims->fmax);
    else
      quantize_group_columns_kernel<Elem, __NV_E5M2><<<grid, kThreads, 0, stream>>>(
          x_p, group_sizes.typed_data(), q_p, s_p, M, C, G, P, dims->fmax);
  });
  return last_cuda_error("quantize_group_columns");
}

}  // namespace
}  // namespace turbo_moe

// No scratch, no host synchronisation, every launch on `stream`: command-buffer compatible.
TURBO_MOE_CUDA_HANDLER(turbo_moe_quantize_group_columns, turbo_moe::QuantizeGroupColumnsImpl,
                       turbo_moe::quantize_group_columns_signature);
