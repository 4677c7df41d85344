// CUDA FFI handlers of the single-device MoE combine and its backward (contract of
// kernels/cpu/unpermute.cc):
//   turbo_moe_unpermute:     y (R, H), row_index (T, k), weights (T, k) -> out (T, H)
//                            out[t] = sum_j weights[t, j] * y[row_index[t, j]]   (float32 accumulation)
//   turbo_moe_unpermute_bwd: d_out (T, H), y, row_index, weights -> d_y (R, H), d_weights (T, k)
//                            d_y[row_index[t, j]] = weights[t, j] * d_out[t]; unreferenced rows are 0
//                            d_weights[t, j] = <d_out[t], y[row_index[t, j]]>
// Entries of row_index outside [0, R) contribute nothing. row_index must not repeat a row
// (permute never does), so each d_y row has one writer. Forward: one block per token; backward: the
// row -> slot inverse (in a workspace result sized by turbo_moe_unpermute_bwd_workspace_bytes), then one
// warp per d_y row. Rows move in vectors of up to 16 bytes. No XLA scratch: both are safe for XLA's
// command buffers.
#include "../contracts/registration.h"
#include "../contracts/unpermute.h"
#include "common.cuh"

namespace turbo_moe {
namespace {

constexpr int kThreads = 128;

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) unpermute_kernel(const T* __restrict__ y,
                                                              const int32_t* __restrict__ row_index,
                                                              const float* __restrict__ weights,
                                                              T* __restrict__ out, int64_t R, int64_t H,
                                                              int64_t T_, int64_t k) {
  const int64_t bt = blockIdx.x, b = bt / T_;
  const int32_t* rows = row_index + bt * k;
  const float* w = weights + bt * k;
  const int64_t packs = H / V;
  for (int64_t p = threadIdx.x; p < packs; p += kThreads) {
    float acc[V] = {};
    // Two rows' loads in flight before their sums (the sums' order unchanged): faster at the `reduced`, V2-Lite and
    // V3 shapes; all k at once with one round of threads ran slower (docs/notes/step-time.md).
    int64_t j = 0;
    for (; j + 1 < k; j += 2) {
      const int32_t r0 = rows[j], r1 = rows[j + 1];
      const bool ok0 = r0 >= 0 && r0 < R, ok1 = r1 >= 0 && r1 < R;
      Pack<T, V> s0, s1;
      if (ok0) s0 = reinterpret_cast<const Pack<T, V>*>(y + (b * R + r0) * H)[p];
      if (ok1) s1 = reinterpret_cast<const Pack<T, V>*>(y + (b * R + r1) * H)[p];
      if (ok0) {
        const float wt = w[j];
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] = fmaf(wt, to_f32(s0.v[i]), acc[i]);
      }
      if (ok1) {
        const float wt = w[j + 1];
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] = fmaf(wt, to_f32(s1.v[i]), acc[i]);
      }
    }
    for (; j < k; ++j) {
      const int32_t r = rows[j];
      if (r < 0 || r >= R) continue;
      const Pack<T, V> src = reinterpret_cast<const Pack<T, V>*>(y + (b * R + r) * H)[p];
      const float wt = w[j];
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] = fmaf(wt, to_f32(src.v[i]), acc[i]);
    }
    Pack<T, V> dst;
#pragma unroll
    for (int i = 0; i < V; ++i) dst.v[i] = from_f32<T>(acc[i]);
    reinterpret_cast<Pack<T, V>*>(out + bt * H)[p] = dst;
  }
}

// inverse[b][r] = the slot s = t * k + j whose row_index is r (rows are unique: permute never repeats one).
__global__ void invert_rows_kernel(const int32_t* __restrict__ row_index, int32_t* __restrict__ inverse, int64_t R,
                                   int64_t slots, int64_t total_slots) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total_slots) return;
  const int32_t r = row_index[i];
  if (r >= 0 && r < R) inverse[(i / slots) * R + r] = static_cast<int32_t>(i % slots);
}

// One warp per d_y row: every row is written once (zeros where no slot points at it, so no memset of d_y first),
// and the row's d_weights dot product is a warp reduction (fixed order) instead of a block barrier per copy.
template <typename TY, typename TG, int V>
__global__ void __launch_bounds__(kThreads) unpermute_bwd_rows_kernel(
    const TG* __restrict__ d_out, const TY* __restrict__ y, const int32_t* __restrict__ inverse,
    const float* __restrict__ weights, TY* __restrict__ d_y, float* __restrict__ d_weights, int64_t R,
    int64_t H, int64_t T_, int64_t k, int64_t total_rows) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (row >= total_rows) return;  // whole warps: total_rows is a warp count
  const int64_t b = row / R, packs = H / V;
  const int32_t s = inverse[row];
  Pack<TY, V>* dyr = reinterpret_cast<Pack<TY, V>*>(d_y + row * H);
  if (s < 0) {
    Pack<TY, V> zero;
#pragma unroll
    for (int i = 0; i < V; ++i) zero.v[i] = from_f32<TY>(0.f);
    for (int64_t p = lane; p < packs; p += 32) dyr[p] = zero;
    return;
  }
  const int64_t slot = b * T_ * k + s;
  const float wt = weights[slot];
  const Pack<TG, V>* g = reinterpret_cast<const Pack<TG, V>*>(d_out + (b * T_ + s / k) * H);
  const Pack<TY, V>* yr = reinterpret_cast<const Pack<TY, V>*>(y + row * H);
  float dot = 0.f;
  for (int64_t p = lane; p < packs; p += 32) {
    const Pack<TG, V> gv = g[p];
    const Pack<TY, V> yv = yr[p];
    Pack<TY, V> out;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float gf = to_f32(gv.v[i]);
      dot = fmaf(gf, to_f32(yv.v[i]), dot);
      out.v[i] = from_f32<TY>(wt * gf);
    }
    dyr[p] = out;
  }
  for (int d = 16; d > 0; d >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, d);
  if (lane == 0) d_weights[slot] = dot;
}

