// CPU FFI handlers of the grouped GEMM (the semantics of jax.lax.ragged_dot):
//   turbo_moe_grouped_gemm:             out[r] = lhs[r] @ rhs[g(r)]         (M,K) x (G,K,N)|(G,N,K) -> (M,N)
//   turbo_moe_grouped_gemm_weight_grad: dw[g]  = lhs[rows_g]^T @ d_out[rows_g]  (M,K),(M,N) -> (G,K,N)
// Optional leading batch dims (vmap) are shared by all operands. Accumulation is float32; the
// work is split into (group, row block, column block) tiles run on XLA's intra-op thread pool.
// Each output element is produced by one tile with a fixed summation order: deterministic.
#include "common.h"
#include "gemm_tile.h"

namespace turbo_moe {
namespace {

struct Tile {
  int64_t batch, group, row0, rows;
};

// Converts rows [row0, row0+rows) x cols [col0, col0+cols) of a row-major (.., ld) matrix to
// float32 panels of `width` rows: dst[p*cols*width + c*width + i] = M(row0+p*width+i, col0+c).
// Rows past `rows` are zero (panel padding).
void pack_rows_as_panels(Dtype dt, const char* base, int64_t ld, int64_t row0, int64_t rows,
                         int64_t col0, int64_t cols, int width, float* dst) {
  float tmp[kKC > kNC ? kKC : kNC];
  const int64_t panels = (rows + width - 1) / width;
  for (int64_t p = 0; p < panels; ++p) {
    float* panel = dst + p * cols * width;
    for (int i = 0; i < width; ++i) {
      const int64_t r = p * width + i;
      if (r < rows) {
        load_f32(dt, base + ((row0 + r) * ld + col0) * byte_width(dt), cols, tmp);
        for (int64_t c = 0; c < cols; ++c) panel[c * width + i] = tmp[c];
      } else {
        for (int64_t c = 0; c < cols; ++c) panel[c * width + i] = 0.f;
      }
    }
  }
}

// Packs a depth-major (.., ld) operand: dst[p*depth*width + d*width + j] = M(d0+d, col0+p*width+j),
// i.e. each panel holds `width` consecutive columns of consecutive rows. Columns past `cols` are 0.
void pack_cols_as_panels(Dtype dt, const char* base, int64_t ld, int64_t d0, int64_t depth,
                         int64_t col0, int64_t cols, int width, float* dst) {
  float tmp[kMC > kNC ? kMC : kNC];
  const int64_t panels = (cols + width - 1) / width;
  for (int64_t d = 0; d < depth; ++d) {
    load_f32(dt, base + ((d0 + d) * ld + col0) * byte_width(dt), cols, tmp);
    for (int64_t p = 0; p < panels; ++p) {
      float* dst_row = dst + p * depth * width + d * width;
      for (int j = 0; j < width; ++j) {
        const int64_t c = p * width + j;
        dst_row[j] = c < cols ? tmp[c] : 0.f;
      }
    }
  }
}

void store_block(Dtype dt, const float* block, int64_t rows, int64_t cols, char* out, int64_t ld,
                 int64_t row0, int64_t col0) {
  for (int64_t r = 0; r < rows; ++r)
    store_f32(dt, block + r * kNC, cols, out + ((row0 + r) * ld + col0) * byte_width(dt));
}

ffi::Error GroupedGemmImpl(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                           bool transpose_rhs) {
  Dtype in_dt, out_dt;
  if (!to_dtype(lhs.element_type(), &in_dt) || rhs.element_type() != lhs.element_type())
    return invalid("grouped_gemm: lhs and rhs must share one dtype of float32/bfloat16/float16");
  if (!to_dtype(out->element_type(), &out_dt))
    return invalid("grouped_gemm: output dtype must be float32/bfloat16/float16");
  auto ld = lhs.dimensions(), rd = rhs.dimensions(), gd = group_sizes.dimensions();
  if (ld.size() < 2 || rd.size() != ld.size() + 1 || gd.size() != ld.size() - 1)
    return invalid("grouped_gemm: expected lhs [..., M, K], rhs [..., G, K, N], group_sizes [..., G]");
  const int64_t rank = ld.size();
  const int64_t M = ld[rank - 2], K = ld[rank - 1], G = rd[rank - 2];
  const int64_t N = transpose_rhs ? rd[rank - 1] : rd[rank];
  const int64_t rhs_k = transpose_rhs ? rd[rank] : rd[rank - 1];
  if (rhs_k != K || gd[rank - 2] != G)
    return invalid("grouped_gemm: contraction dim or group count mismatch between lhs, rhs, group_sizes");
  const int64_t batch = leading_product(ld, 2);
  if (leading_product(rd, 3) != batch || leading_product(gd, 1) != batch)
    return invalid("grouped_gemm: operands must share the same leading batch dims");

  const char* lhs_p = static_cast<const char*>(lhs.untyped_data());
  const char* rhs_p = static_cast<const char*>(rhs.untyped_data());
  char* out_p = static_cast<char*>(out->untyped_data());
  const int32_t* gs_p = group_sizes.typed_data();
  const int64_t in_w = byte_width(in_dt), out_w = byte_width(out_dt);

  std::vector<Tile> tiles;
  std::vector<int64_t> totals(batch);
  for (int64_t b = 0; b < batch; ++b) {
    auto starts = group_starts(gs_p + b * G, G, M);
    totals[b] = starts[G];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = starts[g]; r < starts[g + 1]; r += kMC)
        tiles.push_back({b, g, r, std::min(kMC, starts[g + 1] - r)});
  }
  const int64_t n_blocks = (N + kNC - 1) / kNC;
  parallel_for(&pool, static_cast<int64_t>(tiles.size()) * n_blocks, [&](int64_t item) {
    thread_local TileScratch scratch;
    const Tile& t = tiles[item / n_blocks];
    const int64_t col0 = (item % n_blocks) * kNC, cols = std::min(kNC, N - col0);
    const char* a = lhs_p + t.batch * M * K * in_w;
    const char* w = rhs_p + (t.batch * G + t.group) * K * N * in_w;
    auto pack_a = [&](int64_t k0, int64_t kc, float* dst) {
      pack_rows_as_panels(in_dt, a, K, t.row0, t.rows, k0, kc, kMR, dst);
    };
    auto pack_b = [&](int64_t k0, int64_t kc, float* dst) {
      if (transpose_rhs)  // w is (N, K): columns of B are rows of w
        pack_rows_as_panels(in_dt, w, K, col0, cols, k0, kc, kNR, dst);
      else                // w is (K, N)
        pack_cols_as_panels(in_dt, w, N, k0, kc, col0, cols, kNR, dst);
    };
    gemm_block(t.rows, cols, K, pack_a, pack_b, scratch);
    store_block(out_dt, scratch.c_block.data(), t.rows, cols, out_p + t.batch * M * N * out_w, N,
                t.row0, col0);
  });
  // Rows that belong to no group are defined as zero (never left uninitialised).
  for (int64_t b = 0; b < batch; ++b)
    std::memset(out_p + (b * M + totals[b]) * N * out_w, 0, (M - totals[b]) * N * out_w);
  return ffi::Error::Success();
}

ffi::Error GroupedGemmWeightGradImpl(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer d_out,
                                     ffi::Buffer<ffi::S32> group_sizes,
                                     ffi::Result<ffi::AnyBuffer> d_rhs) {
  Dtype in_dt, out_dt;
  if (!to_dtype(lhs.element_type(), &in_dt) || d_out.element_type() != lhs.element_type())
    return invalid("grouped_gemm_weight_grad: lhs and d_out must share one dtype of f32/bf16/f16");
  if (!to_dtype(d_rhs->element_type(), &out_dt))
    return invalid("grouped_gemm_weight_grad: output dtype must be float32/bfloat16/float16");
  auto ld = lhs.dimensions(), dd = d_out.dimensions(), gd = group_sizes.dimensions();
  auto od = d_rhs->dimensions();
  if (ld.size() < 2 || dd.size() != ld.size() || gd.size() != ld.size() - 1 || od.size() != ld.size() + 1)
    return invalid("grouped_gemm_weight_grad: expected lhs [..., M, K], d_out [..., M, N], group_sizes [..., G]");
  const int64_t rank = ld.size();
  const int64_t M = ld[rank - 2], K = ld[rank - 1], N = dd[rank - 1], G = gd[rank - 2];
  if (dd[rank - 2] != M || od[rank - 1] != K || od[rank] != N || od[rank - 2] != G)
    return invalid("grouped_gemm_weight_grad: shape mismatch between lhs, d_out and the result");
  const int64_t batch = leading_product(ld, 2);

  const char* lhs_p = static_cast<const char*>(lhs.untyped_data());
  const char* dout_p = static_cast<const char*>(d_out.untyped_data());
  char* out_p = static_cast<char*>(d_rhs->untyped_data());
  const int32_t* gs_p = group_sizes.typed_data();
  const int64_t in_w = byte_width(in_dt), out_w = byte_width(out_dt);

  std::vector<std::vector<int64_t>> starts(batch);
  for (int64_t b = 0; b < batch; ++b) starts[b] = group_starts(gs_p + b * G, G, M);
  const int64_t k_blocks = (K + kMC - 1) / kMC, n_blocks = (N + kNC - 1) / kNC;
  const int64_t per_group = k_blocks * n_blocks;
  parallel_for(&pool, batch * G * per_group, [&](int64_t item) {
    thread_local TileScratch scratch;
    const int64_t bg = item / per_group, b = bg / G, g = bg % G;
    const int64_t k0 = ((item % per_group) / n_blocks) * kMC, kc = std::min(kMC, K - k0);
    const int64_t n0 = (item % n_blocks) * kNC, nc = std::min(kNC, N - n0);
    const int64_t row0 = starts[b][g], rows = starts[b][g + 1] - row0;
    const char* a = lhs_p + b * M * K * in_w;
    const char* d = dout_p + b * M * N * in_w;
    // A(i, r) = lhs[row0 + r, k0 + i]: the group's rows are the reduction dim.
    auto pack_a = [&](int64_t r0, int64_t rc, float* dst) {
      pack_cols_as_panels(in_dt, a, K, row0 + r0, rc, k0, kc, kMR, dst);
    };
    auto pack_b = [&](int64_t r0, int64_t rc, float* dst) {
      pack_cols_as_panels(in_dt, d, N, row0 + r0, rc, n0, nc, kNR, dst);
    };
    gemm_block(kc, nc, rows, pack_a, pack_b, scratch);  // rows == 0 -> zeros (empty group)
    store_block(out_dt, scratch.c_block.data(), kc, nc, out_p + (b * G + g) * K * N * out_w, N, k0, n0);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace turbo_moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(turbo_moe_grouped_gemm, turbo_moe::GroupedGemmImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()                 // lhs [..., M, K]
                                  .Arg<xla::ffi::AnyBuffer>()                 // rhs [..., G, K, N] or [..., G, N, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()     // group_sizes [..., G]
                                  .Ret<xla::ffi::AnyBuffer>()                 // out [..., M, N]
                                  .Attr<bool>("transpose_rhs"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(turbo_moe_grouped_gemm_weight_grad, turbo_moe::GroupedGemmWeightGradImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()                 // lhs [..., M, K]
                                  .Arg<xla::ffi::AnyBuffer>()                 // d_out [..., M, N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()     // group_sizes [..., G]
                                  .Ret<xla::ffi::AnyBuffer>());               // d_rhs [..., G, K, N]
