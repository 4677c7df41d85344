// Contracts of turbo_moe_permute and turbo_moe_permute_rows (kernels/cpu/permute.cc, kernels/cuda/permute.cu):
//   permute:      x [..., T, H], expert_ids [..., T, k] int32
//                   -> x_sorted [..., T*k, H] like x, group_sizes [..., E] int32, row_index [..., T, k] int32,
//                      workspace (the CUDA handler's; the CPU one ignores it)
//   permute_rows: x [..., T, H], row_index [..., T, k] int32, group_sizes [..., E] int32 -> x_sorted [..., T*k, H]
#pragma once

#include "contract.h"

namespace turbo_moe {

// The CUDA counting sort keeps a histogram of E + 1 buckets and a chunk of ids in 48 KB of shared memory.
constexpr int64_t kPermuteMaxExperts = 8192;

struct PermuteDims {
  int64_t batch, T, H, k, E;
  int64_t slots;  // T * k: rows of x_sorted per problem
};

inline ffi::ErrorOr<PermuteDims> check_permute(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> expert_ids,
                                               ffi::AnyBuffer x_sorted, ffi::Buffer<ffi::S32> group_sizes,
                                               ffi::Buffer<ffi::S32> row_index, int64_t num_experts) {
  if (!is_float_type(x.element_type()) || x_sorted.element_type() != x.element_type())
    return refuse("permute: x must be float32/bfloat16/float16 and x_sorted the same dtype");
  auto xd = x.dimensions(), id = expert_ids.dimensions();
  if (xd.size() < 2 || id.size() != xd.size()) return refuse("permute: expected x [..., T, H] and expert_ids [..., T, k]");
  const int64_t rank = xd.size(), lead = rank - 2;
  const int64_t T = xd[rank - 2], H = xd[rank - 1], k = id[rank - 1], E = num_experts;
  if (!has_shape(id, xd, lead, {T, k})) return refuse("permute: expert_ids must have T rows like x");
  if (E <= 0) return refuse("permute: num_experts must be positive");
  if (E > kPermuteMaxExperts) return refuse("permute: num_experts must be <= 8192");
  if (T * k >= kInt32Rows) return refuse("permute: T * k must be < 2^31");
  if (!has_shape(x_sorted.dimensions(), xd, lead, {T * k, H}) || !has_shape(group_sizes.dimensions(), xd, lead, {E}) ||
      !has_shape(row_index.dimensions(), xd, lead, {T, k}))
    return refuse("permute: expected results x_sorted [..., T*k, H], group_sizes [..., num_experts], row_index [..., T, k]");
  return PermuteDims{leading_product(xd, 2), T, H, k, E, T * k};
}

inline ffi::ErrorOr<PermuteDims> check_permute_rows(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> row_index,
                                                    ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer x_sorted) {
  if (!is_float_type(x.element_type()) || x_sorted.element_type() != x.element_type())
    return refuse("permute_rows: x must be float32/bfloat16/float16 and x_sorted the same dtype");
  auto xd = x.dimensions(), rd = row_index.dimensions(), gd = group_sizes.dimensions();
  if (xd.size() < 2 || rd.size() != xd.size() || gd.size() + 1 != xd.size())
    return refuse("permute_rows: expected x [..., T, H], row_index [..., T, k] and group_sizes [..., E]");
  const int64_t rank = xd.size(), lead = rank - 2;
  const int64_t T = xd[rank - 2], H = xd[rank - 1], k = rd[rank - 1], E = gd[rank - 2];
  if (!has_shape(rd, xd, lead, {T, k})) return refuse("permute_rows: row_index must have T rows like x");
  if (!has_shape(gd, xd, lead, {E})) return refuse("permute_rows: group_sizes must share x's leading (vmap) dims");
  if (T * k >= kInt32Rows) return refuse("permute_rows: T * k must be < 2^31");
  if (!has_shape(x_sorted.dimensions(), xd, lead, {T * k, H}))
    return refuse("permute_rows: x_sorted must be [..., T*k, H]");
  return PermuteDims{leading_product(xd, 2), T, H, k, E, T * k};
}

template <typename Binding>
auto permute_signature(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()             // x [..., T, H]
      .template Arg<ffi::Buffer<ffi::S32>>()               // expert_ids [..., T, k]
      .template Ret<ffi::AnyBuffer>()                      // x_sorted [..., T*k, H]
      .template Ret<ffi::Buffer<ffi::S32>>()               // group_sizes [..., E]
      .template Ret<ffi::Buffer<ffi::S32>>()               // row_index [..., T, k]
      .template Ret<ffi::AnyBuffer>()                      // workspace [..., bytes] uint8 (CPU: unused, may be empty)
      .template Attr<int64_t>("num_experts")
      .template Attr<bool>("zero_tail");                   // false: rows past the groups unwritten (CPU: NaN)
}

template <typename Binding>
auto permute_rows_signature(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()             // x [..., T, H]
      .template Arg<ffi::Buffer<ffi::S32>>()               // row_index [..., T, k]
      .template Arg<ffi::Buffer<ffi::S32>>()               // group_sizes [..., E]
      .template Ret<ffi::AnyBuffer>()                      // x_sorted [..., T*k, H]
      .template Attr<bool>("zero_tail");                   // false: rows past the groups unwritten (CPU: NaN)
}

}  // namespace turbo_moe
