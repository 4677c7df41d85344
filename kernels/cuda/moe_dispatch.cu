// CUDA FFI handler of the expert-parallel dispatch's local packing (contract of
// kernels/cpu/moe_dispatch.cc):
//   turbo_moe_dispatch_pack: x (T, H), expert_ids (T, k), weights (T, k)
//     -> send_x (P, C, H), send_ids (P, C, k), send_w (P, C, k), counts (P,), overflow (P,), slot (T, P)
// A token goes once to each rank p owning any of its experts; slots are given in token order by a
// block-wide scan per (batch, rank): deterministic, no global atomics, no host sync. Tokens past
// the capacity C of a rank are counted in overflow[p] and get slot -1. Unused slots are zero.
#include "../contracts/moe_dispatch.h"
#include "../contracts/registration.h"
#include "block_scan.cuh"
#include "common.cuh"
#include "row_copy.cuh"

namespace turbo_moe {
namespace {

constexpr int kScanThreads = 1024;

// One block per (rank p, batch b): scans the tokens' "goes to p" flags in token order.
__global__ void dispatch_slots_kernel(const int32_t* ids, const float* weights, int64_t T, int64_t k,
                                      int64_t P, int64_t El, int64_t C, int32_t* send_ids, float* send_w,
                                      int32_t* counts, int32_t* overflow, int32_t* slot) {
  __shared__ long long warp_sums[32];
  const int64_t p = blockIdx.x, b = blockIdx.y, E = P * El;
  const int32_t* b_ids = ids + b * T * k;
  const float* b_w = weights + b * T * k;
  int32_t* b_sid = send_ids + (b * P + p) * C * k;
  float* b_sw = send_w + (b * P + p) * C * k;
  long long running = 0;
  for (int64_t t0 = 0; t0 < T; t0 += blockDim.x) {
    const int64_t t = t0 + threadIdx.x;
    int flag = 0;
    if (t < T)
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = b_ids[t * k + j];
        flag |= (e >= 0 && e < E && e / El == p);
      }
    long long total;
    const long long position = running + block_inclusive_scan(flag, warp_sums, &total) - flag;
    if (t < T) {
      const bool fits = flag && position < C;
      slot[(b * T + t) * P + p] = fits ? static_cast<int32_t>(position) : -1;
      if (fits)
        for (int64_t j = 0; j < k; ++j) {
          const int32_t e = b_ids[t * k + j];
          const bool local = e >= 0 && e < E && e / El == p;
          b_sid[position * k + j] = local ? static_cast<int32_t>(e - p * El) : -1;
          b_sw[position * k + j] = local ? b_w[t * k + j] : 0.f;
        }
    }
    running += total;
  }
  const int64_t used = running < C ? running : C;
  for (int64_t i = used * k + threadIdx.x; i < C * k; i += blockDim.x) {  // unused slots: id -1, weight 0
    b_sid[i] = -1;
    b_sw[i] = 0.f;
  }
  if (threadIdx.x == 0) {
    counts[b * P + p] = static_cast<int32_t>(used);
    overflow[b * P + p] = static_cast<int32_t>(running - used);
  }
}

// One warp per (batch, token, rank): copies the token's row into its slot, if it has one.
template <typename V>
__global__ void dispatch_copy_kernel(const char* x, const int32_t* slot, char* send_x, int64_t T, int64_t P,
                                     int64_t C, int64_t row_bytes, int64_t total) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (warp >= total) return;
  const int32_t s = slot[warp];
  if (s < 0) return;
  const int64_t bt = warp / P, p = warp % P, b = bt / T;
  const V* src = reinterpret_cast<const V*>(x + bt * row_bytes);
  V* dst = reinterpret_cast<V*>(send_x + ((b * P + p) * C + s) * row_bytes);
  const int64_t n = row_bytes / static_cast<int64_t>(sizeof(V));
  for (int64_t i = lane; i < n; i += 32) dst[i] = src[i];
}

// One warp per (batch, rank, slot): zero the slots past the rank's count.
template <typename V>
__global__ void zero_unused_slots_kernel(char* send_x, const int32_t* counts, int64_t C, int64_t row_bytes,
                                         int64_t total) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (warp >= total || warp % C < counts[warp / C]) return;
  V* dst = reinterpret_cast<V*>(send_x + warp * row_bytes);
  const int64_t n = row_bytes / static_cast<int64_t>(sizeof(V));
  for (int64_t i = lane; i < n; i += 32) dst[i] = V{};
}

ffi::Error DispatchPackImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> expert_ids,
                            ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::AnyBuffer> send_x,
                            ffi::Result<ffi::Buffer<ffi::S32>> send_ids, ffi::Result<ffi::Buffer<ffi::F32>> send_w,
                            ffi::Result<ffi::Buffer<ffi::S32>> counts, ffi::Result<ffi::Buffer<ffi::S32>> overflow,
                            ffi::Result<ffi::Buffer<ffi::S32>> slot, int64_t num_ranks, int64_t experts_per_rank,
                            int64_t capacity) {
  auto dims = check_dispatch_pack(x, expert_ids, weights, *send_x, *send_ids, *send_w, *counts, *overflow, *slot,
                                  num_ranks, experts_per_rank, capacity);
  if (!dims) return dims.error();
  const int64_t batch = dims->batch, T = dims->T, H = dims->H, k = dims->k, P = dims->P, El = dims->El, C = dims->C;
  if (batch == 0 || P * C == 0) return ffi::Error::Success();
  dispatch_slots_kernel<<<dim3(static_cast<unsigned>(P), static_cast<unsigned>(batch)), kScanThreads, 0, stream>>>(
      expert_ids.typed_data(), weights.typed_data(), T, k, P, El, C, send_ids->typed_data(),
      send_w->typed_data(), counts->typed_data(), overflow->typed_data(), slot->typed_data());
  const int64_t row_bytes = H * byte_width(x.element_type());
  if (row_bytes > 0) {
    const char* x_p = static_cast<const char*>(x.untyped_data());
    char* sx_p = static_cast<char*>(send_x->untyped_data());
    const int64_t pairs = batch * T * P, slots = batch * P * C;
    dispatch_vector(vector_bytes(row_bytes, {x_p, sx_p}), [&](auto tag) {
      using V = decltype(tag);
      if (pairs > 0)
        dispatch_copy_kernel<V><<<static_cast<unsigned>(ceil_div(pairs, 8)), 256, 0, stream>>>(
            x_p, slot->typed_data(), sx_p, T, P, C, row_bytes, pairs);
      zero_unused_slots_kernel<V><<<static_cast<unsigned>(ceil_div(slots, 8)), 256, 0, stream>>>(
          sx_p, counts->typed_data(), C, row_bytes, slots);
    });
  }
  return last_cuda_error("dispatch_pack");
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CUDA_HANDLER(turbo_moe_dispatch_pack, turbo_moe::DispatchPackImpl, turbo_moe::dispatch_pack_signature);
