// CPU FFI handler of the sorted segment sum:
//   turbo_moe_segment_sum: data (N, D), sorted_ids (N,), order (N,) -> out (V, D)
// out[v] = sum of data[order[p]] over the positions p with sorted_ids[p] == v, accumulated in float32 and
// rounded once; ids outside [0, V) are dropped; rows of absent ids are zero. sorted_ids must be ascending
// (turbo_moe/ops/segment_sum.py sorts them). The additions run in the CUDA kernel's order (kStrands strided
// partial sums, added strand 0 first), so both handlers give the same bits. Optional leading (vmap) dims are
// shared by all operands; segments run in parallel.
#include "../contracts/registration.h"
#include "../contracts/segment_sum.h"
#include "common.h"

namespace turbo_moe {
namespace {

constexpr int64_t kStrands = 8;  // = kWarps of kernels/cuda/segment_sum.cu

ffi::Error SegmentSumImpl(ffi::ThreadPool pool, ffi::AnyBuffer data, ffi::Buffer<ffi::S32> sorted_ids,
                          ffi::Buffer<ffi::S32> order, ffi::Result<ffi::AnyBuffer> out) {
  auto dims = check_segment_sum(data, sorted_ids, order, *out);
  if (!dims) return dims.error();
  const int64_t batch = dims->batch, N = dims->N, D = dims->D, V = dims->V;
  const Dtype dt = dtype_of(data.element_type());
  const int64_t w = byte_width(dt);
  const char* data_p = static_cast<const char*>(data.untyped_data());
  char* out_p = static_cast<char*>(out->untyped_data());
  std::memset(out_p, 0, static_cast<size_t>(batch * V * D * w));

  // Segments as (batch, first position, end), in order; each owns one output row.
  struct Segment { int64_t b, begin, end; };
  std::vector<Segment> segments;
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t* ids = sorted_ids.typed_data() + b * N;
    for (int64_t p = 0; p < N;) {
      int64_t q = p + 1;
      while (q < N && ids[q] == ids[p]) ++q;
      if (ids[p] >= 0 && ids[p] < V) segments.push_back({b, p, q});
      p = q;
    }
  }
  parallel_for(&pool, static_cast<int64_t>(segments.size()), [&](int64_t i) {
    const Segment& s = segments[i];
    const int32_t* rows = order.typed_data() + s.b * N;
    std::vector<float> strand(kStrands * D, 0.f), row(D), total(D, 0.f);
    for (int64_t q = s.begin; q < s.end; ++q) {
      const int32_t r = rows[q];
      if (r < 0 || r >= N) continue;  // not a permutation of [0, N): skipped, never read out of bounds
      load_f32(dt, data_p + (s.b * N + r) * D * w, D, row.data());
      float* acc = strand.data() + ((q - s.begin) % kStrands) * D;
      for (int64_t c = 0; c < D; ++c) acc[c] += row[c];
    }
    for (int64_t k = 0; k < kStrands; ++k)
      for (int64_t c = 0; c < D; ++c) total[c] += strand[k * D + c];
    const int32_t id = sorted_ids.typed_data()[s.b * N + s.begin];
    store_f32(dt, total.data(), D, out_p + (s.b * V + id) * D * w);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CPU_HANDLER(turbo_moe_segment_sum, turbo_moe::SegmentSumImpl, turbo_moe::segment_sum_signature);
