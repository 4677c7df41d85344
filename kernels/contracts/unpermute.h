// Contracts of turbo_moe_unpermute and turbo_moe_unpermute_bwd (kernels/cpu/unpermute.cc, kernels/cuda/unpermute.cu):
//   unpermute:     y [..., R, H], row_index [..., T, k] int32, weights [..., T, k] float32 -> out [..., T, H] like y
//   unpermute_bwd: d_out [..., T, H] (any float dtype), y, row_index, weights
//                    -> d_y like y, d_weights like weights, workspace (the CUDA handler's; the CPU one ignores it)
#pragma once

#include <string>

#include "contract.h"

namespace turbo_moe {

struct UnpermuteDims {
  int64_t batch, R, H, T, k;
};

// The operands both handlers share; `op` names the handler in the message.
inline ffi::ErrorOr<UnpermuteDims> check_unpermute_operands(const char* op, ffi::AnyBuffer y,
                                                            ffi::Buffer<ffi::S32> row_index,
                                                            ffi::Buffer<ffi::F32> weights) {
  auto yd = y.dimensions(), rd = row_index.dimensions(), wd = weights.dimensions();
  if (yd.size() < 2 || rd.size() != yd.size() || wd.size() != yd.size())
    return refuse(std::string(op) + ": expected y [..., R, H], row_index [..., T, k], weights [..., T, k]");
  const int64_t rank = yd.size(), lead = rank - 2;
  const UnpermuteDims d{leading_product(yd, 2), yd[rank - 2], yd[rank - 1], rd[rank - 2], rd[rank - 1]};
  if (!same_dims(wd, rd)) return refuse(std::string(op) + ": weights must have the shape of row_index");
  if (!has_shape(rd, yd, lead, {d.T, d.k}))
    return refuse(std::string(op) + ": y and row_index must share leading (vmap) dims");
  if (d.batch * d.T >= kInt32Rows) return refuse(std::string(op) + ": batch * T must be < 2^31");
  return d;
}

inline ffi::ErrorOr<UnpermuteDims> check_unpermute(ffi::AnyBuffer y, ffi::Buffer<ffi::S32> row_index,
                                                   ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer out) {
  if (!is_float_type(y.element_type()) || out.element_type() != y.element_type())
    return refuse("unpermute: y must be float32/bfloat16/float16 and out the same dtype");
  auto d = check_unpermute_operands("unpermute", y, row_index, weights);
  if (!d) return d;
  if (!has_shape(out.dimensions(), y.dimensions(), y.dimensions().size() - 2, {d->T, d->H}))
    return refuse("unpermute: out must be [..., T, H]");
  return d;
}

inline ffi::ErrorOr<UnpermuteDims> check_unpermute_bwd(ffi::AnyBuffer d_out, ffi::AnyBuffer y,
                                                       ffi::Buffer<ffi::S32> row_index, ffi::Buffer<ffi::F32> weights,
                                                       ffi::AnyBuffer d_y, ffi::Buffer<ffi::F32> d_weights) {
  if (!is_float_type(y.element_type()) || d_y.element_type() != y.element_type() ||
      !is_float_type(d_out.element_type()))
    return refuse("unpermute_bwd: y/d_y and d_out must be float32/bfloat16/float16");
  auto d = check_unpermute_operands("unpermute_bwd", y, row_index, weights);
  if (!d) return d;
  if (d->batch * d->R >= kInt32Rows) return refuse("unpermute_bwd: batch * R must be < 2^31");
  if (!has_shape(d_out.dimensions(), y.dimensions(), y.dimensions().size() - 2, {d->T, d->H}))
    return refuse("unpermute_bwd: d_out must be [..., T, H]");
  if (!same_dims(d_y.dimensions(), y.dimensions()) || !same_dims(d_weights.dimensions(), weights.dimensions()))
    return refuse("unpermute_bwd: d_y must be shaped like y and d_weights like weights");
  return d;
}

template <typename Binding>
auto unpermute_signature(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()             // y [..., R, H]
      .template Arg<ffi::Buffer<ffi::S32>>()               // row_index [..., T, k]
      .template Arg<ffi::Buffer<ffi::F32>>()               // weights [..., T, k]
      .template Ret<ffi::AnyBuffer>();                     // out [..., T, H]
}

template <typename Binding>
auto unpermute_bwd_signature(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()             // d_out [..., T, H]
      .template Arg<ffi::AnyBuffer>()                      // y [..., R, H]
      .template Arg<ffi::Buffer<ffi::S32>>()               // row_index [..., T, k]
      .template Arg<ffi::Buffer<ffi::F32>>()               // weights [..., T, k]
      .template Ret<ffi::AnyBuffer>()                      // d_y [..., R, H]
      .template Ret<ffi::Buffer<ffi::F32>>()               // d_weights [..., T, k]
      .template Ret<ffi::AnyBuffer>();                     // workspace [..., bytes] uint8 (CPU: unused, may be empty)
}

}  // namespace turbo_moe
