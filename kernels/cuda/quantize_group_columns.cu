// CUDA FFI handler turbo_moe_quantize_group_columns (contract: kernels/contracts/quantize_group_columns.h; CPU:
// kernels/cpu/quantize_group_columns.cc): the FP8 weight gradient's operand in one pass over x, in place of XLA's
// gather into a float32 padded copy, reduction and transpose.
// Work unit: (128-slot tile of the padded layout, 32 * V columns), V = 16 bytes of x's elements (8 bf16/f16, 4 f32).
// A persistent grid (as many blocks as fit at once) takes contiguous ranges of units in tile-major order, so a block
// scans the G clamped, padded group sizes only when its tile changes (no host sync, no prologue launch). Per unit:
// warp w loads rows [16w, 16w + 16) of the tile, a lane one 16-byte vector of each (a warp reads 512 contiguous
// bytes of a row), takes its columns' amax over its rows, the 8 warps' amaxes meet in shared memory, and each lane
// quantises its 16 rows x V columns into V 16-byte column pieces of a shared (columns x 128 bytes) tile (the piece's
// slot XOR-swizzled so that neither its write nor the row-wise read below conflicts on banks), which is then stored
// 16 bytes a thread, each column's 128 contiguous bytes of q_t (coalesced along P). The arithmetic is the jnp
// reference's in IEEE float32 (round-to-nearest products, a correctly rounded reciprocal, the round-to-nearest-even
// FP8 conversion). Widths that are not a multiple of V (or a misaligned x) load element by element.
#include <cuda_fp8.h>

#include <type_traits>

#include "../contracts/quantize_group_columns.h"
#include "../contracts/registration.h"
#include "block_scan.cuh"
#include "common.cuh"

namespace turbo_moe {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = static_cast<int>(kGroupColumnsTile);  // 128 rows of a scale tile = 128 bytes of a q_t column
constexpr int kRowsPerWarp = kTile / kWarps;                 // 16: one 16-byte piece of a column per warp
constexpr int kPieces = kTile / 16;                          // 8 pieces of 16 bytes per column

// Columns of one work unit: a warp's 32 lanes each load 16 bytes of a row.
template <typename T>
constexpr int unit_columns() {
  return 32 * static_cast<int>(16 / sizeof(T));
}

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

// x's elements held as raw 16-byte vectors, w[4] 32-bit words: element e of a vector as float32 (exact), and one
// element's bits (e constant after unrolling, so the words stay in registers).
template <typename T>
__device__ __forceinline__ float element(const uint32_t (&w)[4], int e) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(w[e]);
  } else {
    const uint32_t bits = e % 2 ? w[e / 2] >> 16 : w[e / 2] & 0xffffu;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) return __uint_as_float(bits << 16);
    else return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
}

template <typename To, typename From>
__device__ __forceinline__ To bits_as(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To out;
  memcpy(&out, &v, sizeof(To));
  return out;
}

template <typename T>
__device__ __forceinline__ uint32_t element_bits(T v) {
  if constexpr (std::is_same_v<T, float>) return __float_as_uint(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat16_as_ushort(v);
  else return __half_as_ushort(v);
}

__device__ __forceinline__ uint32_t fp8_pair(float a, float b, float fmax, __nv_fp8_interpretation_t format) {
  const float2 ab = make_float2(fminf(fmax, fmaxf(-fmax, a)), fminf(fmax, fmaxf(-fmax, b)));
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(ab, __NV_SATFINITE, format));  // a in the low byte
}

