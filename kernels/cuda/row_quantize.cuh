// One warp quantises one row to FP8 per 1x128 tile (DeepSeek-V3's activation scaling), the device step that
// permute_fp8.cu and quantize_rows.cu share. Per 128-wide tile each lane holds 4 values, the warp reduces the tile's
// amax with shuffles, lane 0 writes the scale and every lane its 4 bytes. The arithmetic is the jnp quantiser's in
// IEEE float32 (round-to-nearest products, a correctly rounded reciprocal, the hardware's round-to-nearest-even FP8
// conversion), so the values are bit-identical to it and to the CPU step (kernels/cpu/row_quantize.h). NaN: fmaxf
// skips it in the amax and the clip sends it to -fmax, as the CPU step does.
#pragma once

#include <cuda_fp8.h>

#include "common.cuh"

namespace turbo_moe {

constexpr int kRowQuantizeTile = 128;                       // values per scale
constexpr int kRowQuantizeLaneValues = kRowQuantizeTile / 32;  // 4 values of a tile per lane
constexpr int kRowQuantizeTilesInFlight = 4;  // tiles loaded per lane before the first reduction (latency)

// The format's largest finite value: e4m3fn 448, e5m2 57344.
template <__nv_fp8_interpretation_t kFormat>
__host__ __device__ constexpr float fp8_max() {
  static_assert(kFormat == __NV_E4M3 || kFormat == __NV_E5M2);
  return kFormat == __NV_E4M3 ? 448.0f : 57344.0f;
}

// A lane's 4 values times 1/scale, clipped and converted: 4 codes, value i in byte i.
template <__nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ uint32_t quantize4(const float (&v)[kRowQuantizeLaneValues], float inv) {
  constexpr float fmax = fp8_max<kFormat>();
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < kRowQuantizeLaneValues; ++i) {
    const float c = fminf(fmax, fmaxf(-fmax, __fmul_rn(v[i], inv)));
    packed |= static_cast<uint32_t>(__nv_cvt_float_to_fp8(c, __NV_SATFINITE, kFormat)) << (8 * i);
  }
  return packed;
}

// The calling warp quantises row `src` of H values (H a multiple of 128; XLA's buffers are aligned, so each lane's
// 4 values load as one vector) into dst (H/4 words of 4 codes) and dst_scale (H/128 scales). Every lane calls it.
template <__nv_fp8_interpretation_t kFormat, typename T>
__device__ __forceinline__ void warp_quantize_row(const T* __restrict__ src, int64_t H, uint32_t* __restrict__ dst,
                                                  float* __restrict__ dst_scale, int lane) {
  constexpr int kValues = kRowQuantizeLaneValues, kInFlight = kRowQuantizeTilesInFlight;
  using Vec = Pack<T, kValues>;
  const Vec* vec = reinterpret_cast<const Vec*>(src);
  const int64_t tiles = H / kRowQuantizeTile;
  const float inv_max = static_cast<float>(1.0 / static_cast<double>(fp8_max<kFormat>()));
  for (int64_t t0 = 0; t0 < tiles; t0 += kInFlight) {
    float v[kInFlight][kValues];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j)
      if (t0 + j < tiles) {
        const Vec p = vec[(t0 + j) * 32 + lane];
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
      const float inv = __frcp_rn(s);  // 1 / s correctly rounded, as the jnp quantiser's division
      dst[(t0 + j) * 32 + lane] = quantize4<kFormat>(v[j], inv);
      if (lane == 0) dst_scale[t0 + j] = s;
    }
  }
}

}  // namespace turbo_moe
