// CPU FFI handlers of the single-device MoE combine and its backward:
//   turbo_moe_unpermute:     y (R, H), row_index (T, k), weights (T, k) -> out (T, H)
//                            out[t] = sum_j weights[t, j] * y[row_index[t, j]]   (float32 accumulation)
//   turbo_moe_unpermute_bwd: d_out (T, H), y, row_index, weights -> d_y (R, H), d_weights (T, k)
//                            d_y[row_index[t, j]] = weights[t, j] * d_out[t]; unreferenced rows are 0
//                            d_weights[t, j] = <d_out[t], y[row_index[t, j]]>
// Entries of row_index outside [0, R) (dropped copies) contribute nothing. row_index must not
// repeat a row (permute never does), so each d_y row has one writer: deterministic.
#include "../contracts/registration.h"
#include "../contracts/unpermute.h"
#include "common.h"

namespace turbo_moe {
namespace {

constexpr int64_t kChunk = 64;  // tokens per parallel work item

ffi::Error UnpermuteImpl(ffi::ThreadPool pool, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> row_index,
                         ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::AnyBuffer> out) {
  auto dims = check_unpermute(y, row_index, weights, *out);
  if (!dims) return dims.error();
  const int64_t batch = dims->batch, R = dims->R, H = dims->H, T = dims->T, k = dims->k;
  const Dtype dt = dtype_of(y.element_type());
  const char* y_p = static_cast<const char*>(y.untyped_data());
  const int32_t* row_p = row_index.typed_data();
  const float* w_p = weights.typed_data();
  char* out_p = static_cast<char*>(out->untyped_data());
  const int64_t w = byte_width(dt), chunks = (T + kChunk - 1) / kChunk;
  parallel_for(&pool, batch * chunks, [&](int64_t item) {
    std::vector<float> acc(H), row(H);
    const int64_t b = item / chunks, t0 = (item % chunks) * kChunk, t1 = std::min(T, t0 + kChunk);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t s = (b * T + t) * k + j;
        const int32_t r = row_p[s];
        if (r < 0 || r >= R) continue;
        load_f32(dt, y_p + (b * R + r) * H * w, H, row.data());
        const float wt = w_p[s];
        for (int64_t h = 0; h < H; ++h) acc[h] += wt * row[h];
      }
      store_f32(dt, acc.data(), H, out_p + (b * T + t) * H * w);
    }
  });
  return ffi::Error::Success();
}

ffi::Error UnpermuteBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer d_out, ffi::AnyBuffer y,
                            ffi::Buffer<ffi::S32> row_index, ffi::Buffer<ffi::F32> weights,
                            ffi::Result<ffi::AnyBuffer> d_y, ffi::Result<ffi::Buffer<ffi::F32>> d_weights,
                            ffi::Result<ffi::AnyBuffer> /*workspace: the CUDA handler's, unused here*/) {
  auto dims = check_unpermute_bwd(d_out, y, row_index, weights, *d_y, *d_weights);
  if (!dims) return dims.error();
  const int64_t batch = dims->batch, R = dims->R, H = dims->H, T = dims->T, k = dims->k;
  const Dtype dt = dtype_of(y.element_type()), g_dt = dtype_of(d_out.element_type());
  const char* g_p = static_cast<const char*>(d_out.untyped_data());
  const char* y_p = static_cast<const char*>(y.untyped_data());
  const int32_t* row_p = row_index.typed_data();
  const float* w_p = weights.typed_data();
  char* dy_p = static_cast<char*>(d_y->untyped_data());
  float* dw_p = d_weights->typed_data();
  const int64_t w = byte_width(dt), gw = byte_width(g_dt), chunks = (T + kChunk - 1) / kChunk;
  // Rows that no token references get no writer below: zero them first.
  std::memset(dy_p, 0, batch * R * H * w);
  parallel_for(&pool, batch * chunks, [&](int64_t item) {
    std::vector<float> grad(H), row(H), scaled(H);
    const int64_t b = item / chunks, t0 = (item % chunks) * kChunk, t1 = std::min(T, t0 + kChunk);
    for (int64_t t = t0; t < t1; ++t) {
      load_f32(g_dt, g_p + (b * T + t) * H * gw, H, grad.data());
      for (int64_t j = 0; j < k; ++j) {
        const int64_t s = (b * T + t) * k + j;
        const int32_t r = row_p[s];
        if (r < 0 || r >= R) { dw_p[s] = 0.f; continue; }
        load_f32(dt, y_p + (b * R + r) * H * w, H, row.data());
        float dot = 0.f;
        for (int64_t h = 0; h < H; ++h) {
          dot += grad[h] * row[h];
          scaled[h] = w_p[s] * grad[h];
        }
        dw_p[s] = dot;
        store_f32(dt, scaled.data(), H, dy_p + (b * R + r) * H * w);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CPU_HANDLER(turbo_moe_unpermute, turbo_moe::UnpermuteImpl, turbo_moe::unpermute_signature);

TURBO_MOE_CPU_HANDLER(turbo_moe_unpermute_bwd, turbo_moe::UnpermuteBwdImpl, turbo_moe::unpermute_bwd_signature);
