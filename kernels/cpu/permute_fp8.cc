// CPU FFI handler turbo_moe_permute_fp8 (contract: kernels/contracts/permute_fp8.h): permute_rows' copy step writing
// FP8 E4M3 rows with their 1x128 scales, x[t] -> q[row_index[t, j]], scale[row_index[t, j]]. Each row is quantised by
// row_quantize.h's quantize_row (quantize_rows.cc's too), bit-identical to the jnp quantize_rows of permute's rows.
#include "../contracts/permute_fp8.h"
#include "../contracts/registration.h"
#include "common.h"
#include "row_quantize.h"

namespace turbo_moe {
namespace {

static_assert(kRowQuantizeTile == kPermuteFp8Tile && E4m3Format::kMax == kE4m3Max);

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
    quantize_row<E4m3Format>(dt, x_p + (b * T + t) * row_bytes, H, q_p + (b * slots + r) * H,
                             s_p + (b * slots + r) * nb);
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
