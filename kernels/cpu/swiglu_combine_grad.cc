// CPU FFI handlers of the expert block's SwiGLU backward with its combine weights (turbo_moe/ops/expert_block.py):
//   turbo_moe_swiglu_combine_grad: h (M, 2F) = [gate | up], g (M, F), w (M,) float32, valid () int32 ->
//     d_w[r] = sum_j act[r, j] * g[r, j]                    (float32; act = silu(gate) * up in float32)
//     d_h[r] = SwiGLU's backward at h for d_act = round(w[r] * g[r])   ([d_gate | d_up], rounded once)
//     act_w[r] = round(round(act[r]) * w[r])   (act as grouped_gemm_swiglu's forward rounds it)
//   turbo_moe_swiglu_combine_grad_fp8: the same, and d_h_q, d_h_scale: each d_h row as written, quantised per 1x128
//     tile by row_quantize.h's quantize_row (quantize_rows.cc's step) while it is in cache, so the FP8 data
//     gradient needs no second pass over d_h.
// g is the down GEMM's data gradient of the unweighted output cotangent, w each row's combine weight: d_w is the
// combine weight's gradient, d_h the gate/up output's, act_w the down weight gradient's lhs. One pass reads h and
// g once; as XLA fusions the results read h three times. Rows from `valid` on
// (a worst-case EP tail nothing reads) are not computed: NaN here, unwritten on CUDA. Optional leading dims are
// shared by all operands. Same contract as
// kernels/cuda/swiglu_combine_grad.cu (not bit for bit: exp differs by an ulp between the two libraries).
#include <algorithm>
#include <cmath>
#include <limits>

#include "../contracts/registration.h"
#include "../contracts/swiglu_combine_grad.h"
#include "common.h"
#include "row_quantize.h"

