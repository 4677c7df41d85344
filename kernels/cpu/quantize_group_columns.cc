// CPU FFI handler turbo_moe_quantize_group_columns (contract: kernels/contracts/quantize_group_columns.h): the FP8
// weight gradient's operand, x's rows quantised per 128x1 tile within each group and written transposed into the
// group-padded layout. Each tile is quantised in float32 exactly as the jnp reference does it (the same products, one
// IEEE division, clip, round to nearest even), so the bytes and scales are bit-identical to it.
#include <cmath>

#include "../contracts/quantize_group_columns.h"
#include "../contracts/registration.h"
#include "common.h"

namespace turbo_moe {
namespace {

constexpr int64_t kColumnChunk = 64;  // columns of one work item: its 128 x 64 float32 tile (32 KB) lives on the stack

// Where a 128-slot tile of the padded layout reads its rows: x rows [row0, row0 + rows), rows <= 128 (0: padding).
struct TileSource {
  int64_t row0 = 0, rows = 0;
};

std::vector<TileSource> tile_sources(const int32_t* sizes, int64_t G, int64_t M, int64_t P) {
  std::vector<TileSource> tiles(P / kGroupColumnsTile);
  const std::vector<int64_t> starts = group_starts(sizes, G, M);
  int64_t tile = 0;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = starts[g]; r < starts[g + 1]; r += kGroupColumnsTile)
      tiles[tile++] = TileSource{r, std::min(kGroupColumnsTile, starts[g + 1] - r)};
  return tiles;
}

template <uint8_t (*kToFp8)(float)>
void quantize_tile(Dtype dt, const char* x, int64_t C, TileSource src, int64_t c0, int64_t width, float fmax,
                   uint8_t* q_t, int64_t P, int64_t p0, float* scale_row) {
  float tile[kGroupColumnsTile][kColumnChunk];  // (rows, columns) in float32
  float amax[kColumnChunk] = {};
  const int64_t w = byte_width(dt);
  for (int64_t i = 0; i < src.rows; ++i) {
    load_f32(dt, x + ((src.row0 + i) * C + c0) * w, width, tile[i]);
    for (int64_t c = 0; c < width; ++c) amax[c] = std::max(amax[c], std::fabs(tile[i][c]));
  }
  const float inv_max = static_cast<float>(1.0 / static_cast<double>(fmax));
  for (int64_t c = 0; c < width; ++c) {
    const float s = amax[c] > 0.0f ? amax[c] * inv_max : 1.0f;
    const float inv = 1.0f / s;
    uint8_t* dst = q_t + (c0 + c) * P + p0;  // q_t[c, p0:p0+128]
    for (int64_t i = 0; i < src.rows; ++i) dst[i] = kToFp8(std::min(fmax, std::max(-fmax, tile[i][c] * inv)));
    std::memset(dst + src.rows, 0, kGroupColumnsTile - src.rows);  // padding rows quantise to +0
    scale_row[c0 + c] = s;
  }
}

ffi::Error QuantizeGroupColumnsImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> group_sizes,
                                    ffi::Result<ffi::AnyBuffer> q_t, ffi::Result<ffi::AnyBuffer> scale) {
  auto dims = check_quantize_group_columns(x, group_sizes, *q_t, *scale);
  if (!dims) return dims.error();
  const int64_t M = dims->M, C = dims->C, G = dims->G, P = dims->P;
  const float fmax = dims->fmax;
  const Dtype dt = dtype_of(x.element_type());
  const std::vector<TileSource> tiles = tile_sources(group_sizes.typed_data(), G, M, P);
  const char* x_p = static_cast<const char*>(x.untyped_data());
  auto* q_p = static_cast<uint8_t*>(q_t->untyped_data());
  auto* s_p = static_cast<float*>(scale->untyped_data());
  auto* quantize = q_t->element_type() == ffi::DataType::F8E4M3FN ? &quantize_tile<f32_to_e4m3>
                                                                   : &quantize_tile<f32_to_e5m2>;
  const int64_t chunks = (C + kColumnChunk - 1) / kColumnChunk;
  parallel_for(&pool, static_cast<int64_t>(tiles.size()) * chunks, [&](int64_t item) {
    const int64_t t = item / chunks, c0 = (item % chunks) * kColumnChunk;
    quantize(dt, x_p, C, tiles[t], c0, std::min(kColumnChunk, C - c0), fmax, q_p, P, t * kGroupColumnsTile,
             s_p + t * C);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CPU_HANDLER(turbo_moe_quantize_group_columns, turbo_moe::QuantizeGroupColumnsImpl,
                      turbo_moe::quantize_group_columns_signature);
