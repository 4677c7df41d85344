// One row quantised to FP8 per 1x128 tile (DeepSeek-V3's activation scaling), the CPU step that permute_fp8.cc and
// quantize_rows.cc share. The arithmetic is the jnp quantiser's in float32 (turbo_moe/ops/fp8_scaling.py): the
// scale amax * (1/fmax), one IEEE division for 1/scale, the products x * (1/scale), clip, round to nearest even.
// NaN: std::max skips it in the amax and the clip sends it to -fmax (the CUDA step, row_quantize.cuh, does the same).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "convert.h"

namespace turbo_moe {

constexpr int64_t kRowQuantizeTile = 128;  // values per scale

// The FP8 formats: the largest finite value and the float32 -> code conversion.
struct E4m3Format {
  static constexpr float kMax = 448.0f;
  static uint8_t code(float v) { return f32_to_e4m3(v); }
};
struct E5m2Format {
  static constexpr float kMax = 57344.0f;
  static uint8_t code(float v) { return f32_to_e5m2(v); }
};

// One row of H values (dtype dt, H a multiple of 128) -> H codes and H/128 scales.
template <typename Format>
void quantize_row(Dtype dt, const char* src, int64_t H, uint8_t* q, float* scale) {
  constexpr float fmax = Format::kMax;
  const float inv_max = static_cast<float>(1.0 / static_cast<double>(fmax));
  float tile[kRowQuantizeTile];
  const int64_t w = byte_width(dt);
  for (int64_t b = 0; b < H / kRowQuantizeTile; ++b) {
    load_f32(dt, src + b * kRowQuantizeTile * w, kRowQuantizeTile, tile);
    float amax = 0.0f;
    for (float v : tile) amax = std::max(amax, std::fabs(v));
    const float s = amax > 0.0f ? amax * inv_max : 1.0f;
    const float inv = 1.0f / s;
    for (int64_t i = 0; i < kRowQuantizeTile; ++i)
      q[b * kRowQuantizeTile + i] = Format::code(std::min(fmax, std::max(-fmax, tile[i] * inv)));
    scale[b] = s;
  }
}

}  // namespace turbo_moe
