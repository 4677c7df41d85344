// The compute of the grouped GEMM handlers: packing (dtype -> float32 panels), the micro-kernel and
// the store, for one work item. Compiled once per ISA variant (isa.h, CMakeLists.txt): with the
// library's baseline flags as gemm_kernels_base, and on x86-64 also with -march=x86-64-v3 / -v4 as
// gemm_kernels_x86_64_v3 / _v4. Keep the includes to ffi-free headers whose code is in the
// TURBO_MOE_ISA namespace (isa.h says why).
#include <cstdint>
#include <cstring>

#include "convert.h"
#include "gemm_kernels.h"
#include "gemm_tile.h"

namespace turbo_moe {
inline namespace TURBO_MOE_ISA {
namespace {

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

void fwd_item(const GemmFwdArgs& x, int64_t item, const GemmScratch& scratch) {
  const TilePanels s{scratch.a_pack, scratch.b_pack, scratch.c_block};
  const int64_t M = x.M, K = x.K, N = x.N, G = x.G;
  const int64_t in_w = byte_width(x.in_dt), out_w = byte_width(x.out_dt);
  const GemmTile& t = x.tiles[item / x.n_blocks];
  const int64_t col0 = (item % x.n_blocks) * kNC, cols = imin(kNC, N - col0);
  const char* a = x.lhs + t.batch * M * K * in_w;
  const char* w = x.rhs + (t.batch * G + t.group) * K * N * in_w;
  const Dtype dt = x.in_dt;
  auto pack_a = [&](int64_t k0, int64_t kc, float* dst) {
    pack_rows_as_panels(dt, a, K, t.row0, t.rows, k0, kc, kMR, dst);
  };
  auto pack_b = [&](int64_t k0, int64_t kc, float* dst) {
    if (x.transpose_rhs)  // w is (N, K): columns of B are rows of w
      pack_rows_as_panels(dt, w, K, col0, cols, k0, kc, kNR, dst);
    else                  // w is (K, N)
      pack_cols_as_panels(dt, w, N, k0, kc, col0, cols, kNR, dst);
  };
  gemm_block(t.rows, cols, K, pack_a, pack_b, s);
  store_block(x.out_dt, s.c_block, t.rows, cols, x.out + t.batch * M * N * out_w, N, t.row0, col0);
}

void wgrad_item(const GemmWgradArgs& x, int64_t item, const GemmScratch& scratch) {
  const TilePanels s{scratch.a_pack, scratch.b_pack, scratch.c_block};
  const int64_t M = x.M, K = x.K, N = x.N, G = x.G;
  const int64_t in_w = byte_width(x.in_dt), out_w = byte_width(x.out_dt);
  const int64_t per_group = x.k_blocks * x.n_blocks;
  const int64_t bg = item / per_group, b = bg / G, g = bg % G;
  const int64_t k0 = ((item % per_group) / x.n_blocks) * kMC, kc = imin(kMC, K - k0);
  const int64_t n0 = (item % x.n_blocks) * kNC, nc = imin(kNC, N - n0);
  const int64_t* starts = x.starts + b * (G + 1);
  const int64_t row0 = starts[g], rows = starts[g + 1] - row0;
  const char* a = x.lhs + b * M * K * in_w;
  const char* d = x.d_out + b * M * N * in_w;
  const Dtype dt = x.in_dt;
  // A(i, r) = lhs[row0 + r, k0 + i]: the group's rows are the reduction dim.
  auto pack_a = [&](int64_t r0, int64_t rc, float* dst) {
    pack_cols_as_panels(dt, a, K, row0 + r0, rc, k0, kc, kMR, dst);
  };
  auto pack_b = [&](int64_t r0, int64_t rc, float* dst) {
    pack_cols_as_panels(dt, d, N, row0 + r0, rc, n0, nc, kNR, dst);
  };
  gemm_block(kc, nc, rows, pack_a, pack_b, s);  // rows == 0 -> zeros (empty group)
  store_block(x.out_dt, s.c_block, kc, nc, x.out + (b * G + g) * K * N * out_w, N, k0, n0);
}

}  // namespace
}  // namespace TURBO_MOE_ISA

#define TURBO_MOE_ISA_NAME_base "base"
#define TURBO_MOE_ISA_NAME_x86_64_v3 "x86-64-v3"
#define TURBO_MOE_ISA_NAME_x86_64_v4 "x86-64-v4"

extern const GemmKernels TURBO_MOE_CAT(gemm_kernels_, TURBO_MOE_ISA) = {
    TURBO_MOE_CAT(TURBO_MOE_ISA_NAME_, TURBO_MOE_ISA),
    kMC, kNC, kMC * kKC, kNC * kKC, kMC * kNC,
    &fwd_item, &wgrad_item,
};

}  // namespace turbo_moe
