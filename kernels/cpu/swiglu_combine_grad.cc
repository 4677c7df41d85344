// CPU FFI handler of the expert block's SwiGLU backward with its combine weights (model/expert_block.py):
//   turbo_moe_swiglu_combine_grad: h (R, 2F) = [gate | up], g (R, F), w (R,) float32 ->
//     d_w[r] = sum_j act[r, j] * g[r, j]                    (float32; act = silu(gate) * up in float32)
//     d_h[r] = SwiGLU's backward at h for d_act = round(w[r] * g[r])   ([d_gate | d_up], rounded once)
// g is the down GEMM's data gradient of the unweighted output cotangent, w each row's combine weight: d_w is the
// combine weight's gradient, d_h the gate/up output's. One pass reads h and g once; as XLA fusions the two read
// both twice (experiments/NOTES.md, issue 14). Optional leading dims are shared by all operands. Same contract as
// kernels/cuda/swiglu_combine_grad.cu (not bit for bit: exp differs by an ulp between the two libraries).
#include <cmath>

#include "common.h"

namespace turbo_moe {
namespace {

ffi::Error SwigluCombineGradImpl(ffi::ThreadPool pool, ffi::AnyBuffer h, ffi::AnyBuffer g, ffi::Buffer<ffi::F32> w,
                                 ffi::Result<ffi::AnyBuffer> d_h, ffi::Result<ffi::Buffer<ffi::F32>> d_w) {
  Dtype dt;
  if (!to_dtype(h.element_type(), &dt) || g.element_type() != h.element_type() ||
      d_h->element_type() != h.element_type())
    return invalid("swiglu_combine_grad: h, g and d_h must share one dtype of float32/bfloat16/float16");
  auto hd = h.dimensions(), gd = g.dimensions(), wd = w.dimensions();
  const int64_t rank = hd.size();
  if (rank < 1 || static_cast<int64_t>(gd.size()) != rank || static_cast<int64_t>(wd.size()) != rank - 1)
    return invalid("swiglu_combine_grad: expected h [..., 2F], g [..., F] and w [...]");
  const int64_t F = gd[rank - 1];
  for (int64_t i = 0; i + 1 < rank; ++i)
    if (gd[i] != hd[i] || wd[i] != hd[i]) return invalid("swiglu_combine_grad: h, g and w must share leading dims");
  if (hd[rank - 1] != 2 * F) return invalid("swiglu_combine_grad: h must be [..., 2F] for g [..., F]");
  const int64_t rows = leading_product(hd, 1), bw = byte_width(dt);
  const char* h_p = static_cast<const char*>(h.untyped_data());
  const char* g_p = static_cast<const char*>(g.untyped_data());
  const float* w_p = w.typed_data();
  char* dh_p = static_cast<char*>(d_h->untyped_data());
  float* dw_p = d_w->typed_data();
  constexpr int64_t kRowsPerItem = 64;
  parallel_for(&pool, (rows + kRowsPerItem - 1) / kRowsPerItem, [&](int64_t item) {
    std::vector<float> hv(2 * F), gv(F), out(2 * F), d_act(F);
    for (int64_t r = item * kRowsPerItem; r < std::min(rows, (item + 1) * kRowsPerItem); ++r) {
      load_f32(dt, h_p + r * 2 * F * bw, 2 * F, hv.data());
      load_f32(dt, g_p + r * F * bw, F, gv.data());
      for (int64_t j = 0; j < F; ++j) d_act[j] = w_p[r] * gv[j];
      store_f32(dt, d_act.data(), F, out.data() + F);  // round d_act to the dtype, as the XLA path does
      load_f32(dt, out.data() + F, F, d_act.data());
      float dw = 0.0f;
      for (int64_t j = 0; j < F; ++j) {
        const float gate = hv[j], up = hv[F + j], sig = 1.0f / (1.0f + std::exp(-gate));
        dw += gate * sig * up * gv[j];
        out[j] = d_act[j] * up * sig * (1.0f + gate * (1.0f - sig));  // d silu(gate) * up / d gate
        out[F + j] = d_act[j] * gate * sig;                          // d / d up = silu(gate)
      }
      dw_p[r] = dw;
      store_f32(dt, out.data(), 2 * F, dh_p + r * 2 * F * bw);
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace turbo_moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(turbo_moe_swiglu_combine_grad, turbo_moe::SwigluCombineGradImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()                 // h [..., 2F]
                                  .Arg<xla::ffi::AnyBuffer>()                 // g [..., F]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()     // w [...]
                                  .Ret<xla::ffi::AnyBuffer>()                 // d_h [..., 2F]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());   // d_w [...]
