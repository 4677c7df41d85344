// Contract of turbo_moe_grouped_gemm_swiglu (kernels/cpu/grouped_gemm_swiglu.cc, kernels/cuda/grouped_gemm_swiglu.cu):
//   the grouped GEMM's operands (grouped_gemm.h) -> h [..., M, 2F] (the GEMM's out), act [..., M, F] like h,
//   workspace (the grouped GEMM's).
#pragma once

#include "grouped_gemm.h"

namespace turbo_moe {

struct GroupedGemmSwigluDims {
  GroupedGemmDims gemm;  // gemm.N = 2F
  int64_t F;
};

inline ffi::ErrorOr<GroupedGemmSwigluDims> check_grouped_gemm_swiglu(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                                                                      ffi::Buffer<ffi::S32> group_sizes,
                                                                      ffi::AnyBuffer h, ffi::AnyBuffer act,
                                                                      bool transpose_rhs) {
  if (!is_float_type(h.element_type()) || act.element_type() != h.element_type())
    return refuse("grouped_gemm_swiglu: h and act must share one dtype of float32/bfloat16/float16");
  auto hd = h.dimensions(), ad = act.dimensions();
  const int64_t rank = hd.size();
  if (rank < 2 || ad.size() != hd.size()) return refuse("grouped_gemm_swiglu: expected h [..., M, 2F] and act [..., M, F]");
  const int64_t F = ad[rank - 1];
  for (int64_t i = 0; i + 1 < rank; ++i)
    if (ad[i] != hd[i]) return refuse("grouped_gemm_swiglu: h and act must share their leading dims");
  if (hd[rank - 1] != 2 * F) return refuse("grouped_gemm_swiglu: h must be [..., M, 2F] for act [..., M, F]");
  auto gemm = check_grouped_gemm(lhs, rhs, group_sizes, h, transpose_rhs);
  if (!gemm) return ffi::Unexpected<ffi::Error>(gemm.error());
  return GroupedGemmSwigluDims{*gemm, F};
}

template <typename Binding>
auto grouped_gemm_swiglu_signature(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()             // lhs [..., M, K]
      .template Arg<ffi::AnyBuffer>()                      // rhs [..., G, K, 2F] or [..., G, 2F, K]
      .template Arg<ffi::Buffer<ffi::S32>>()               // group_sizes [..., G]
      .template Ret<ffi::AnyBuffer>()                      // h [..., M, 2F]
      .template Ret<ffi::AnyBuffer>()                      // act [..., M, F]
      .template Ret<ffi::AnyBuffer>()                      // workspace [..., bytes] uint8 (CPU: unused, may be empty)
      .template Attr<bool>("transpose_rhs")
      .template Attr<bool>("zero_tail");                   // false: rows past the groups unwritten (CPU: NaN)
}

}  // namespace turbo_moe
