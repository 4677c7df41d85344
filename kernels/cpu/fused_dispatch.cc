// CPU FFI handlers of the fused expert-parallel dispatch (the protocol: docs/notes/ep-transport.md):
//   turbo_moe_fused_dispatch_pack: x (T, H), expert_ids (T, k), weights (T, k), slot (T, P), dest_base (P, El)
//     -> send_x (P, C, H), send_rows (P, C, k), send_w (P, C, k)
//     Packet (p, slot[t, p]) carries token t's row once to rank p, with the row of p's expert-sorted buffer and the
//     weight of each of its copies that p computes (copy j of local expert e gets dest_base[p, e] plus the copies
//     of (p, e) before it, in token then top-k order), -1 / 0 for the others and for rows >= recv_rows (lost).
//     Unused packets are zero.
//   turbo_moe_fused_dispatch_land: recv_x (N, H), recv_rows (N, k) -> x_sorted (R, H)
//     x_sorted[recv_rows[n, j]] = recv_x[n] for rows in [0, R); rows no copy lands on are zero.
// Rows are integer work done once in order (deterministic); the row copies run in parallel, one writer a row.
#include "../contracts/fused_dispatch.h"
#include "../contracts/registration.h"
#include "common.h"

namespace turbo_moe {
namespace {

constexpr int64_t kRowsPerItem = 256;  // rows copied per parallel work item

// dst row i = src row source[i] (or zeros where source[i] < 0), rows in parallel.
void gather_rows(ffi::ThreadPool& pool, const char* src, const std::vector<int64_t>& source, char* dst,
                 int64_t row_bytes) {
  const int64_t n = static_cast<int64_t>(source.size()), items = (n + kRowsPerItem - 1) / kRowsPerItem;
  parallel_for(&pool, items, [&](int64_t item) {
    for (int64_t i = item * kRowsPerItem, end = std::min(n, i + kRowsPerItem); i < end; ++i) {
      if (source[i] >= 0) std::memcpy(dst + i * row_bytes, src + source[i] * row_bytes, row_bytes);
      else std::memset(dst + i * row_bytes, 0, row_bytes);
    }
  });
}

ffi::Error FusedPackImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> expert_ids,
                         ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> slot, ffi::Buffer<ffi::S32> dest_base,
                         ffi::Result<ffi::AnyBuffer> send_x, ffi::Result<ffi::Buffer<ffi::S32>> send_rows,
                         ffi::Result<ffi::Buffer<ffi::F32>> send_w, int64_t recv_rows) {
  auto dims = check_fused_dispatch_pack(x, expert_ids, weights, slot, dest_base, *send_x, *send_rows, *send_w,
                                        recv_rows);
  if (!dims) return dims.error();
  const int64_t T = dims->T, H = dims->H, k = dims->k, P = dims->P, El = dims->El, C = dims->C, R = dims->R;
  const int64_t E = P * El;
  const int32_t* ids = expert_ids.typed_data();
  const float* w = weights.typed_data();
  const int32_t* slots = slot.typed_data();
  int32_t* rows = send_rows->typed_data();
  float* sw = send_w->typed_data();
  std::fill(rows, rows + P * C * k, -1);
  std::fill(sw, sw + P * C * k, 0.f);

  // The next destination row of each (rank, local expert): copies take them in token order, then top-k order,
  // which is the order a stable sort by expert of the receiver's packets (source-major) gives.
  std::vector<int64_t> next(dest_base.typed_data(), dest_base.typed_data() + E);
  std::vector<int64_t> source(P * C, -1);  // the token in each packet, -1: unused
  for (int64_t t = 0; t < T; ++t)
    for (int64_t p = 0; p < P; ++p) {
      const int32_t s = slots[t * P + p];
      if (s < 0 || s >= C) continue;  // not sent to p (no expert there, or past its capacity)
      source[p * C + s] = t;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = ids[t * k + j];
        if (e < 0 || e >= E || e / El != p) continue;
        const int64_t row = next[e]++;
        if (row < 0 || row >= R) continue;  // past the receiver's buffer: lost (counted by the caller)
        rows[(p * C + s) * k + j] = static_cast<int32_t>(row);
        sw[(p * C + s) * k + j] = w[t * k + j];
      }
    }
  gather_rows(pool, static_cast<const char*>(x.untyped_data()), source, static_cast<char*>(send_x->untyped_data()),
              H * byte_width(dtype_of(x.element_type())));
  return ffi::Error::Success();
}

ffi::Error FusedLandImpl(ffi::ThreadPool pool, ffi::AnyBuffer recv_x, ffi::Buffer<ffi::S32> recv_rows,
                         ffi::Result<ffi::AnyBuffer> x_sorted) {
  auto dims = check_fused_dispatch_land(recv_x, recv_rows, *x_sorted);
  if (!dims) return dims.error();
  const int64_t N = dims->N, H = dims->H, k = dims->k, R = dims->R;
  const int32_t* rows = recv_rows.typed_data();
  std::vector<int64_t> source(R, -1);  // the packet landing on each row (the protocol never repeats a row)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = rows[n * k + j];
      if (r >= 0 && r < R) source[r] = n;
    }
  gather_rows(pool, static_cast<const char*>(recv_x.untyped_data()), source,
              static_cast<char*>(x_sorted->untyped_data()), H * byte_width(dtype_of(recv_x.element_type())));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CPU_HANDLER(turbo_moe_fused_dispatch_pack, turbo_moe::FusedPackImpl,
                      turbo_moe::fused_dispatch_pack_signature);
TURBO_MOE_CPU_HANDLER(turbo_moe_fused_dispatch_land, turbo_moe::FusedLandImpl,
                      turbo_moe::fused_dispatch_land_signature);
