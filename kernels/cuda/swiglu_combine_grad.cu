// CUDA FFI handlers of the expert block's SwiGLU backward with its combine weights (turbo_moe/ops/expert_block.py):
//   turbo_moe_swiglu_combine_grad: h (M, 2F) = [gate | up], g (M, F), w (M,) float32, valid () int32 ->
//     d_w[r] = sum_j act[r, j] * g[r, j]                    (float32; act = silu(gate) * up in float32)
//     d_h[r] = SwiGLU's backward at h for d_act = round(w[r] * g[r])   ([d_gate | d_up], rounded once)
//     act_w[r] = round(round(act[r]) * w[r])   (act as grouped_gemm_swiglu's forward rounds it: the down weight
//                                               gradient's lhs, which an XLA pass over h computed again before)
//   turbo_moe_swiglu_combine_grad_fp8: the same, and d_h quantised to FP8 per 1x128 tile (d_h_q, d_h_scale) as it is
//     written, so the FP8 data gradient needs no quantize_rows pass that reads d_h again.
// Rows from `valid` on (the expert block's worst-case EP tail, which nothing reads) are skipped, outputs unwritten.
// One warp per row: h and g are read once, d_h and act_w written once, d_w a fixed-order warp reduction
// (deterministic). As XLA fusions the results read h three times. Both targets run one kernel (a template flag):
// the same arithmetic and summation order, so their shared outputs agree bit for bit. Same contract as
// kernels/cpu/swiglu_combine_grad.cc. No scratch, no host sync: safe in XLA's command buffers.
#include "../contracts/registration.h"
#include "../contracts/swiglu_combine_grad.h"
#include "common.cuh"
#include "row_quantize.cuh"

