// Portable grouped GEMM kernels (any sm_80+ GPU, float32/bfloat16/float16): 64x64 output tiles,
// operands converted to float32 in shared memory, 4x4 outputs per thread, float32 accumulation.
// Each output tile belongs to one group and has one writer with a fixed summation order, so the
// results are deterministic. The Hopper path (grouped_gemm_sm90.cu) is the fast one.
#include "grouped_gemm.h"

namespace turbo_moe {
namespace {

constexpr int kBM = kSimtTileRows, kBN = 64, kBK = 16, kThreads = 256;

struct SmemTiles {
  float a[kBK][kBM + 4];  // a[kk][i]: A(i, kk)
  float b[kBK][kBN + 4];  // b[kk][j]: B(kk, j)
};

// acc[i][j] += sum_kk a[kk][ty*4+i] * b[kk][tx*4+j] over one staged depth slice.
__device__ __forceinline__ void accumulate_tile(const SmemTiles& s, float (&acc)[4][4]) {
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
#pragma unroll
  for (int kk = 0; kk < kBK; ++kk) {
    const float4 av = *reinterpret_cast<const float4*>(&s.a[kk][ty * 4]);
    const float4 bv = *reinterpret_cast<const float4*>(&s.b[kk][tx * 4]);
    const float ar[4] = {av.x, av.y, av.z, av.w}, br[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(ar[i], br[j], acc[i][j]);
  }
}

// Finds the group whose row tiles contain flat tile `t`: the last g with tile_prefix[g] <= t.
__device__ int find_group(const int32_t* tile_prefix, int groups, int t) {
  int lo = 0, hi = groups;  // invariant: tile_prefix[lo] <= t < tile_prefix[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (tile_prefix[mid] <= t) lo = mid; else hi = mid;
  }
  return lo;
}

template <typename TIn, typename TOut, bool kTransposeRhs>
__global__ void __launch_bounds__(kThreads) grouped_gemm_simt_kernel(
    const TIn* __restrict__ lhs, const TIn* __restrict__ rhs, TOut* __restrict__ out,
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ tile_prefix, int64_t M,
    int64_t K, int64_t N, int64_t G) {
  __shared__ SmemTiles s;
  const int64_t b = blockIdx.z;
  offsets += b * (G + 1);
  tile_prefix += b * (G + 1);
  const int tile = blockIdx.x;
  if (tile >= tile_prefix[G]) return;
  const int g = find_group(tile_prefix, static_cast<int>(G), tile);
  const int64_t row0 = offsets[g] + static_cast<int64_t>(tile - tile_prefix[g]) * kBM;
  const int64_t row_end = offsets[g + 1];
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kBN;
  const TIn* a = lhs + b * M * K;
  const TIn* w = rhs + (b * G + g) * K * N;

  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kBK) {
    for (int e = threadIdx.x; e < kBM * kBK; e += kThreads) {
      const int i = e / kBK, kk = e % kBK;
      const int64_t r = row0 + i, k = k0 + kk;
      s.a[kk][i] = (r < row_end && k < K) ? to_f32(a[r * K + k]) : 0.f;
    }
    for (int e = threadIdx.x; e < kBN * kBK; e += kThreads) {
      const int j = kTransposeRhs ? e / kBK : e % kBN, kk = kTransposeRhs ? e % kBK : e / kBN;
      const int64_t n = col0 + j, k = k0 + kk;
      float v = 0.f;
      if (n < N && k < K) v = to_f32(kTransposeRhs ? w[n * K + k] : w[k * N + n]);
      s.b[kk][j] = v;
    }
    __syncthreads();
    accumulate_tile(s, acc);
    __syncthreads();
  }
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  TOut* o = out + b * M * N;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t r = row0 + ty * 4 + i;
    if (r >= row_end) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t n = col0 + tx * 4 + j;
      if (n < N) o[r * N + n] = from_f32<TOut>(acc[i][j]);
    }
  }
}

