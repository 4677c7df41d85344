// Contracts of turbo_moe_grouped_gemm and turbo_moe_grouped_gemm_weight_grad (kernels/cpu/grouped_gemm.cc,
// kernels/cuda/grouped_gemm.cu), the semantics of jax.lax.ragged_dot:
//   forward:     lhs [..., M, K], rhs [..., G, K, N] or [..., G, N, K] (transpose_rhs), group_sizes [..., G] int32
//                  -> out [..., M, N], workspace (the CUDA handler's; the CPU one ignores it)
//   weight grad: lhs [..., M, K], d_out [..., M, N], group_sizes [..., G] int32 -> d_rhs [..., G, K, N], workspace
// lhs and rhs (d_out) share one float dtype; the result may have another.
#pragma once

#include "contract.h"

namespace turbo_moe {

struct GroupedGemmDims {
  int64_t batch, M, K, N, G;
};

inline ffi::ErrorOr<GroupedGemmDims> check_grouped_gemm(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                                                        ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer out,
                                                        bool transpose_rhs) {
  if (!is_float_type(lhs.element_type()) || rhs.element_type() != lhs.element_type())
    return refuse("grouped_gemm: lhs and rhs must share one dtype of float32/bfloat16/float16");
  if (!is_float_type(out.element_type())) return refuse("grouped_gemm: output dtype must be float32/bfloat16/float16");
  auto ld = lhs.dimensions(), rd = rhs.dimensions(), gd = group_sizes.dimensions(), od = out.dimensions();
  if (ld.size() < 2 || rd.size() != ld.size() + 1 || gd.size() != ld.size() - 1)
    return refuse("grouped_gemm: expected lhs [..., M, K], rhs [..., G, K, N], group_sizes [..., G]");
  const int64_t rank = ld.size();
  const int64_t M = ld[rank - 2], K = ld[rank - 1], G = rd[rank - 2];
  const int64_t N = transpose_rhs ? rd[rank - 1] : rd[rank];
  const int64_t rhs_k = transpose_rhs ? rd[rank] : rd[rank - 1];
  if (rhs_k != K || gd[rank - 2] != G)
    return refuse("grouped_gemm: contraction dim or group count mismatch between lhs, rhs, group_sizes");
  const int64_t batch = leading_product(ld, 2);
  if (leading_product(rd, 3) != batch || leading_product(gd, 1) != batch)
    return refuse("grouped_gemm: operands must share the same leading batch dims");
  if (static_cast<int64_t>(od.size()) != rank || od[rank - 2] != M || od[rank - 1] != N ||
      leading_product(od, 2) != batch)
    return refuse("grouped_gemm: out must be [..., M, N] for lhs [..., M, K] and rhs's N");
  if (M >= kInt32Rows) return refuse("grouped_gemm: M must be < 2^31");
  return GroupedGemmDims{batch, M, K, N, G};
}

inline ffi::ErrorOr<GroupedGemmDims> check_grouped_gemm_weight_grad(ffi::AnyBuffer lhs, ffi::AnyBuffer d_out,
                                                                    ffi::Buffer<ffi::S32> group_sizes,
                                                                    ffi::AnyBuffer d_rhs) {
  if (!is_float_type(lhs.element_type()) || d_out.element_type() != lhs.element_type())
    return refuse("grouped_gemm_weight_grad: lhs and d_out must share one dtype of f32/bf16/f16");
  if (!is_float_type(d_rhs.element_type()))
    return refuse("grouped_gemm_weight_grad: output dtype must be float32/bfloat16/float16");
  auto ld = lhs.dimensions(), dd = d_out.dimensions(), gd = group_sizes.dimensions(), od = d_rhs.dimensions();
  if (ld.size() < 2 || dd.size() != ld.size() || gd.size() != ld.size() - 1 || od.size() != ld.size() + 1)
    return refuse("grouped_gemm_weight_grad: expected lhs [..., M, K], d_out [..., M, N], group_sizes [..., G]");
  const int64_t rank = ld.size();
  const int64_t M = ld[rank - 2], K = ld[rank - 1], N = dd[rank - 1], G = gd[rank - 2];
  if (dd[rank - 2] != M || od[rank - 1] != K || od[rank] != N || od[rank - 2] != G)
    return refuse("grouped_gemm_weight_grad: shape mismatch between lhs, d_out and the result");
  const int64_t batch = leading_product(ld, 2);
  if (leading_product(dd, 2) != batch || leading_product(gd, 1) != batch || leading_product(od, 3) != batch)
    return refuse("grouped_gemm_weight_grad: operands must share the same leading batch dims");
  if (M >= kInt32Rows) return refuse("grouped_gemm_weight_grad: M must be < 2^31");
  return GroupedGemmDims{batch, M, K, N, G};
}

template <typename Binding>
auto grouped_gemm_signature(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()             // lhs [..., M, K]
      .template Arg<ffi::AnyBuffer>()                      // rhs [..., G, K, N] or [..., G, N, K]
      .template Arg<ffi::Buffer<ffi::S32>>()               // group_sizes [..., G]
      .template Ret<ffi::AnyBuffer>()                      // out [..., M, N]
      .template Ret<ffi::AnyBuffer>()                      // workspace [..., bytes] uint8 (CPU: unused, may be empty)
      .template Attr<bool>("transpose_rhs")
      .template Attr<bool>("zero_tail");                   // false: rows past the groups unwritten (CPU: NaN)
}

template <typename Binding>
auto grouped_gemm_weight_grad_signature(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()             // lhs [..., M, K]
      .template Arg<ffi::AnyBuffer>()                      // d_out [..., M, N]
      .template Arg<ffi::Buffer<ffi::S32>>()               // group_sizes [..., G]
      .template Ret<ffi::AnyBuffer>()                      // d_rhs [..., G, K, N]
      .template Ret<ffi::AnyBuffer>();                     // workspace [..., bytes] uint8 (CPU: unused, may be empty)
}

}  // namespace turbo_moe
