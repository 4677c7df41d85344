// CPU FFI handler turbo_moe_swiglu_quantize (contract: kernels/contracts/swiglu_quantize.h): the FP8 expert block's
// SwiGLU written in FP8, h (..., M, 2F) = [gate | up] -> act's codes (..., M, F) and 1x128 scales (..., M, F/128).
// Per row: act = gate / (1 + exp(-gate)) * up in float32 (grouped_gemm_swiglu.cc's formula), rounded to h's dtype,
// then row_quantize.h's quantize_row (quantize_rows.cc's step), so the result is quantize_rows of that rounded act
// bit for bit. Rows from valid on (the expert block's tail nothing reads) are 0xFF: NaN codes and NaN scales, as
// permute_fp8.cc and swiglu_combine_grad.cc poison such rows, so a reader that breaks the promise shows NaN here.
#include <cmath>
#include <vector>

#include "../contracts/registration.h"
#include "../contracts/swiglu_quantize.h"
#include "common.h"
#include "row_quantize.h"

namespace turbo_moe {
namespace {

static_assert(kRowQuantizeTile == kSwigluQuantizeTile);

constexpr int64_t kRowChunk = 64;  // rows of one work item

ffi::Error SwigluQuantizeImpl(ffi::ThreadPool pool, ffi::AnyBuffer h, ffi::Buffer<ffi::S32> valid,
                              ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> scale) {
  auto dims = check_swiglu_quantize(h, valid, *q, *scale);
  if (!dims) return dims.error();
  const int64_t rows = dims->rows, M = dims->M, F = dims->F, nb = F / kSwigluQuantizeTile;
  const Dtype dt = dtype_of(h.element_type());
  const int64_t bw = byte_width(dt);
  const char* h_p = static_cast<const char*>(h.untyped_data());
  const int32_t* valid_p = valid.typed_data();
  auto* q_p = static_cast<uint8_t*>(q->untyped_data());
  auto* s_p = static_cast<float*>(scale->untyped_data());
  auto* quantize = dims->e4m3 ? &quantize_row<E4m3Format> : &quantize_row<E5m2Format>;
  parallel_for(&pool, (rows + kRowChunk - 1) / kRowChunk, [&](int64_t item) {
    std::vector<float> hv(2 * F), act(F);
    std::vector<char> rounded(F * bw);  // act in h's dtype: the row quantize_rows would read
    for (int64_t r = item * kRowChunk; r < std::min(rows, (item + 1) * kRowChunk); ++r) {
      if (r % M >= valid_p[r / M]) {  // past the problem's valid rows: poisoned, as the promise allows
        std::memset(q_p + r * F, tail_fill(false), F);
        std::memset(s_p + r * nb, tail_fill(false), nb * sizeof(float));
        continue;
      }
      load_f32(dt, h_p + r * 2 * F * bw, 2 * F, hv.data());
      for (int64_t j = 0; j < F; ++j) {
        const float g = hv[j];
        act[j] = g / (1.0f + std::exp(-g)) * hv[F + j];
      }
      store_f32(dt, act.data(), F, rounded.data());
      quantize(dt, rounded.data(), F, q_p + r * F, s_p + r * nb);
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CPU_HANDLER(turbo_moe_swiglu_quantize, turbo_moe::SwigluQuantizeImpl,
                      turbo_moe::swiglu_quantize_signature);
