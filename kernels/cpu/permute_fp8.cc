// CPU FFI handlers (contract: kernels/contracts/permute_fp8.h) of permute_rows' copy step writing FP8 rows with their
// 1x128 scales:
//   turbo_moe_permute_fp8:      x[t] -> q[row_index[t, j]], scale[row_index[t, j]] (E4M3), the forward's lhs;
//   turbo_moe_permute_rows_fp8: x[t] -> rows[row_index[t, j]] as permute_rows writes it, and its q and scale (E4M3 or
//                               E5M2), the backward's d_y rows in bf16 and FP8 from one read of x.
// Each row is quantised by row_quantize.h's quantize_row (quantize_rows.cc's too), bit-identical to the jnp
// quantize_rows of permute's rows.
#include "../contracts/permute_fp8.h"
#include "../contracts/registration.h"
#include "common.h"
#include "row_quantize.h"

namespace turbo_moe {
namespace {

static_assert(kRowQuantizeTile == kPermuteFp8Tile && E4m3Format::kMax == kE4m3Max);

// Rows from sum(group_sizes[b]) on: q 0 and scale 1 (a zero row's quantisation), NaN where !zero_tail (tail_fill);
// `rows` (nullable) 0 / NaN like permute_rows' tail.
void fill_tail(const int32_t* group_sizes, const PermuteFp8Dims& d, char* rows, int64_t row_bytes, uint8_t* q,
               float* scale, bool zero_tail) {
  const int64_t nb = d.H / kPermuteFp8Tile;
  for (int64_t b = 0; b < d.batch; ++b) {
    int64_t total = 0;
    for (int64_t e = 0; e < d.E; ++e) total += std::max<int32_t>(group_sizes[b * d.E + e], 0);
    const int64_t begin = b * d.slots + std::min(total, d.slots), end = (b + 1) * d.slots;
    if (rows) std::memset(rows + begin * row_bytes, tail_fill(zero_tail), (end - begin) * row_bytes);
    std::memset(q + begin * d.H, tail_fill(zero_tail), (end - begin) * d.H);
    if (zero_tail)
      std::fill(scale + begin * nb, scale + end * nb, 1.0f);  // a zero tile's scale
    else
      std::memset(scale + begin * nb, tail_fill(false), (end - begin) * nb * sizeof(float));
  }
}

ffi::Error PermuteFp8Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> row_index,
                          ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> q,
                          ffi::Result<ffi::AnyBuffer> scale, bool zero_tail) {
  auto dims = check_permute_fp8(x, row_index, group_sizes, *q, *scale);
  if (!dims) return dims.error();
  const int64_t T = dims->T, H = dims->H, slots = dims->slots, nb = H / kPermuteFp8Tile;
  const Dtype dt = dtype_of(x.element_type());
  const int64_t row_bytes = H * byte_width(dt);
  const char* x_p = static_cast<const char*>(x.untyped_data());
  uint8_t* q_p = static_cast<uint8_t*>(q->untyped_data());
  float* s_p = static_cast<float*>(scale->untyped_data());

  for_each_routed_copy(&pool, row_index.typed_data(), dims->batch, T, dims->k, /*chunk=*/64,
                       [&](int64_t b, int64_t t, int64_t r) {
    quantize_row<E4m3Format>(dt, x_p + (b * T + t) * row_bytes, H, q_p + (b * slots + r) * H,
                             s_p + (b * slots + r) * nb);
  });
  fill_tail(group_sizes.typed_data(), *dims, /*rows=*/nullptr, row_bytes, q_p, s_p, zero_tail);
  return ffi::Error::Success();
}

ffi::Error PermuteRowsFp8Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> row_index,
                              ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> rows,
                              ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> scale, bool zero_tail) {
  auto dims = check_permute_rows_fp8(x, row_index, group_sizes, *rows, *q, *scale);
  if (!dims) return dims.error();
  const int64_t T = dims->T, H = dims->H, slots = dims->slots, nb = H / kPermuteFp8Tile;
  const Dtype dt = dtype_of(x.element_type());
  const int64_t row_bytes = H * byte_width(dt);
  const char* x_p = static_cast<const char*>(x.untyped_data());
  char* rows_p = static_cast<char*>(rows->untyped_data());
  uint8_t* q_p = static_cast<uint8_t*>(q->untyped_data());
  float* s_p = static_cast<float*>(scale->untyped_data());
  auto* quantize = dims->e4m3 ? &quantize_row<E4m3Format> : &quantize_row<E5m2Format>;

  for_each_routed_copy(&pool, row_index.typed_data(), dims->batch, T, dims->k, /*chunk=*/64,
                       [&](int64_t b, int64_t t, int64_t r) {
    const char* src = x_p + (b * T + t) * row_bytes;
    std::memcpy(rows_p + (b * slots + r) * row_bytes, src, row_bytes);
    quantize(dt, src, H, q_p + (b * slots + r) * H, s_p + (b * slots + r) * nb);
  });
  fill_tail(group_sizes.typed_data(), *dims, rows_p, row_bytes, q_p, s_p, zero_tail);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CPU_HANDLER(turbo_moe_permute_fp8, turbo_moe::PermuteFp8Impl, turbo_moe::permute_fp8_signature);

TURBO_MOE_CPU_HANDLER(turbo_moe_permute_rows_fp8, turbo_moe::PermuteRowsFp8Impl,
                      turbo_moe::permute_rows_fp8_signature);
