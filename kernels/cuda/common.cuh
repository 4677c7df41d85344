// Shared pieces of the CUDA FFI handlers: element conversion, dtype dispatch, CUDA error checks (the argument
// checks: kernels/contracts) and the device-side group layout (no host sync anywhere).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "../contracts/contract.h"
#include "xla/ffi/api/ffi.h"

namespace turbo_moe {

namespace ffi = xla::ffi;

// ---- element conversion (kernels accumulate in float32) ----------------------------------------
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

inline int64_t byte_width(ffi::DataType t) { return t == ffi::DataType::F32 ? 4 : 2; }

// Calls fn(T{}) with T the CUDA element type of `t` (F32/BF16/F16); false for other dtypes.
template <typename Fn>
bool dispatch_float(ffi::DataType t, Fn&& fn) {
  switch (t) {
    case ffi::DataType::F32: fn(float{}); return true;
    case ffi::DataType::BF16: fn(__nv_bfloat16{}); return true;
    case ffi::DataType::F16: fn(__half{}); return true;
    default: return false;
  }
}

// ---- errors ------------------------------------------------------------------------------------
inline ffi::Error last_cuda_error(const char* where) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string(where) + ": " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// A device attribute, asked once per device (the answer cannot change in a process); 0 when the query fails.
template <cudaDeviceAttr kAttr>
inline int device_attribute(int device) {
  static int cached[64] = {0};  // 0: not asked yet, else the answer + 1
  if (device < 0 || device >= 64) return 0;
  if (cached[device] == 0) {
    int value = 0;
    if (cudaDeviceGetAttribute(&value, kAttr, device) != cudaSuccess) value = 0;
    cached[device] = value + 1;
  }
  return cached[device] - 1;
}

inline int sm_count(int device) {
  const int n = device_attribute<cudaDevAttrMultiProcessorCount>(device);
  return n > 0 ? n : 132;
}

inline int compute_capability_major(int device) {
  const int major = device_attribute<cudaDevAttrComputeCapabilityMajor>(device);
  return major > 0 ? major : -1;
}

// V elements of T loaded or stored as one vector (16 bytes at most: V * sizeof(T) <= 16).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// ---- workspace ---------------------------------------------------------------------------------
// Bump allocator over a call's workspace result (256-byte aligned pieces).
struct ScratchArena {
  char* base = nullptr;
  size_t used = 0, size = 0;
  template <typename T>
  T* take(size_t count) {
    used = (used + 255) & ~size_t(255);
    T* p = reinterpret_cast<T*>(base + used);
    used += count * sizeof(T);
    return p;
  }
};

// ---- group layout (device) ---------------------------------------------------------------------
// offsets[b*(G+1) + g] = first row of group g of batch b, clamped: negative sizes count as 0 and
// the cumulative layout never passes `rows`; offsets[.. + G] = rows that belong to some group.
// tile_prefix (optional) = exclusive prefix of ceil(size_g / tile_rows), for kernels that map a
// flat block index to (group, row tile).
void launch_group_offsets(const int32_t* sizes, int64_t batch, int64_t groups, int64_t rows,
                          int32_t* offsets, int32_t* tile_prefix, int tile_rows, cudaStream_t stream);

// Zeroes bytes [row_begin*row_bytes, rows*row_bytes) of each batch's (rows, row_bytes) block,
// where row_begin = row_begin_table[b * table_stride] is read on the device.
void launch_zero_tail_rows(void* data, int64_t batch, int64_t rows, int64_t row_bytes,
                           const int32_t* row_begin_table, int64_t table_stride, cudaStream_t stream);

}  // namespace turbo_moe