namespace turbo_moe {
namespace {

static_assert(kRowQuantizeTile == kSwigluGradTile);

// d_h's quantised copy, or none (q null): the bf16-only handler.
struct QuantizedDh {
  uint8_t* q = nullptr;  // (rows, 2F) codes
  float* scale = nullptr;  // (rows, 2F/128)
  void (*row)(Dtype, const char*, int64_t, uint8_t*, float*) = nullptr;  // quantize_row<format>
};

void swiglu_combine_grad_rows(ffi::ThreadPool& pool, const SwigluCombineGradDims& dims, ffi::AnyBuffer h,
                              ffi::AnyBuffer g, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> valid,
                              ffi::AnyBuffer d_h, ffi::Buffer<ffi::F32> d_w, ffi::AnyBuffer act_w, QuantizedDh dq) {
  const int64_t rows = dims.rows, M = dims.M, F = dims.F, nb = 2 * F / kRowQuantizeTile;
  const Dtype dt = dtype_of(h.element_type());
  const int64_t bw = byte_width(dt);
  const char* h_p = static_cast<const char*>(h.untyped_data());
  const char* g_p = static_cast<const char*>(g.untyped_data());
  const float* w_p = w.typed_data();
  char* dh_p = static_cast<char*>(d_h.untyped_data());
  float* dw_p = d_w.typed_data();
  char* aw_p = static_cast<char*>(act_w.untyped_data());
  constexpr int64_t kRowsPerItem = 64;
  parallel_for(&pool, (rows + kRowsPerItem - 1) / kRowsPerItem, [&](int64_t item) {
    std::vector<float> hv(2 * F), gv(F), out(2 * F), d_act(F), act(F);
    for (int64_t r = item * kRowsPerItem; r < std::min(rows, (item + 1) * kRowsPerItem); ++r) {
      if (r % M >= valid.typed_data()[r / M]) {  // past the problem's valid rows: NaN, as the promise allows
        dw_p[r] = std::numeric_limits<float>::quiet_NaN();
        std::memset(dh_p + r * 2 * F * bw, tail_fill(false), 2 * F * bw);
        std::memset(aw_p + r * F * bw, tail_fill(false), F * bw);
        if (dq.q) {
          std::memset(dq.q + r * 2 * F, tail_fill(false), 2 * F);
          std::memset(dq.scale + r * nb, tail_fill(false), nb * sizeof(float));
        }
        continue;
      }
      load_f32(dt, h_p + r * 2 * F * bw, 2 * F, hv.data());
      load_f32(dt, g_p + r * F * bw, F, gv.data());
      for (int64_t j = 0; j < F; ++j) d_act[j] = w_p[r] * gv[j];
      store_f32(dt, d_act.data(), F, out.data() + F);  // round d_act to the dtype, as the XLA path does
      load_f32(dt, out.data() + F, F, d_act.data());
      float dw = 0.0f;
      for (int64_t j = 0; j < F; ++j) {
        const float gate = hv[j], up = hv[F + j], e = std::exp(-gate), sig = 1.0f / (1.0f + e);
        dw += gate * sig * up * gv[j];
        act[j] = gate / (1.0f + e) * up;  // as the forward kernel computes it, rounded below
        out[j] = d_act[j] * up * sig * (1.0f + gate * (1.0f - sig));  // d silu(gate) * up / d gate
        out[F + j] = d_act[j] * gate * sig;                          // d / d up = silu(gate)
      }
      dw_p[r] = dw;
      store_f32(dt, out.data(), 2 * F, dh_p + r * 2 * F * bw);
      // the row as rounded and stored, so the codes are quantize_rows(d_h)'s; tiles may span [d_gate | d_up]
      if (dq.q) dq.row(dt, dh_p + r * 2 * F * bw, 2 * F, dq.q + r * 2 * F, dq.scale + r * nb);
      char* aw_row = aw_p + r * F * bw;
      store_f32(dt, act.data(), F, aw_row);  // round act to the dtype, then times w, rounded again
      load_f32(dt, aw_row, F, act.data());
      for (int64_t j = 0; j < F; ++j) act[j] *= w_p[r];
      store_f32(dt, act.data(), F, aw_row);
    }
  });
}

ffi::Error SwigluCombineGradImpl(ffi::ThreadPool pool, ffi::AnyBuffer h, ffi::AnyBuffer g, ffi::Buffer<ffi::F32> w,
                                 ffi::Buffer<ffi::S32> valid, ffi::Result<ffi::AnyBuffer> d_h,
                                 ffi::Result<ffi::Buffer<ffi::F32>> d_w, ffi::Result<ffi::AnyBuffer> act_w) {
  auto dims = check_swiglu_combine_grad(h, g, w, valid, *d_h, *d_w, *act_w);
  if (!dims) return dims.error();
  swiglu_combine_grad_rows(pool, *dims, h, g, w, valid, *d_h, *d_w, *act_w, QuantizedDh{});
  return ffi::Error::Success();
}

ffi::Error SwigluCombineGradFp8Impl(ffi::ThreadPool pool, ffi::AnyBuffer h, ffi::AnyBuffer g,
                                    ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> valid,
                                    ffi::Result<ffi::AnyBuffer> d_h, ffi::Result<ffi::Buffer<ffi::F32>> d_w,
                                    ffi::Result<ffi::AnyBuffer> act_w, ffi::Result<ffi::AnyBuffer> d_h_q,
                                    ffi::Result<ffi::AnyBuffer> d_h_scale) {
  auto dims = check_swiglu_combine_grad_fp8(h, g, w, valid, *d_h, *d_w, *act_w, *d_h_q, *d_h_scale);
  if (!dims) return dims.error();
  const QuantizedDh dq{static_cast<uint8_t*>(d_h_q->untyped_data()), static_cast<float*>(d_h_scale->untyped_data()),
                       dims->e4m3 ? &quantize_row<E4m3Format> : &quantize_row<E5m2Format>};
  swiglu_combine_grad_rows(pool, *dims, h, g, w, valid, *d_h, *d_w, *act_w, dq);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CPU_HANDLER(turbo_moe_swiglu_combine_grad, turbo_moe::SwigluCombineGradImpl,
                      turbo_moe::swiglu_combine_grad_signature);
TURBO_MOE_CPU_HANDLER(turbo_moe_swiglu_combine_grad_fp8, turbo_moe::SwigluCombineGradFp8Impl,
                      turbo_moe::swiglu_combine_grad_fp8_signature);