template <typename T, __nv_fp8_interpretation_t kFormat, bool kVectorLoads>
__global__ void __launch_bounds__(kThreads, 2) quantize_group_columns_kernel(const T* __restrict__ x,
                                                                          const int32_t* __restrict__ group_sizes,
                                                                          uint8_t* __restrict__ q_t,
                                                                          float* __restrict__ scale, int64_t M,
                                                                          int64_t C, int64_t G, int64_t P, float fmax,
                                                                          int64_t steps, int64_t units) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  constexpr int kColumns = unit_columns<T>();
  __shared__ alignas(16) uint8_t packed[kColumns * kTile];  // column c's 128 bytes at c * 128, pieces swizzled
  __shared__ alignas(16) float part_amax[kWarps][kColumns];
  __shared__ alignas(16) float col_inv[kColumns];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int first = warp * kRowsPerWarp;  // this warp's rows of the tile
  const float inv_max = static_cast<float>(1.0 / static_cast<double>(fmax));
  const int64_t begin = units * blockIdx.x / gridDim.x, end = units * (blockIdx.x + 1) / gridDim.x;
  int64_t tile = -1;
  long long row0 = 0;
  int rows = 0;
  for (int64_t u = begin; u < end; ++u) {  // block-uniform: the barriers below are reached by every thread
    if (u / steps != tile) {
      tile = u / steps;
      find_tile_rows(group_sizes, G, M, tile * kTile, &row0, &rows);
    }
    const int64_t col0 = (u % steps) * kColumns;  // the unit's first column
    const int64_t c0 = col0 + lane * kVec;        // this lane's first column
    uint32_t v[kRowsPerWarp][4];  // this lane's 16 bytes of each of the warp's rows
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const T* src = x + (row0 + first + i) * C + c0;
      const bool in_rows = first + i < rows;
      if constexpr (kVectorLoads) {  // C % kVec == 0: a vector is wholly inside or wholly past C
        const uint4 r = in_rows && c0 < C ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
        v[i][0] = r.x, v[i][1] = r.y, v[i][2] = r.z, v[i][3] = r.w;
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) v[i][k] = 0;
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          if (in_rows && c0 + e < C) v[i][e * 4 / kVec] |= element_bits(src[e]) << (32 / kVec * 4 * e % 32);
      }
    }
    float amax[kVec];  // over this warp's rows; NaNs are skipped as fmaxf skips them
    if constexpr (sizeof(T) == 2) {  // in pairs, in x's format: exact, and no float copies of v to keep live
      using Pair = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
      uint32_t m[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        Pair acc = bits_as<Pair>(0u);
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) acc = __hmax2(acc, __habs2(bits_as<Pair>(v[i][k])));
        m[k] = bits_as<uint32_t>(acc);
      }
#pragma unroll
      for (int e = 0; e < kVec; ++e) amax[e] = element<T>(m, e);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        amax[e] = 0.0f;
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) amax[e] = fmaxf(amax[e], fabsf(element<T>(v[i], e)));
      }
    }
#pragma unroll
    for (int e = 0; e < kVec; e += 4)
      *reinterpret_cast<float4*>(&part_amax[warp][lane * kVec + e]) = make_float4(amax[e], amax[e + 1], amax[e + 2],
                                                                                 amax[e + 3]);
    __syncthreads();  // (A) every warp's amax is in part_amax
    for (int c = threadIdx.x; c < kColumns; c += kThreads) {
      float a = part_amax[0][c];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) a = fmaxf(a, part_amax[w][c]);
      const float s = a > 0.0f ? __fmul_rn(a, inv_max) : 1.0f;
      col_inv[c] = __frcp_rn(s);  // 1 / s correctly rounded, as the reference's division
      if (col0 + c < C) scale[tile * C + col0 + c] = s;
    }
    __syncthreads();  // (B) col_inv is complete
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const int c = lane * kVec + e;
      const float inv = col_inv[c];
      uint32_t word[4];  // rows first + 4j .. first + 4j + 3, the first in the low byte
#pragma unroll
      for (int j = 0; j < 4; ++j)
        word[j] = fp8_pair(__fmul_rn(element<T>(v[4 * j], e), inv), __fmul_rn(element<T>(v[4 * j + 1], e), inv),
                           fmax, kFormat) |
                  fp8_pair(__fmul_rn(element<T>(v[4 * j + 2], e), inv), __fmul_rn(element<T>(v[4 * j + 3], e), inv),
                           fmax, kFormat) << 16;
      // Piece `warp` of column c goes to slot warp ^ (lane & 7): the 8 lanes of a store phase hit 8 distinct slots.
      *reinterpret_cast<uint4*>(packed + c * kTile + 16 * (warp ^ (lane & 7))) =
          make_uint4(word[0], word[1], word[2], word[3]);
    }
    __syncthreads();  // (C) the packed tile is complete
    // q_t[c, p0 + 16 * piece ...]: 8 consecutive threads store one column's 128 bytes (P % 128 == 0 and the 16-byte
    // aligned base, checked on the host, keep every piece aligned). No barrier after: the next unit writes packed,
    // part_amax and col_inv only past its own barrier (A), which every thread reaches after these reads.
    const int64_t p0 = tile * kTile;
    for (int k = threadIdx.x; k < kColumns * kPieces; k += kThreads) {
      const int c = k / kPieces, piece = k % kPieces;
      if (col0 + c < C)
        *reinterpret_cast<uint4*>(q_t + (col0 + c) * P + p0 + 16 * piece) =
            *reinterpret_cast<const uint4*>(packed + c * kTile + 16 * (piece ^ ((c / kVec) & 7)));
    }
  }
}

