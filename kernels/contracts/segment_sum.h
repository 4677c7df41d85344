// Contract of turbo_moe_segment_sum (kernels/cpu/segment_sum.cc, kernels/cuda/segment_sum.cu):
//   data [..., N, D], sorted_ids [..., N] int32, order [..., N] int32 -> out [..., V, D] like data.
#pragma once

#include "contract.h"

namespace turbo_moe {

struct SegmentSumDims {
  int64_t batch, N, D, V;
};

inline ffi::ErrorOr<SegmentSumDims> check_segment_sum(ffi::AnyBuffer data, ffi::Buffer<ffi::S32> sorted_ids,
                                                      ffi::Buffer<ffi::S32> order, ffi::AnyBuffer out) {
  if (!is_float_type(data.element_type()) || out.element_type() != data.element_type())
    return refuse("segment_sum: data must be float32/bfloat16/float16 and out the same dtype");
  auto dd = data.dimensions(), sd = sorted_ids.dimensions(), od = order.dimensions(), outd = out.dimensions();
  const int64_t rank = dd.size();
  if (rank < 2 || static_cast<int64_t>(sd.size()) != rank - 1 || static_cast<int64_t>(od.size()) != rank - 1 ||
      static_cast<int64_t>(outd.size()) != rank)
    return refuse("segment_sum: expected data [..., N, D], sorted_ids and order [..., N], out [..., V, D]");
  const int64_t N = dd[rank - 2], D = dd[rank - 1], V = outd[rank - 2];
  if (sd[rank - 2] != N || od[rank - 2] != N || outd[rank - 1] != D)
    return refuse("segment_sum: sorted_ids and order must have data's N rows, out data's D columns");
  if (!has_shape(sd, dd, rank - 2, {N}) || !has_shape(od, dd, rank - 2, {N}) || !has_shape(outd, dd, rank - 2, {V, D}))
    return refuse("segment_sum: data, sorted_ids, order and out must share leading (vmap) dims");
  if (N >= kInt32Rows || V >= kInt32Rows) return refuse("segment_sum: N and V must be < 2^31");
  const int64_t batch = leading_product(dd, 2);
  if (batch > 65535)  // the CUDA grid's z dimension
    return refuse("segment_sum: at most 65535 leading (batch) problems");
  return SegmentSumDims{batch, N, D, V};
}

template <typename Binding>
auto segment_sum_signature(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()             // data [..., N, D]
      .template Arg<ffi::Buffer<ffi::S32>>()               // sorted_ids [..., N], ascending
      .template Arg<ffi::Buffer<ffi::S32>>()               // order [..., N]: row of data
      .template Ret<ffi::AnyBuffer>();                     // out [..., V, D]
}

}  // namespace turbo_moe
