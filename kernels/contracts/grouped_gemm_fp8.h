// Contracts of turbo_moe_grouped_gemm_fp8 and turbo_moe_grouped_gemm_fp8_weight_grad (kernels/cuda/grouped_gemm_fp8.cu;
// the CPU runs the same math in jnp: turbo_moe/ops/grouped_gemm_fp8.py). FP8 E4M3 operands with DeepSeek-V3's
// fine-grained float32 scales; float32 accumulation, promoted (scaled and added) every 128 elements of the contraction.
//   rows:        lhs [M, K] e4m3, lhs_scale [M, K/128] f32 (one per row and 128-wide K block),
//                rhs [G, N, K] e4m3 (K contiguous), rhs_scale [G, K/128, N/128] f32 (one per 128x128 block),
//                group_sizes [G] int32 -> out [M, N] bf16 (rows past the groups zero), workspace
//   weight grad: lhs_t [K, P] e4m3, lhs_t_scale [P/128, K] f32, d_out_t [N, P] e4m3, d_out_t_scale [P/128, N] f32,
//                group_sizes [G] int32 -> d_rhs [G, K, N] bf16, workspace. P is the group-padded row layout: group g
//                starts at column sum_{h<g} ceil(size_h / 128) * 128, so every 128-row scale tile lies in one group;
//                `rows` (M) clamps the sizes as the forward does.
// The forward op is also the data gradient (out = d_out @ w^T: rhs = the quantised weights in their (G, K, N) layout).
#pragma once

#include "contract.h"

