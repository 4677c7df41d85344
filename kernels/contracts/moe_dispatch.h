// Contract of turbo_moe_dispatch_pack (kernels/cpu/moe_dispatch.cc, kernels/cuda/moe_dispatch.cu):
//   x [..., T, H], expert_ids [..., T, k] int32, weights [..., T, k] float32
//     -> send_x [..., P, C, H] like x, send_ids [..., P, C, k] int32, send_w [..., P, C, k] float32,
//        counts [..., P] int32, overflow [..., P] int32, slot [..., T, P] int32
#pragma once

#include "contract.h"

namespace turbo_moe {

struct DispatchPackDims {
  int64_t batch, T, H, k;
  int64_t P, El, C;  // ranks, experts per rank, slots per rank
};

inline ffi::ErrorOr<DispatchPackDims> check_dispatch_pack(
    ffi::AnyBuffer x, ffi::Buffer<ffi::S32> expert_ids, ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer send_x,
    ffi::Buffer<ffi::S32> send_ids, ffi::Buffer<ffi::F32> send_w, ffi::Buffer<ffi::S32> counts,
    ffi::Buffer<ffi::S32> overflow, ffi::Buffer<ffi::S32> slot, int64_t num_ranks, int64_t experts_per_rank,
    int64_t capacity) {
  if (!is_float_type(x.element_type()) || send_x.element_type() != x.element_type())
    return refuse("dispatch_pack: x must be float32/bfloat16/float16 and send_x the same dtype");
  auto xd = x.dimensions(), id = expert_ids.dimensions(), wd = weights.dimensions();
  if (xd.size() < 2 || id.size() != xd.size() || wd.size() != xd.size())
    return refuse("dispatch_pack: expected x [..., T, H], expert_ids and weights [..., T, k]");
  const int64_t rank = xd.size(), lead = rank - 2;
  const int64_t T = xd[rank - 2], H = xd[rank - 1], k = id[rank - 1];
  const int64_t P = num_ranks, El = experts_per_rank, C = capacity;
  if (!has_shape(id, xd, lead, {T, k}) || !has_shape(wd, xd, lead, {T, k}))
    return refuse("dispatch_pack: expert_ids and weights must both be [..., T, k] with x's T");
  if (P <= 0 || El <= 0 || C < 0) return refuse("dispatch_pack: num_ranks, experts_per_rank > 0, capacity >= 0");
  if (P * El >= kInt32Rows) return refuse("dispatch_pack: num_ranks * experts_per_rank must be < 2^31");
  if (!has_shape(send_x.dimensions(), xd, lead, {P, C, H}) || !has_shape(send_ids.dimensions(), xd, lead, {P, C, k}) ||
      !has_shape(send_w.dimensions(), xd, lead, {P, C, k}) || !has_shape(counts.dimensions(), xd, lead, {P}) ||
      !has_shape(overflow.dimensions(), xd, lead, {P}) || !has_shape(slot.dimensions(), xd, lead, {T, P}))
    return refuse("dispatch_pack: expected results send_x [..., P, C, H], send_ids and send_w [..., P, C, k], "
                  "counts and overflow [..., P], slot [..., T, P]");
  return DispatchPackDims{leading_product(xd, 2), T, H, k, P, El, C};
}

template <typename Binding>
auto dispatch_pack_signature(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()             // x [..., T, H]
      .template Arg<ffi::Buffer<ffi::S32>>()               // expert_ids [..., T, k] (global)
      .template Arg<ffi::Buffer<ffi::F32>>()               // weights [..., T, k]
      .template Ret<ffi::AnyBuffer>()                      // send_x [..., P, C, H]
      .template Ret<ffi::Buffer<ffi::S32>>()               // send_ids [..., P, C, k] (local, -1)
      .template Ret<ffi::Buffer<ffi::F32>>()               // send_w [..., P, C, k]
      .template Ret<ffi::Buffer<ffi::S32>>()               // counts [..., P]
      .template Ret<ffi::Buffer<ffi::S32>>()               // overflow [..., P]
      .template Ret<ffi::Buffer<ffi::S32>>()               // slot [..., T, P] (-1: not sent)
      .template Attr<int64_t>("num_ranks")
      .template Attr<int64_t>("experts_per_rank")
      .template Attr<int64_t>("capacity");
}

}  // namespace turbo_moe