// Blocks of this kernel one SM holds at once (asked once per device and instance), at least 1.
template <typename T, __nv_fp8_interpretation_t kFormat, bool kVectorLoads>
int resident_blocks_per_sm(int device) {
  static int cached[64] = {0};  // 0: not asked yet
  if (device < 0 || device >= 64) return 1;
  if (cached[device] == 0) {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, quantize_group_columns_kernel<T, kFormat, kVectorLoads>,
                                                      kThreads, 0) != cudaSuccess)
      n = 0;
    cached[device] = n > 0 ? n : 1;
  }
  return cached[device];
}

template <typename T, __nv_fp8_interpretation_t kFormat, bool kVectorLoads>
void launch(const T* x, const int32_t* group_sizes, uint8_t* q_t, float* scale, const QuantizeGroupColumnsDims& d,
            cudaStream_t stream) {
  const int64_t steps = ceil_div(d.C, unit_columns<T>());
  const int64_t units = d.P / kGroupColumnsTile * steps;
  int device = 0;
  cudaGetDevice(&device);
  const int64_t resident =
      static_cast<int64_t>(sm_count(device)) * resident_blocks_per_sm<T, kFormat, kVectorLoads>(device);
  const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, min64(units, resident)));
  quantize_group_columns_kernel<T, kFormat, kVectorLoads><<<blocks, kThreads, 0, stream>>>(
      x, group_sizes, q_t, scale, d.M, d.C, d.G, d.P, d.fmax, steps, units);
}

ffi::Error QuantizeGroupColumnsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> group_sizes,
                                    ffi::Result<ffi::AnyBuffer> q_t, ffi::Result<ffi::AnyBuffer> scale) {
  auto dims = check_quantize_group_columns(x, group_sizes, *q_t, *scale);
  if (!dims) return dims.error();
  if (dims->P == 0) return ffi::Error::Success();
  auto* q_p = static_cast<uint8_t*>(q_t->untyped_data());
  auto* s_p = static_cast<float*>(scale->untyped_data());
  if (reinterpret_cast<uintptr_t>(q_p) % 16 != 0)  // XLA's buffers are aligned to at least 16 bytes
    return ffi::Error::InvalidArgument("quantize_group_columns: q_t's buffer must be 16-byte aligned");
  const bool e4m3 = q_t->element_type() == ffi::DataType::F8E4M3FN;
  dispatch_float(x.element_type(), [&](auto tag) {
    using Elem = decltype(tag);
    const auto* x_p = static_cast<const Elem*>(x.untyped_data());
    const bool vector_loads =
        dims->C % (16 / static_cast<int64_t>(sizeof(Elem))) == 0 && reinterpret_cast<uintptr_t>(x_p) % 16 == 0;
    const int32_t* gs = group_sizes.typed_data();
    if (e4m3 && vector_loads) launch<Elem, __NV_E4M3, true>(x_p, gs, q_p, s_p, *dims, stream);
    else if (e4m3) launch<Elem, __NV_E4M3, false>(x_p, gs, q_p, s_p, *dims, stream);
    else if (vector_loads) launch<Elem, __NV_E5M2, true>(x_p, gs, q_p, s_p, *dims, stream);
    else launch<Elem, __NV_E5M2, false>(x_p, gs, q_p, s_p, *dims, stream);
  });
  return last_cuda_error("quantize_group_columns");
}

}  // namespace
}  // namespace turbo_moe

// No scratch, no host synchronisation, every launch on `stream`: command-buffer compatible.
TURBO_MOE_CUDA_HANDLER(turbo_moe_quantize_group_columns, turbo_moe::QuantizeGroupColumnsImpl,
                       turbo_moe::quantize_group_columns_signature);