// dw[g](i, j) = sum over rows r of group g of lhs[r, i] * d_out[r, j]; empty groups give zeros.
template <typename TIn, typename TOut>
__global__ void __launch_bounds__(kThreads) weight_grad_simt_kernel(
    const TIn* __restrict__ lhs, const TIn* __restrict__ d_out, TOut* __restrict__ dw,
    const int32_t* __restrict__ offsets, int64_t M, int64_t K, int64_t N, int64_t G) {
  __shared__ SmemTiles s;
  const int64_t bg = blockIdx.z, b = bg / G, g = bg % G;
  offsets += b * (G + 1);
  const int64_t start = offsets[g], end = offsets[g + 1];
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kBM, j0 = static_cast<int64_t>(blockIdx.y) * kBN;
  const TIn* a = lhs + b * M * K;
  const TIn* d = d_out + b * M * N;

  float acc[4][4] = {};
  for (int64_t r0 = start; r0 < end; r0 += kBK) {
    for (int e = threadIdx.x; e < kBM * kBK; e += kThreads) {
      const int i = e % kBM, rr = e / kBM;
      const int64_t r = r0 + rr, k = i0 + i;
      s.a[rr][i] = (r < end && k < K) ? to_f32(a[r * K + k]) : 0.f;
    }
    for (int e = threadIdx.x; e < kBN * kBK; e += kThreads) {
      const int j = e % kBN, rr = e / kBN;
      const int64_t r = r0 + rr, n = j0 + j;
      s.b[rr][j] = (r < end && n < N) ? to_f32(d[r * N + n]) : 0.f;
    }
    __syncthreads();
    accumulate_tile(s, acc);
    __syncthreads();
  }
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  TOut* o = dw + bg * K * N;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t k = i0 + ty * 4 + i;
    if (k >= K) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t n = j0 + tx * 4 + j;
      if (n < N) o[k * N + n] = from_f32<TOut>(acc[i][j]);
    }
  }
}

}  // namespace

ffi::Error launch_grouped_gemm_simt(const GroupedGemmArgs& a, cudaStream_t stream) {
  if (a.M == 0 || a.N == 0 || a.batch == 0) return ffi::Error::Success();
  const int64_t max_tiles = ceil_div(a.M, kBM) + a.G;
  if (max_tiles > 0x7fffffff || ceil_div(a.N, kBN) > 65535 || a.batch > 65535)
    return invalid("grouped_gemm: problem too large for the portable CUDA kernel");
  dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>(ceil_div(a.N, kBN)),
            static_cast<unsigned>(a.batch));
  bool launched = false;
  dispatch_float(a.in_type, [&](auto in_tag) {
    using TIn = decltype(in_tag);
    dispatch_float(a.out_type, [&](auto out_tag) {
      using TOut = decltype(out_tag);
      auto* lhs = static_cast<const TIn*>(a.lhs);
      auto* rhs = static_cast<const TIn*>(a.rhs);
      auto* out = static_cast<TOut*>(a.out);
      if (a.transpose_rhs)
        grouped_gemm_simt_kernel<TIn, TOut, true><<<grid, kThreads, 0, stream>>>(
            lhs, rhs, out, a.offsets, a.tile_prefix, a.M, a.K, a.N, a.G);
      else
        grouped_gemm_simt_kernel<TIn, TOut, false><<<grid, kThreads, 0, stream>>>(
            lhs, rhs, out, a.offsets, a.tile_prefix, a.M, a.K, a.N, a.G);
      launched = true;
    });
  });
  if (!launched) return invalid("grouped_gemm: dtypes must be float32/bfloat16/float16");
  return last_cuda_error("grouped_gemm (portable kernel)");
}

ffi::Error launch_weight_grad_simt(const GroupedGemmArgs& a, cudaStream_t stream) {
  if (a.K == 0 || a.N == 0 || a.G == 0 || a.batch == 0) return ffi::Error::Success();
  if (ceil_div(a.N, kBN) > 65535 || a.batch * a.G > 65535)
    return invalid("grouped_gemm_weight_grad: problem too large for the portable CUDA kernel");
  dim3 grid(static_cast<unsigned>(ceil_div(a.K, kBM)), static_cast<unsigned>(ceil_div(a.N, kBN)),
            static_cast<unsigned>(a.batch * a.G));
  bool launched = false;
  dispatch_float(a.in_type, [&](auto in_tag) {
    using TIn = decltype(in_tag);
    dispatch_float(a.out_type, [&](auto out_tag) {
      using TOut = decltype(out_tag);
      weight_grad_simt_kernel<TIn, TOut><<<grid, kThreads, 0, stream>>>(
          static_cast<const TIn*>(a.lhs), static_cast<const TIn*>(a.rhs), static_cast<TOut*>(a.out),
          a.offsets, a.M, a.K, a.N, a.G);
      launched = true;
    });
  });
  if (!launched) return invalid("grouped_gemm_weight_grad: dtypes must be float32/bfloat16/float16");
  return last_cuda_error("grouped_gemm_weight_grad (portable kernel)");
}

}  // namespace turbo_moe
