// CPU FFI handlers of the single-device MoE dispatch:
//   turbo_moe_permute: x (T, H), expert_ids (T, k) -> x_sorted (T*k, H), group_sizes (E,), row_index (T, k)
//   turbo_moe_permute_rows: x (T, H), row_index (T, k), group_sizes (E,) -> x_sorted (T*k, H): x_sorted[row_index[t,
//     j]] = x[t] for entries in [0, T*k) (which must not repeat a row), rows from sum(group_sizes) on zero, the rest
//     as a permute with that row_index and those group sizes left them (its copy step alone).
// Token copies are stably sorted by expert (counting sort in flat slot order t*k + j). A copy whose
// expert id is outside [0, E) is dropped: row_index = -1, and the rows past sum(group_sizes) are
// zero. Optional leading batch dims are shared by all operands.
#include "../contracts/permute.h"
#include "../contracts/registration.h"
#include "common.h"

namespace turbo_moe {
namespace {

// The copy step of both handlers: x_sorted[row_index[b, t, j]] = x[b, t] for rows in [0, T*k) (rows in parallel
// over chunks of tokens), then each batch's rows from valid[b] on zeroed (NaN when !zero_tail: see tail_fill).
void copy_rows(ffi::ThreadPool& pool, const char* x_p, const int32_t* row_p, char* xs_p, int64_t batch, int64_t T,
               int64_t k, int64_t row, const std::vector<int64_t>& valid, bool zero_tail) {
  const int64_t slots = T * k;
  for_each_routed_copy(&pool, row_p, batch, T, k, /*chunk=*/256, [&](int64_t b, int64_t t, int64_t r) {
    std::memcpy(xs_p + (b * slots + r) * row, x_p + (b * T + t) * row, row);
  });
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t begin = std::min(valid[b], slots);
    std::memset(xs_p + (b * slots + begin) * row, tail_fill(zero_tail), (slots - begin) * row);
  }
}

ffi::Error PermuteImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> expert_ids,
                       ffi::Result<ffi::AnyBuffer> x_sorted, ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                       ffi::Result<ffi::Buffer<ffi::S32>> row_index,
                       ffi::Result<ffi::AnyBuffer> /*workspace: the CUDA handler's, unused here*/, int64_t num_experts,
                       bool zero_tail) {
  auto dims = check_permute(x, expert_ids, *x_sorted, *group_sizes, *row_index, num_experts);
  if (!dims) return dims.error();
  const int64_t batch = dims->batch, T = dims->T, H = dims->H, k = dims->k, E = dims->E, slots = dims->slots;
  const int64_t w = byte_width(dtype_of(x.element_type()));

  const char* x_p = static_cast<const char*>(x.untyped_data());
  const int32_t* ids_p = expert_ids.typed_data();
  char* xs_p = static_cast<char*>(x_sorted->untyped_data());
  int32_t* gs_p = group_sizes->typed_data();
  int32_t* row_p = row_index->typed_data();

  // Row assignment is O(T*k) integer work; the row copies below dominate and run in parallel.
  std::vector<int64_t> valid(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t* ids = ids_p + b * slots;
    int32_t* counts = gs_p + b * E;
    std::fill(counts, counts + E, 0);
    for (int64_t s = 0; s < slots; ++s)
      if (ids[s] >= 0 && ids[s] < E) ++counts[ids[s]];
    std::vector<int64_t> next(E);
    int64_t acc = 0;
    for (int64_t e = 0; e < E; ++e) { next[e] = acc; acc += counts[e]; }
    valid[b] = acc;
    for (int64_t s = 0; s < slots; ++s) {
      const int32_t e = ids[s];
      row_p[b * slots + s] = (e >= 0 && e < E) ? static_cast<int32_t>(next[e]++) : -1;
    }
  }
  copy_rows(pool, x_p, row_p, xs_p, batch, T, k, H * w, valid, zero_tail);
  return ffi::Error::Success();
}

ffi::Error PermuteRowsImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> row_index,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> x_sorted, bool zero_tail) {
  auto dims = check_permute_rows(x, row_index, group_sizes, *x_sorted);
  if (!dims) return dims.error();
  const int64_t batch = dims->batch, T = dims->T, H = dims->H, k = dims->k, E = dims->E;
  const int64_t row = H * byte_width(dtype_of(x.element_type()));
  const char* x_p = static_cast<const char*>(x.untyped_data());
  char* xs_p = static_cast<char*>(x_sorted->untyped_data());
  std::vector<int64_t> totals(batch, 0);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t e = 0; e < E; ++e) totals[b] += std::max<int32_t>(group_sizes.typed_data()[b * E + e], 0);
  copy_rows(pool, x_p, row_index.typed_data(), xs_p, batch, T, k, row, totals, zero_tail);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CPU_HANDLER(turbo_moe_permute_rows, turbo_moe::PermuteRowsImpl, turbo_moe::permute_rows_signature);

TURBO_MOE_CPU_HANDLER(turbo_moe_permute, turbo_moe::PermuteImpl, turbo_moe::permute_signature);