namespace turbo_moe {

constexpr int64_t kFp8Block = 128;  // the scale granularity along the contraction (and of weight blocks)

struct GroupedGemmFp8Dims {
  int64_t M, K, N, G, P;
};

inline bool shape_is(Dims dims, std::initializer_list<int64_t> shape) { return has_shape(dims, dims, 0, shape); }

inline bool is_e4m3(ffi::DataType t) { return t == ffi::DataType::F8E4M3FN; }

inline ffi::ErrorOr<GroupedGemmFp8Dims> check_grouped_gemm_fp8(ffi::AnyBuffer lhs, ffi::AnyBuffer lhs_scale,
                                                                ffi::AnyBuffer rhs, ffi::AnyBuffer rhs_scale,
                                                                ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer out) {
  if (!is_e4m3(lhs.element_type()) || !is_e4m3(rhs.element_type()))
    return refuse("grouped_gemm_fp8: lhs and rhs must be float8_e4m3fn");
  if (lhs_scale.element_type() != ffi::DataType::F32 || rhs_scale.element_type() != ffi::DataType::F32)
    return refuse("grouped_gemm_fp8: lhs_scale and rhs_scale must be float32");
  if (out.element_type() != ffi::DataType::BF16) return refuse("grouped_gemm_fp8: out must be bfloat16");
  auto ld = lhs.dimensions(), rd = rhs.dimensions(), gd = group_sizes.dimensions();
  if (ld.size() != 2 || rd.size() != 3 || gd.size() != 1)
    return refuse("grouped_gemm_fp8: expected lhs [M, K], rhs [G, N, K], group_sizes [G] (no batch dims)");
  const int64_t M = ld[0], K = ld[1], G = rd[0], N = rd[1];
  if (rd[2] != K || gd[0] != G)
    return refuse("grouped_gemm_fp8: rhs must be [G, N, K] for lhs [M, K], group_sizes [G]");
  if (K <= 0 || K % kFp8Block != 0 || N % kFp8Block != 0)
    return refuse("grouped_gemm_fp8: K and N must be positive multiples of 128 (the scale blocks)");
  if (!shape_is(lhs_scale.dimensions(), {M, K / kFp8Block}))
    return refuse("grouped_gemm_fp8: lhs_scale must be [M, K/128]");
  if (!shape_is(rhs_scale.dimensions(), {G, K / kFp8Block, N / kFp8Block}))
    return refuse("grouped_gemm_fp8: rhs_scale must be [G, K/128, N/128]");
  if (!shape_is(out.dimensions(), {M, N})) return refuse("grouped_gemm_fp8: out must be [M, N]");
  if (M >= kInt32Rows || K >= kInt32Rows || N >= kInt32Rows) return refuse("grouped_gemm_fp8: M, K, N must be < 2^31");
  return GroupedGemmFp8Dims{M, K, N, G, 0};
}

inline ffi::ErrorOr<GroupedGemmFp8Dims> check_grouped_gemm_fp8_weight_grad(
    ffi::AnyBuffer lhs_t, ffi::AnyBuffer lhs_t_scale, ffi::AnyBuffer d_out_t, ffi::AnyBuffer d_out_t_scale,
    ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer d_rhs, int64_t rows) {
  if (!is_e4m3(lhs_t.element_type()) || !is_e4m3(d_out_t.element_type()))
    return refuse("grouped_gemm_fp8_weight_grad: lhs_t and d_out_t must be float8_e4m3fn");
  if (lhs_t_scale.element_type() != ffi::DataType::F32 || d_out_t_scale.element_type() != ffi::DataType::F32)
    return refuse("grouped_gemm_fp8_weight_grad: the scales must be float32");
  if (d_rhs.element_type() != ffi::DataType::BF16)
    return refuse("grouped_gemm_fp8_weight_grad: d_rhs must be bfloat16");
  auto ld = lhs_t.dimensions(), dd = d_out_t.dimensions(), gd = group_sizes.dimensions();
  if (ld.size() != 2 || dd.size() != 2 || gd.size() != 1)
    return refuse("grouped_gemm_fp8_weight_grad: expected lhs_t [K, P], d_out_t [N, P], group_sizes [G]");
  const int64_t K = ld[0], P = ld[1], N = dd[0], G = gd[0];
  if (dd[1] != P) return refuse("grouped_gemm_fp8_weight_grad: lhs_t and d_out_t must share the padded rows P");
  if (P % kFp8Block != 0 || rows < 0 || P < rows + (kFp8Block - 1) * G)
    return refuse("grouped_gemm_fp8_weight_grad: P must be a multiple of 128 and >= rows + 127 * G");
  if (K % 16 != 0 || N % 16 != 0) return refuse("grouped_gemm_fp8_weight_grad: K and N must be multiples of 16");
  if (!shape_is(lhs_t_scale.dimensions(), {P / kFp8Block, K}) ||
      !shape_is(d_out_t_scale.dimensions(), {P / kFp8Block, N}))
    return refuse("grouped_gemm_fp8_weight_grad: scales must be [P/128, K] and [P/128, N]");
  if (!shape_is(d_rhs.dimensions(), {G, K, N})) return refuse("grouped_gemm_fp8_weight_grad: d_rhs must be [G, K, N]");
  if (P >= kInt32Rows || K >= kInt32Rows || N >= kInt32Rows)
    return refuse("grouped_gemm_fp8_weight_grad: P, K, N must be < 2^31");
  return GroupedGemmFp8Dims{rows, K, N, G, P};
}

template <typename Binding>
auto grouped_gemm_fp8_signature(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()   // lhs [M, K] e4m3
      .template Arg<ffi::AnyBuffer>()                        // lhs_scale [M, K/128] f32
      .template Arg<ffi::AnyBuffer>()                        // rhs [G, N, K] e4m3
      .template Arg<ffi::AnyBuffer>()                        // rhs_scale [G, K/128, N/128] f32
      .template Arg<ffi::Buffer<ffi::S32>>()                 // group_sizes [G]
      .template Ret<ffi::AnyBuffer>()                        // out [M, N] bf16
      .template Ret<ffi::AnyBuffer>();                       // workspace [bytes] uint8
}

template <typename Binding>
auto grouped_gemm_fp8_weight_grad_signature(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()   // lhs_t [K, P] e4m3
      .template Arg<ffi::AnyBuffer>()                        // lhs_t_scale [P/128, K] f32
      .template Arg<ffi::AnyBuffer>()                        // d_out_t [N, P] e4m3
      .template Arg<ffi::AnyBuffer>()                        // d_out_t_scale [P/128, N] f32
      .template Arg<ffi::Buffer<ffi::S32>>()                 // group_sizes [G]
      .template Ret<ffi::AnyBuffer>()                        // d_rhs [G, K, N] bf16
      .template Ret<ffi::AnyBuffer>()                        // workspace [bytes] uint8
      .template Attr<int64_t>("rows");                       // M: the sizes are clamped to it
}

}  // namespace turbo_moe
