// Element conversion of the CPU handlers (kernels compute in float32). No XLA FFI dependency, so
// the per-ISA gemm variants include it too: the functions live in the inline namespace
// TURBO_MOE_ISA (isa.h), one copy per variant.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "isa.h"

namespace turbo_moe {

enum class Dtype { kF32, kBF16, kF16 };

inline namespace TURBO_MOE_ISA {

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}
inline float f16_to_f32(uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}
inline uint16_t f32_to_f16(float f) {
  _Float16 v = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}

// float32 -> an FP8 format with kMantissa mantissa bits and exponent bias kBias (e4m3fn: 3, 7; e5m2: 2, 15), rounded
// to nearest even; |v| <= the format's largest finite value (the caller clips), not NaN.
template <int kMantissa, int kBias>
inline uint8_t f32_to_fp8(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t mag = bits & 0x7fffffffu;
  constexpr float kSubnormalSteps = static_cast<float>(1u << (kBias - 1 + kMantissa));  // per unit
  if (mag < (static_cast<uint32_t>(128 - kBias) << 23)) {  // below the smallest normal: multiples of the subnormal step
    float a;
    std::memcpy(&a, &mag, 4);
    return sign | static_cast<uint8_t>(std::nearbyint(a * kSubnormalSteps));  // exact; ties to even
  }
  // Normal: keep kMantissa of float32's 23 mantissa bits, ties to even (a carry moves into the exponent), rebias.
  constexpr int kShift = 23 - kMantissa;
  const uint32_t rounded = (mag + ((1u << (kShift - 1)) - 1u) + ((mag >> kShift) & 1u)) >> kShift;
  return sign | static_cast<uint8_t>(rounded - (static_cast<uint32_t>(127 - kBias) << kMantissa));
}
inline uint8_t f32_to_e4m3(float v) { return f32_to_fp8<3, 7>(v); }
inline uint8_t f32_to_e5m2(float v) { return f32_to_fp8<2, 15>(v); }

// Converts n contiguous elements of `src` (of dtype `dt`) to float32.
inline void load_f32(Dtype dt, const void* src, int64_t n, float* dst) {
  if (dt == Dtype::kF32) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if (dt == Dtype::kBF16) {
    auto* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  } else {
    auto* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
  }
}
inline float load_one(Dtype dt, const void* src, int64_t i) {
  if (dt == Dtype::kF32) return static_cast<const float*>(src)[i];
  uint16_t h = static_cast<const uint16_t*>(src)[i];
  return dt == Dtype::kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
}
// Converts n float32 values to dtype `dt` into `dst` (dst points at element 0 of the row).
inline void store_f32(Dtype dt, const float* src, int64_t n, void* dst) {
  if (dt == Dtype::kF32) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if (dt == Dtype::kBF16) {
    auto* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
  } else {
    auto* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
  }
}
inline int64_t byte_width(Dtype dt) { return dt == Dtype::kF32 ? 4 : 2; }

}  // namespace TURBO_MOE_ISA
}  // namespace turbo_moe
