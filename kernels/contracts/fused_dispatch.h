// Contracts of turbo_moe_fused_dispatch_pack and turbo_moe_fused_dispatch_land (kernels/cpu/fused_dispatch.cc; the
// CUDA transport of docs/notes/ep-transport.md is to call the same checks). One rank's call, no leading batch dims:
//   pack: x [T, H], expert_ids [T, k] int32 (global; -1 none), weights [T, k] float32, slot [T, P] int32,
//         dest_base [P, El] int32  -> send_x [P, C, H] like x, send_rows [P, C, k] int32, send_w [P, C, k] float32
//         attr recv_rows: rows R of every receiver's expert-sorted buffer (destination rows >= R are lost)
//   land: recv_x [N, H], recv_rows [N, k] int32 -> x_sorted [R, H] like recv_x
// turbo_moe/ops/fused_dispatch.py computes slot and dest_base (the layout and the notify) and must agree with these.
#pragma once

#include "contract.h"

namespace turbo_moe {

struct FusedPackDims {
  int64_t T, H, k, P, El, C, R;
};

inline ffi::ErrorOr<FusedPackDims> check_fused_dispatch_pack(
    ffi::AnyBuffer x, ffi::Buffer<ffi::S32> expert_ids, ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> slot,
    ffi::Buffer<ffi::S32> dest_base, ffi::AnyBuffer send_x, ffi::Buffer<ffi::S32> send_rows,
    ffi::Buffer<ffi::F32> send_w, int64_t recv_rows) {
  if (!is_float_type(x.element_type()) || send_x.element_type() != x.element_type())
    return refuse("fused_dispatch_pack: x must be float32/bfloat16/float16 and send_x the same dtype");
  auto xd = x.dimensions(), id = expert_ids.dimensions(), sd = slot.dimensions(), bd = dest_base.dimensions();
  if (xd.size() != 2 || id.size() != 2 || sd.size() != 2 || bd.size() != 2)
    return refuse("fused_dispatch_pack: expected x [T, H], expert_ids [T, k], slot [T, P], dest_base [P, El]");
  const int64_t T = xd[0], H = xd[1], k = id[1], P = bd[0], El = bd[1];
  if (id[0] != T || !same_dims(weights.dimensions(), id) || sd[0] != T || sd[1] != P)
    return refuse("fused_dispatch_pack: expert_ids and weights must be [T, k], slot [T, P] with dest_base's P");
  if (P <= 0 || El <= 0 || P * El >= kInt32Rows)
    return refuse("fused_dispatch_pack: dest_base [P, El] needs P, El > 0 and P * El < 2^31");
  auto xs = send_x.dimensions();
  const int64_t C = xs.size() == 3 ? xs[1] : -1;
  if (!has_shape(xs, xd, 0, {P, C, H}) || !has_shape(send_rows.dimensions(), xd, 0, {P, C, k}) ||
      !has_shape(send_w.dimensions(), xd, 0, {P, C, k}))
    return refuse("fused_dispatch_pack: expected results send_x [P, C, H], send_rows and send_w [P, C, k]");
  if (P * C * k >= kInt32Rows || recv_rows < 0 || recv_rows >= kInt32Rows)
    return refuse("fused_dispatch_pack: P * C * k and recv_rows must be in [0, 2^31)");
  return FusedPackDims{T, H, k, P, El, C, recv_rows};
}

struct FusedLandDims {
  int64_t N, H, k, R;
};

inline ffi::ErrorOr<FusedLandDims> check_fused_dispatch_land(ffi::AnyBuffer recv_x, ffi::Buffer<ffi::S32> recv_rows,
                                                             ffi::AnyBuffer x_sorted) {
  if (!is_float_type(recv_x.element_type()) || x_sorted.element_type() != recv_x.element_type())
    return refuse("fused_dispatch_land: recv_x must be float32/bfloat16/float16 and x_sorted the same dtype");
  auto xd = recv_x.dimensions(), rd = recv_rows.dimensions(), od = x_sorted.dimensions();
  if (xd.size() != 2 || rd.size() != 2 || od.size() != 2 || rd[0] != xd[0] || od[1] != xd[1])
    return refuse("fused_dispatch_land: expected recv_x [N, H], recv_rows [N, k], x_sorted [R, H]");
  if (od[0] >= kInt32Rows || xd[0] * rd[1] >= kInt32Rows)
    return refuse("fused_dispatch_land: R and N * k must be < 2^31");
  return FusedLandDims{xd[0], xd[1], rd[1], od[0]};
}

template <typename Binding>
auto fused_dispatch_pack_signature(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // x [T, H]
      .template Arg<ffi::Buffer<ffi::S32>>()                 // expert_ids [T, k] (global, -1: none)
      .template Arg<ffi::Buffer<ffi::F32>>()                 // weights [T, k]
      .template Arg<ffi::Buffer<ffi::S32>>()                 // slot [T, P] (packet slot at each rank, -1: none)
      .template Arg<ffi::Buffer<ffi::S32>>()                 // dest_base [P, El] (my first row in each group)
      .template Ret<ffi::AnyBuffer>()                        // send_x [P, C, H]
      .template Ret<ffi::Buffer<ffi::S32>>()                 // send_rows [P, C, k] (receiver's rows, -1: none)
      .template Ret<ffi::Buffer<ffi::F32>>()                 // send_w [P, C, k]
      .template Attr<int64_t>("recv_rows");
}

template <typename Binding>
auto fused_dispatch_land_signature(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // recv_x [N, H] (packets received, source-major)
      .template Arg<ffi::Buffer<ffi::S32>>()                 // recv_rows [N, k] (row of x_sorted, -1: none)
      .template Ret<ffi::AnyBuffer>();                       // x_sorted [R, H]
}

}  // namespace turbo_moe
