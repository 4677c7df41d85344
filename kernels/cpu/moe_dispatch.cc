// CPU FFI handler of the expert-parallel dispatch's local packing (DeepEP-style):
//   turbo_moe_dispatch_pack: x (T, H), expert_ids (T, k), weights (T, k)
//     -> send_x (P, C, H), send_ids (P, C, k), send_w (P, C, k), counts (P,), overflow (P,), slot (T, P)
// Each token is packed ONCE per destination rank p that owns at least one of its experts (rank
// p owns experts [p*El, (p+1)*El)), together with the local ids (expert - p*El) and weights of
// those experts; its other k-slots carry id -1 and weight 0. Slots are filled in token order,
// so the layout is deterministic. Buffers are static (C slots per rank); a token that finds rank
// p full is counted in overflow[p] and gets slot -1 (never silently lost). Unused slots are zero.
#include "../contracts/moe_dispatch.h"
#include "../contracts/registration.h"
#include "common.h"

namespace turbo_moe {
namespace {

ffi::Error DispatchPackImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> expert_ids,
                            ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::AnyBuffer> send_x,
                            ffi::Result<ffi::Buffer<ffi::S32>> send_ids,
                            ffi::Result<ffi::Buffer<ffi::F32>> send_w,
                            ffi::Result<ffi::Buffer<ffi::S32>> counts,
                            ffi::Result<ffi::Buffer<ffi::S32>> overflow,
                            ffi::Result<ffi::Buffer<ffi::S32>> slot, int64_t num_ranks,
                            int64_t experts_per_rank, int64_t capacity) {
  auto dims = check_dispatch_pack(x, expert_ids, weights, *send_x, *send_ids, *send_w, *counts, *overflow, *slot,
                                  num_ranks, experts_per_rank, capacity);
  if (!dims) return dims.error();
  const int64_t batch = dims->batch, T = dims->T, H = dims->H, k = dims->k, P = dims->P, El = dims->El, C = dims->C;
  const int64_t w = byte_width(dtype_of(x.element_type())), E = P * El;

  const char* x_p = static_cast<const char*>(x.untyped_data());
  const int32_t* ids_p = expert_ids.typed_data();
  const float* w_p = weights.typed_data();
  char* sx_p = static_cast<char*>(send_x->untyped_data());
  int32_t* sid_p = send_ids->typed_data();
  float* sw_p = send_w->typed_data();
  int32_t* cnt_p = counts->typed_data();
  int32_t* ovf_p = overflow->typed_data();
  int32_t* slot_p = slot->typed_data();

  // Slot assignment (integer work, in token order) first; the row copies then run in parallel.
  std::vector<int64_t> used(batch * P);
  for (int64_t b = 0; b < batch; ++b) {
    int32_t* cnt = cnt_p + b * P;
    int32_t* ovf = ovf_p + b * P;
    std::fill(cnt, cnt + P, 0);
    std::fill(ovf, ovf + P, 0);
    std::fill(sid_p + b * P * C * k, sid_p + (b + 1) * P * C * k, -1);
    std::fill(sw_p + b * P * C * k, sw_p + (b + 1) * P * C * k, 0.f);
    for (int64_t t = 0; t < T; ++t) {
      int32_t* tslot = slot_p + (b * T + t) * P;
      std::fill(tslot, tslot + P, -1);
      const int32_t* tids = ids_p + (b * T + t) * k;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = tids[j];
        if (e < 0 || e >= E) continue;  // invalid id: dropped, like permute
        const int64_t p = e / El;
        if (tslot[p] == -1) {  // first expert of this token on rank p: claim a slot
          if (cnt[p] < C) {
            tslot[p] = cnt[p]++;
          } else {
            tslot[p] = -2;  // marks "overflowed" while packing this token
            ++ovf[p];
          }
        }
        if (tslot[p] >= 0) {
          const int64_t s = ((b * P + p) * C + tslot[p]) * k + j;
          sid_p[s] = static_cast<int32_t>(e - p * El);
          sw_p[s] = w_p[(b * T + t) * k + j];
        }
      }
      for (int64_t p = 0; p < P; ++p)
        if (tslot[p] == -2) tslot[p] = -1;
    }
    for (int64_t p = 0; p < P; ++p) used[b * P + p] = cnt[p];
  }
  constexpr int64_t kChunk = 256;
  const int64_t chunks = (T + kChunk - 1) / kChunk;
  parallel_for(&pool, batch * chunks, [&](int64_t item) {
    const int64_t b = item / chunks, t0 = (item % chunks) * kChunk, t1 = std::min(T, t0 + kChunk);
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t p = 0; p < P; ++p) {
        const int32_t s = slot_p[(b * T + t) * P + p];
        if (s >= 0) std::memcpy(sx_p + ((b * P + p) * C + s) * H * w, x_p + (b * T + t) * H * w, H * w);
      }
  });
  for (int64_t bp = 0; bp < batch * P; ++bp)  // unused slots are zero, never uninitialised
    std::memset(sx_p + (bp * C + used[bp]) * H * w, 0, (C - used[bp]) * H * w);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CPU_HANDLER(turbo_moe_dispatch_pack, turbo_moe::DispatchPackImpl, turbo_moe::dispatch_pack_signature);
