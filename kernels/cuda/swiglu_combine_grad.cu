// CUDA FFI handler of the expert block's SwiGLU backward with its combine weights (turbo_moe/ops/expert_block.py):
//   turbo_moe_swiglu_combine_grad: h (M, 2F) = [gate | up], g (M, F), w (M,) float32, valid () int32 ->
//     d_w[r] = sum_j act[r, j] * g[r, j]                    (float32; act = silu(gate) * up in float32)
//     d_h[r] = SwiGLU's backward at h for d_act = round(w[r] * g[r])   ([d_gate | d_up], rounded once)
//     act_w[r] = round(round(act[r]) * w[r])   (act as grouped_gemm_swiglu's forward rounds it: the down weight
//                                               gradient's lhs, which an XLA pass over h computed again before)
// Rows from `valid` on (the expert block's worst-case EP tail, which nothing reads) are skipped, outputs unwritten.
// One warp per row: h and g are read once, d_h and act_w written once, d_w a fixed-order warp reduction
// (deterministic). As XLA fusions the results read h three times. Same contract as
// kernels/cpu/swiglu_combine_grad.cc. No scratch, no host sync: safe in XLA's command buffers.
#include "../contracts/registration.h"
#include "../contracts/swiglu_combine_grad.h"
#include "common.cuh"

namespace turbo_moe {
namespace {

constexpr int kThreads = 256;

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) swiglu_combine_grad_kernel(const T* __restrict__ h,
                                                                        const T* __restrict__ g,
                                                                        const float* __restrict__ w,
                                                                        T* __restrict__ d_h,
                                                                        float* __restrict__ d_w,
                                                                        T* __restrict__ act_w, int64_t rows,
                                                                        int64_t F, const int32_t* __restrict__ valid,
                                                                        int64_t M) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;  // whole warps: a row per warp
  if (r % M >= valid[r / M]) return;  // past the problem's valid rows (a worst-case EP tail): left unwritten
  const int64_t packs = F / V;
  const Pack<T, V>* hv = reinterpret_cast<const Pack<T, V>*>(h + r * 2 * F);
  const Pack<T, V>* gv = reinterpret_cast<const Pack<T, V>*>(g + r * F);
  Pack<T, V>* dv = reinterpret_cast<Pack<T, V>*>(d_h + r * 2 * F);
  Pack<T, V>* av = reinterpret_cast<Pack<T, V>*>(act_w + r * F);
  const float wr = w[r];
  float dw = 0.0f;
  for (int64_t p = lane; p < packs; p += 32) {
    const Pack<T, V> gate = hv[p], up = hv[packs + p], gp = gv[p];
    Pack<T, V> d_gate, d_up, aw;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float a = to_f32(gate.v[i]), u = to_f32(up.v[i]), gi = to_f32(gp.v[i]);
      const float e = expf(-a), sig = 1.0f / (1.0f + e);
      const float d_act = to_f32(from_f32<T>(wr * gi));  // rounded to the dtype, as the XLA path does
      dw += a * sig * u * gi;
      d_gate.v[i] = from_f32<T>(d_act * u * sig * (1.0f + a * (1.0f - sig)));
      d_up.v[i] = from_f32<T>(d_act * a * sig);
      aw.v[i] = from_f32<T>(to_f32(from_f32<T>(a / (1.0f + e) * u)) * wr);  // the forward kernel's act, times w
    }
    dv[p] = d_gate;
    dv[packs + p] = d_up;
    av[p] = aw;
  }
  for (int d = 16; d > 0; d >>= 1) dw += __shfl_xor_sync(0xffffffffu, dw, d);
  if (lane == 0) d_w[r] = dw;
}

template <typename T, int V>
void launch(const void* h, const void* g, const float* w, void* d_h, float* d_w, void* act_w, int64_t rows,
            int64_t F, const int32_t* valid, int64_t M, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(ceil_div(rows, kThreads / 32));
  swiglu_combine_grad_kernel<T, V><<<blocks, kThreads, 0, stream>>>(
      static_cast<const T*>(h), static_cast<const T*>(g), w, static_cast<T*>(d_h), d_w, static_cast<T*>(act_w),
      rows, F, valid, M);
}

ffi::Error SwigluCombineGradImpl(cudaStream_t stream, ffi::AnyBuffer h, ffi::AnyBuffer g, ffi::Buffer<ffi::F32> w,
                                 ffi::Buffer<ffi::S32> valid, ffi::Result<ffi::AnyBuffer> d_h,
                                 ffi::Result<ffi::Buffer<ffi::F32>> d_w, ffi::Result<ffi::AnyBuffer> act_w) {
  auto dims = check_swiglu_combine_grad(h, g, w, valid, *d_h, *d_w, *act_w);
  if (!dims) return dims.error();
  const int64_t rows = dims->rows, M = dims->M, F = dims->F;
  if (rows == 0) return ffi::Error::Success();
  const void *h_p = h.untyped_data(), *g_p = g.untyped_data();
  void *dh_p = d_h->untyped_data(), *aw_p = act_w->untyped_data();
  // 16-byte packs when every row of h, g, d_h and act_w starts on a 16-byte boundary (F a multiple of the width).
  const bool aligned = reinterpret_cast<uintptr_t>(h_p) % 16 == 0 && reinterpret_cast<uintptr_t>(g_p) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(dh_p) % 16 == 0 && reinterpret_cast<uintptr_t>(aw_p) % 16 == 0;
  dispatch_float(h.element_type(), [&](auto zero) {
    using T = decltype(zero);
    constexpr int kWide = 16 / sizeof(T);
    if (aligned && F % kWide == 0)
      launch<T, kWide>(h_p, g_p, w.typed_data(), dh_p, d_w->typed_data(), aw_p, rows, F, valid.typed_data(), M,
                       stream);
    else
      launch<T, 1>(h_p, g_p, w.typed_data(), dh_p, d_w->typed_data(), aw_p, rows, F, valid.typed_data(), M, stream);
  });
  return last_cuda_error("swiglu_combine_grad");
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CUDA_HANDLER(turbo_moe_swiglu_combine_grad, turbo_moe::SwigluCombineGradImpl,
                       turbo_moe::swiglu_combine_grad_signature);