// 16-byte packs when H and every base pointer allow it, else one element at a time.
template <typename T>
bool can_pack(int64_t H, std::initializer_list<const void*> ptrs) {
  constexpr int V = 16 / sizeof(T);
  bool ok = H % V == 0;
  for (const void* p : ptrs) ok = ok && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  return ok;
}

ffi::Error UnpermuteImpl(cudaStream_t stream, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> row_index,
                         ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::AnyBuffer> out) {
  auto dims = check_unpermute(y, row_index, weights, *out);
  if (!dims) return dims.error();
  const int64_t batch = dims->batch, R = dims->R, H = dims->H, T = dims->T, k = dims->k;
  if (batch * T == 0 || H == 0) return ffi::Error::Success();
  dispatch_float(y.element_type(), [&](auto tag) {
    using E = decltype(tag);
    const E* y_p = static_cast<const E*>(y.untyped_data());
    E* out_p = static_cast<E*>(out->untyped_data());
    const unsigned blocks = static_cast<unsigned>(batch * T);
    if (can_pack<E>(H, {y_p, out_p}))
      unpermute_kernel<E, 16 / sizeof(E)><<<blocks, kThreads, 0, stream>>>(
          y_p, row_index.typed_data(), weights.typed_data(), out_p, R, H, T, k);
    else
      unpermute_kernel<E, 1><<<blocks, kThreads, 0, stream>>>(y_p, row_index.typed_data(),
                                                               weights.typed_data(), out_p, R, H, T, k);
  });
  return last_cuda_error("unpermute");
}

ffi::Error UnpermuteBwdImpl(cudaStream_t stream, ffi::AnyBuffer d_out, ffi::AnyBuffer y,
                            ffi::Buffer<ffi::S32> row_index, ffi::Buffer<ffi::F32> weights,
                            ffi::Result<ffi::AnyBuffer> d_y, ffi::Result<ffi::Buffer<ffi::F32>> d_weights,
                            ffi::Result<ffi::AnyBuffer> workspace) {
  auto dims = check_unpermute_bwd(d_out, y, row_index, weights, *d_y, *d_weights);
  if (!dims) return dims.error();
  const int64_t batch = dims->batch, R = dims->R, H = dims->H, T = dims->T, k = dims->k;
  const size_t need = static_cast<size_t>(batch * R) * sizeof(int32_t);
  if (workspace->size_bytes() < need)
    return invalid("unpermute_bwd: workspace of " + std::to_string(workspace->size_bytes()) + " bytes, this call needs " +
                   std::to_string(need) + " (turbo_moe/ops/unpermute.py sizes it with turbo_moe_unpermute_bwd_workspace_bytes)");
  // Slots without a row (dropped copies) get no writer below: their d_weights are zero.
  cudaMemsetAsync(d_weights->typed_data(), 0, batch * T * k * sizeof(float), stream);
  if (batch * R == 0 || H == 0) return last_cuda_error("unpermute_bwd");
  int32_t* inverse = static_cast<int32_t*>(workspace->untyped_data());
  cudaMemsetAsync(inverse, 0xff, need, stream);  // -1: a row no slot points at
  const int64_t total_slots = batch * T * k;
  if (total_slots > 0)
    invert_rows_kernel<<<static_cast<unsigned>(ceil_div(total_slots, 256)), 256, 0, stream>>>(
        row_index.typed_data(), inverse, R, T * k, total_slots);
  dispatch_float(y.element_type(), [&](auto y_tag) {
    using TY = decltype(y_tag);
    dispatch_float(d_out.element_type(), [&](auto g_tag) {
      using TG = decltype(g_tag);
      const TG* g_p = static_cast<const TG*>(d_out.untyped_data());
      const TY* y_p = static_cast<const TY*>(y.untyped_data());
      TY* dy_p = static_cast<TY*>(d_y->untyped_data());
      const int64_t rows = batch * R;
      const unsigned blocks = static_cast<unsigned>(ceil_div(rows, kThreads / 32));
      constexpr int V = 16 / (sizeof(TY) > sizeof(TG) ? sizeof(TY) : sizeof(TG));
      if (can_pack<TY>(H, {y_p, dy_p}) && can_pack<TG>(H, {g_p}) && H % V == 0)
        unpermute_bwd_rows_kernel<TY, TG, V><<<blocks, kThreads, 0, stream>>>(
            g_p, y_p, inverse, weights.typed_data(), dy_p, d_weights->typed_data(), R, H, T, k, rows);
      else
        unpermute_bwd_rows_kernel<TY, TG, 1><<<blocks, kThreads, 0, stream>>>(
            g_p, y_p, inverse, weights.typed_data(), dy_p, d_weights->typed_data(), R, H, T, k, rows);
    });
  });
  return last_cuda_error("unpermute_bwd");
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CUDA_HANDLER(turbo_moe_unpermute, turbo_moe::UnpermuteImpl, turbo_moe::unpermute_signature);

TURBO_MOE_CUDA_HANDLER(turbo_moe_unpermute_bwd, turbo_moe::UnpermuteBwdImpl, turbo_moe::unpermute_bwd_signature);

// Workspace bytes of one unpermute_bwd call over `batch` leading problems of R rows (the row -> slot inverse).
extern "C" int64_t turbo_moe_unpermute_bwd_workspace_bytes(int64_t batch, int64_t rows) {
  return batch * rows * static_cast<int64_t>(sizeof(int32_t));
}