namespace turbo_moe {
namespace {

static_assert(kRowQuantizeTile == kSwigluGradTile);

constexpr int kThreads = 256;
constexpr int kTile = kRowQuantizeTile;

// One pack of V columns j of a row: SwiGLU's backward, act * w, and the row's d_w terms added to dw.
template <typename T, int V>
__device__ __forceinline__ void swiglu_grad_pack(const Pack<T, V>& gate, const Pack<T, V>& up, const Pack<T, V>& gp,
                                                 float wr, float& dw, Pack<T, V>& d_gate, Pack<T, V>& d_up,
                                                 Pack<T, V>& aw) {
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
}

// One warp's d_h values held in shared memory until their 128-wide tile is whole, then quantised by row_quantize.cuh's
// warp step (quantize_rows.cu's), so the codes are quantize_rows(d_h)'s. A loop step covers kChunk columns j of
// d_gate (d_h columns j) and of d_up (F + j): a tile may take several steps (V = 1), span two (d_up's tiles when
// F % 128 == 64) or both halves (d_h columns [F - 64, F + 64), kept aside until the last step).
template <typename T, int V>
struct TileStaging {
  static constexpr int kChunk = 32 * V;
  static constexpr int kGate = kChunk > kTile ? kChunk : kTile;  // d_gate by column mod kGate
  // d_up by d_h column mod kUp: room for a partial tile and one step's columns
  static constexpr int kUp = (kChunk + 2 * kTile - 1) / kTile * kTile;
  alignas(16) T gate[kGate];
  alignas(16) T up[kUp];
  alignas(16) T straddle[kTile];  // d_gate's last 64 columns, then d_up's first 64 (F % 128 == 64 only)
};

template <typename T, int V, bool kQuant, __nv_fp8_interpretation_t kFormat>
__global__ void __launch_bounds__(kThreads) swiglu_combine_grad_kernel(const T* __restrict__ h,
                                                                        const T* __restrict__ g,
                                                                        const float* __restrict__ w,
                                                                        T* __restrict__ d_h,
                                                                        float* __restrict__ d_w,
                                                                        T* __restrict__ act_w, int64_t rows,
                                                                        int64_t F, const int32_t* __restrict__ valid,
                                                                        int64_t M, uint32_t* __restrict__ d_h_q,
                                                                        float* __restrict__ d_h_scale) {
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
  // pack p of the row: read h and g, write d_h and act_w (d_gate, d_up also kept for the FP8 staging)
  auto step = [&](int64_t p, Pack<T, V>& d_gate, Pack<T, V>& d_up) {
    const Pack<T, V> gate = hv[p], up = hv[packs + p], gp = gv[p];
    Pack<T, V> aw;
    swiglu_grad_pack(gate, up, gp, wr, dw, d_gate, d_up, aw);
    dv[p] = d_gate;
    dv[packs + p] = d_up;
    av[p] = aw;
  };
  if constexpr (!kQuant) {
    for (int64_t p = lane; p < packs; p += 32) {
      Pack<T, V> d_gate, d_up;
      step(p, d_gate, d_up);
    }
  } else {  // the same steps, warp-uniform (the tile step needs every lane), each followed by its whole tiles
    using Staging = TileStaging<T, V>;
    __shared__ Staging staging[kThreads / 32];
    Staging& st = staging[threadIdx.x / 32];
    uint32_t* q_row = d_h_q + r * (2 * F / 4);  // 4 codes a word
    float* scale_row = d_h_scale + r * (2 * F / kTile);
    const int64_t s = F % kTile;  // 0, or 64: d_h's tile (F - 64) / 128 spans [d_gate | d_up]
    auto emit = [&](const T* tile, int64_t t) {
      warp_quantize_row<kFormat>(tile, kTile, q_row + t * (kTile / 4), scale_row + t, lane);
    };
    for (int64_t p0 = 0; p0 < packs; p0 += 32) {
      const int64_t p = p0 + lane, j = p * V;
      __syncwarp();  // the previous step's tiles are read before the staging is written again
      if (p < packs) {
        Pack<T, V> d_gate, d_up;
        step(p, d_gate, d_up);
        // a pack never spans a tile edge (V divides 64, F is a multiple of 64)
        *reinterpret_cast<Pack<T, V>*>(j < F - s ? st.gate + j % Staging::kGate : st.straddle + (j - (F - 64))) =
            d_gate;
        *reinterpret_cast<Pack<T, V>*>(j < s ? st.straddle + 64 + j : st.up + (F + j) % Staging::kUp) = d_up;
      }
      __syncwarp();
      // d_gate's whole tiles ending in this step, then d_up's (the tile across the halves waits for the end)
      const int64_t lo = p0 * V, gate_hi = min64(lo + Staging::kChunk, F - s);
      const int64_t up_hi = F + min64(lo + Staging::kChunk, F);
      for (int64_t end = (lo / kTile + 1) * kTile; end <= gate_hi; end += kTile)
        emit(st.gate + (end - kTile) % Staging::kGate, end / kTile - 1);
      for (int64_t end = ((F + lo) / kTile + 1) * kTile; end <= up_hi; end += kTile)
        if (end - kTile >= F) emit(st.up + (end - kTile) % Staging::kUp, end / kTile - 1);
    }
    if (s) emit(st.straddle, (F - 64) / kTile);  // its writes are behind the last step's __syncwarp
  }
  for (int d = 16; d > 0; d >>= 1) dw += __shfl_xor_sync(0xffffffffu, dw, d);
  if (lane == 0) d_w[r] = dw;
}

// The plain kernel (d_h_q null), or the quantising one in the format asked for.
template <typename T, int V>
void launch(const void* h, const void* g, const float* w, void* d_h, float* d_w, void* act_w, int64_t rows,
            int64_t F, const int32_t* valid, int64_t M, void* d_h_q, float* d_h_scale, bool e4m3,
            cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(ceil_div(rows, kThreads / 32));
  auto kernel = d_h_q == nullptr ? swiglu_combine_grad_kernel<T, V, false, __NV_E4M3>
                : e4m3           ? swiglu_combine_grad_kernel<T, V, true, __NV_E4M3>
                                 : swiglu_combine_grad_kernel<T, V, true, __NV_E5M2>;
  kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(h), static_cast<const T*>(g), w,
                                          static_cast<T*>(d_h), d_w, static_cast<T*>(act_w), rows, F, valid, M,
                                          static_cast<uint32_t*>(d_h_q), d_h_scale);
}

// Both targets (d_h_q null for the plain one).
ffi::Error run(cudaStream_t stream, const SwigluCombineGradDims& dims, ffi::AnyBuffer h, ffi::AnyBuffer g,
               ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> valid, ffi::AnyBuffer d_h, ffi::Buffer<ffi::F32> d_w,
               ffi::AnyBuffer act_w, void* d_h_q, float* d_h_scale) {
  const int64_t rows = dims.rows, M = dims.M, F = dims.F;
  if (rows == 0) return ffi::Error::Success();
  const void *h_p = h.untyped_data(), *g_p = g.untyped_data();
  void *dh_p = d_h.untyped_data(), *aw_p = act_w.untyped_data();
  // 16-byte packs when every row of h, g, d_h and act_w starts on a 16-byte boundary (F a multiple of the width).
  // Both targets choose by this same test, so they sum d_w in the same order.
  const bool aligned = reinterpret_cast<uintptr_t>(h_p) % 16 == 0 && reinterpret_cast<uintptr_t>(g_p) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(dh_p) % 16 == 0 && reinterpret_cast<uintptr_t>(aw_p) % 16 == 0;
  dispatch_float(h.element_type(), [&](auto zero) {
    using T = decltype(zero);
    constexpr int kWide = 16 / sizeof(T);
    if (aligned && F % kWide == 0)
      launch<T, kWide>(h_p, g_p, w.typed_data(), dh_p, d_w.typed_data(), aw_p, rows, F, valid.typed_data(), M, d_h_q,
                       d_h_scale, dims.e4m3, stream);
    else
      launch<T, 1>(h_p, g_p, w.typed_data(), dh_p, d_w.typed_data(), aw_p, rows, F, valid.typed_data(), M, d_h_q,
                   d_h_scale, dims.e4m3, stream);
  });
  return last_cuda_error(d_h_q ? "swiglu_combine_grad_fp8" : "swiglu_combine_grad");
}

ffi::Error SwigluCombineGradImpl(cudaStream_t stream, ffi::AnyBuffer h, ffi::AnyBuffer g, ffi::Buffer<ffi::F32> w,
                                 ffi::Buffer<ffi::S32> valid, ffi::Result<ffi::AnyBuffer> d_h,
                                 ffi::Result<ffi::Buffer<ffi::F32>> d_w, ffi::Result<ffi::AnyBuffer> act_w) {
  auto dims = check_swiglu_combine_grad(h, g, w, valid, *d_h, *d_w, *act_w);
  if (!dims) return dims.error();
  return run(stream, *dims, h, g, w, valid, *d_h, *d_w, *act_w, nullptr, nullptr);
}

ffi::Error SwigluCombineGradFp8Impl(cudaStream_t stream, ffi::AnyBuffer h, ffi::AnyBuffer g,
                                    ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> valid,
                                    ffi::Result<ffi::AnyBuffer> d_h, ffi::Result<ffi::Buffer<ffi::F32>> d_w,
                                    ffi::Result<ffi::AnyBuffer> act_w, ffi::Result<ffi::AnyBuffer> d_h_q,
                                    ffi::Result<ffi::AnyBuffer> d_h_scale) {
  auto dims = check_swiglu_combine_grad_fp8(h, g, w, valid, *d_h, *d_w, *act_w, *d_h_q, *d_h_scale);
  if (!dims) return dims.error();
  return run(stream, *dims, h, g, w, valid, *d_h, *d_w, *act_w, d_h_q->untyped_data(),
                   static_cast<float*>(d_h_scale->untyped_data()));
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CUDA_HANDLER(turbo_moe_swiglu_combine_grad, turbo_moe::SwigluCombineGradImpl,
                       turbo_moe::swiglu_combine_grad_signature);
TURBO_MOE_CUDA_HANDLER(turbo_moe_swiglu_combine_grad_fp8, turbo_moe::SwigluCombineGradFp8Impl,
                       turbo_moe::swiglu_combine_grad_fp8_signature);
