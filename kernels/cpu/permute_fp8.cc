// CPU FFI handler turbo_moe_permute_fp8 (contract: kernels/contracts/permute_fp8.h): permute_rows' copy step writing
// FP8 E4M3 rows with their 1x128 scales, x[t] -> q[row_index[t, j]], scale[row_index[t, j]]. Each 128-wide tile is
// quantised in float32 exactly as the jnp quantiser does it (the same products, one IEEE division), so the values are
// bit-identical to quantize_rows of permute's bf16 rows.
#include <cmath>

#include "../contracts/permute_fp8.h"
#include "../contracts/registration.h"
#include "common.h"

namespace turbo_moe {
namespace {

// One row of H values (dtype dt) -> H e4m3 bytes and H/128 scales.
void quantize_row(Dtype dt, const char* src, int64_t H, uint8_t* q, float* scale) {
  float tile[kPermuteFp8Tile];
  const float inv_max = static_cast<float>(1.0 / static_cast<double>(kE4m3Max));
  const int64_t w = byte_width(dt);
  for (int64_t b = 0; b < H / kPermuteFp8Tile; ++b) {
    load_f32(dt, src + b * kPermuteFp8Tile * w, kPermuteFp8Tile, tile);
    float amax = 0.0f;
    for (float v : tile) amax = std::max(amax, std::fabs(v));
    const float s = amax > 0.0f ? amax * inv_max : 1.0f;
    const float inv = 1.0f / s;
    for (int64_t i = 0; i < kPermuteFp8Tile; ++i)
      q[b * kPermuteFp8Tile + i] = f32_to_e4m3(std::min(kE4m3Max, std::max(-kE4m3Max, tile[i] * inv)));
    scale[b] = s;
  }
}

ffi::Error PermuteFp8Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> row_index,
                          ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> q,
                          ffi::Result<ffi::AnyBuffer> scale, bool zero_tail) {
  auto dims = check_permute_fp8(x, row_index, group_sizes, *q, *scale);
  if (!dims) return dims.error();
  const int64_t batch = dims->batch, T = dims->T, H = dims->H, k = dims->k, E = dims->E, slots = dims->slots;
  const int64_t nb = H / kPermuteFp8Tile;
  const Dtype dt = dtype_of(x.element_type());
  const int64_t row_bytes = H * byte_width(dt);
  const char* x_p = static_cast<const char*>(x.untyped_data());
  const int32_t* row_p = row_index.typed_data();
  uint8_t* q_p = static_cast<uint8_t*>(q->untyped_data());
  float* s_p = static_cast<float*>(scale->untyped_data());

  for_each_routed_copy(&pool, row_p, batch, T, k, /*chunk=*/64, [&](int64_t b, int64_t t, int64_t r) {
    quantize_row(dt, x_p + (b * T + t) * row_bytes, H, q_p + (b * slots + r) * H, s_p + (b * slots + r) * nb);
  });
  for (int64_t b = 0; b < batch; ++b) {
    int64_t total = 0;
    for (int64_t e = 0; e < E; ++e) total += std::max<int32_t>(group_sizes.typed_data()[b * E + e], 0);
    const int64_t begin = std::min(total, slots);
    std::memset(q_p + (b * slots + begin) * H, tail_fill(zero_tail), (slots - begin) * H);
    float* tail_scale = s_p + (b * slots + begin) * nb;
    if (zero_tail)
      std::fill(tail_scale, tail_scale + (slots - begin) * nb, 1.0f);  // a zero tile's scale
    else
      std::memset(tail_scale, tail_fill(false), (slots - begin) * nb * sizeof(float));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CPU_HANDLER(turbo_moe_permute_fp8, turbo_moe::PermuteFp8Impl, turbo_moe::permute_fp8_signature);
