// CPU FFI handlers of the grouped GEMM (the semantics of jax.lax.ragged_dot):
//   turbo_moe_grouped_gemm:             out[r] = lhs[r] @ rhs[g(r)]         (M,K) x (G,K,N)|(G,N,K) -> (M,N)
//   turbo_moe_grouped_gemm_weight_grad: dw[g]  = lhs[rows_g]^T @ d_out[rows_g]  (M,K),(M,N) -> (G,K,N)
// Optional leading batch dims (vmap) are shared by all operands. Accumulation is float32; the
// work is split into (group, row block, column block) tiles run on XLA's intra-op thread pool; the
// compute of one tile is in gemm_kernels.cc, compiled per ISA and picked at run time (dispatch.cc).
// Each output element is produced by one tile with a fixed summation order: deterministic.
#include "grouped_gemm.h"

#include "gemm_kernels.h"

namespace turbo_moe {
namespace {

// One float32 scratch per worker thread, sized for the variant in use (fixed for the process).
const GemmScratch& thread_scratch(const GemmKernels& k) {
  thread_local std::vector<float> a_pack(k.a_pack_floats), b_pack(k.b_pack_floats),
      c_block(k.c_block_floats);
  thread_local GemmScratch s{a_pack.data(), b_pack.data(), c_block.data()};
  return s;
}

}  // namespace

ffi::Error run_grouped_gemm(ffi::ThreadPool* pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                            ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer out, bool transpose_rhs, bool zero_tail,
                            std::vector<int64_t>* totals_out) {
  Dtype in_dt, out_dt;
  if (!to_dtype(lhs.element_type(), &in_dt) || rhs.element_type() != lhs.element_type())
    return invalid("grouped_gemm: lhs and rhs must share one dtype of float32/bfloat16/float16");
  if (!to_dtype(out.element_type(), &out_dt))
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
  char* out_p = static_cast<char*>(out.untyped_data());
  const int32_t* gs_p = group_sizes.typed_data();
  const int64_t out_w = byte_width(out_dt);

  const GemmKernels& kern = gemm_kernels();
  std::vector<GemmTile> tiles;
  std::vector<int64_t> totals(batch);
  for (int64_t b = 0; b < batch; ++b) {
    auto starts = group_starts(gs_p + b * G, G, M);
    totals[b] = starts[G];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = starts[g]; r < starts[g + 1]; r += kern.mc)
        tiles.push_back({b, g, r, std::min(kern.mc, starts[g + 1] - r)});
  }
  const int64_t n_blocks = (N + kern.nc - 1) / kern.nc;
  const GemmFwdArgs args{in_dt, out_dt, lhs_p, rhs_p, out_p, M, K, N, G, transpose_rhs, tiles.data(), n_blocks};
  parallel_for(pool, static_cast<int64_t>(tiles.size()) * n_blocks, [&](int64_t item) {
    kern.fwd_item(args, item, thread_scratch(kern));
  });
  // Rows that belong to no group: zero, or NaN where the caller promised not to read them.
  for (int64_t b = 0; b < batch; ++b)
    std::memset(out_p + (b * M + totals[b]) * N * out_w, tail_fill(zero_tail), (M - totals[b]) * N * out_w);
  if (totals_out) *totals_out = totals;
  return ffi::Error::Success();
}

namespace {

ffi::Error GroupedGemmImpl(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> /*workspace: the CUDA handler's, unused here*/,
                           bool transpose_rhs, bool zero_tail) {
  return run_grouped_gemm(&pool, lhs, rhs, group_sizes, *out, transpose_rhs, zero_tail);
}

ffi::Error GroupedGemmWeightGradImpl(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer d_out,
                                     ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> d_rhs,
                                     ffi::Result<ffi::AnyBuffer> /*workspace: the CUDA handler's, unused here*/) {
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

  const GemmKernels& kern = gemm_kernels();
  std::vector<int64_t> starts;
  starts.reserve(batch * (G + 1));
  for (int64_t b = 0; b < batch; ++b) {
    auto s = group_starts(gs_p + b * G, G, M);
    starts.insert(starts.end(), s.begin(), s.end());
  }
  const int64_t k_blocks = (K + kern.mc - 1) / kern.mc, n_blocks = (N + kern.nc - 1) / kern.nc;
  const GemmWgradArgs args{in_dt, out_dt, lhs_p, dout_p, out_p, M, K, N, G, starts.data(), k_blocks, n_blocks};
  parallel_for(&pool, batch * G * k_blocks * n_blocks, [&](int64_t item) {
    kern.wgrad_item(args, item, thread_scratch(kern));
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
                                  .Ret<xla::ffi::AnyBuffer>()                 // workspace (CUDA only; may be empty)
                                  .Attr<bool>("transpose_rhs")
                                  .Attr<bool>("zero_tail"));                  // false: rows past the groups NaN

XLA_FFI_DEFINE_HANDLER_SYMBOL(turbo_moe_grouped_gemm_weight_grad, turbo_moe::GroupedGemmWeightGradImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()                 // lhs [..., M, K]
                                  .Arg<xla::ffi::AnyBuffer>()                 // d_out [..., M, N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()     // group_sizes [..., G]
                                  .Ret<xla::ffi::AnyBuffer>()                 // d_rhs [..., G, K, N]
                                  .Ret<xla::ffi::AnyBuffer>());               // workspace (CUDA only; may be empty)
