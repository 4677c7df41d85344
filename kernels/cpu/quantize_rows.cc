// CPU FFI handler turbo_moe_quantize_rows (contract: kernels/contracts/quantize_rows.h): activations quantised to FP8
// per 1x128 tile, row r of q and scale from row r of x. Each row is quantised by row_quantize.h's quantize_row (the
// step permute_fp8.cc runs on its routed copies), bit-identical to the jnp quantize_rows.
#include "../contracts/quantize_rows.h"
#include "../contracts/registration.h"
#include "common.h"
#include "row_quantize.h"

namespace turbo_moe {
namespace {

static_assert(kRowQuantizeTile == kQuantizeRowsTile);

constexpr int64_t kRowChunk = 64;  // rows of one work item

ffi::Error QuantizeRowsImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                            ffi::Result<ffi::AnyBuffer> scale) {
  auto dims = check_quantize_rows(x, *q, *scale);
  if (!dims) return dims.error();
  const int64_t rows = dims->rows, K = dims->K, nb = K / kQuantizeRowsTile;
  const Dtype dt = dtype_of(x.element_type());
  const int64_t row_bytes = K * byte_width(dt);
  const char* x_p = static_cast<const char*>(x.untyped_data());
  auto* q_p = static_cast<uint8_t*>(q->untyped_data());
  auto* s_p = static_cast<float*>(scale->untyped_data());
  auto* quantize = dims->e4m3 ? &quantize_row<E4m3Format> : &quantize_row<E5m2Format>;
  parallel_for(&pool, (rows + kRowChunk - 1) / kRowChunk, [&](int64_t item) {
    for (int64_t r = item * kRowChunk; r < std::min(rows, (item + 1) * kRowChunk); ++r)
      quantize(dt, x_p + r * row_bytes, K, q_p + r * K, s_p + r * nb);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CPU_HANDLER(turbo_moe_quantize_rows, turbo_moe::QuantizeRowsImpl, turbo_moe::quantize_rows_signature);
