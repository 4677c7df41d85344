// Contract of turbo_moe_swiglu_combine_grad and turbo_moe_swiglu_combine_grad_fp8 (kernels/cpu/swiglu_combine_grad.cc,
// kernels/cuda/swiglu_combine_grad.cu):
//   h [..., M, 2F], g [..., M, F], w [..., M] float32, valid [...] int32 -> d_h like h, d_w like w, act_w like g;
//   the _fp8 target also d_h_q [..., M, 2F] float8_e4m3fn or float8_e5m2 (its dtype picks the format) and
//   d_h_scale [..., M, 2F/128] float32: d_h quantised per 1x128 tile along its 2F columns, bit for bit the row
//   quantiser's (kernels/contracts/quantize_rows.h) of d_h; 2F a positive multiple of 128 (F % 128 == 64 puts one
//   tile across the [d_gate | d_up] boundary).
#pragma once

#include <algorithm>
#include <string>

#include "contract.h"

namespace turbo_moe {

constexpr int64_t kSwigluGradTile = 128;  // d_h_q's scale tile along 2F

struct SwigluCombineGradDims {
  int64_t rows;  // every leading dim and M
  int64_t M;     // rows of one problem (valid counts per problem)
  int64_t F;
  bool e4m3 = true;  // the _fp8 target's format: float8_e4m3fn, else float8_e5m2
};

inline ffi::ErrorOr<SwigluCombineGradDims> check_swiglu_combine_grad(ffi::AnyBuffer h, ffi::AnyBuffer g,
                                                                      ffi::Buffer<ffi::F32> w,
                                                                      ffi::Buffer<ffi::S32> valid, ffi::AnyBuffer d_h,
                                                                      ffi::Buffer<ffi::F32> d_w,
                                                                      ffi::AnyBuffer act_w) {
  if (!is_float_type(h.element_type()) || g.element_type() != h.element_type() ||
      d_h.element_type() != h.element_type() || act_w.element_type() != h.element_type())
    return refuse("swiglu_combine_grad: h, g, d_h and act_w must share one dtype of float32/bfloat16/float16");
  auto hd = h.dimensions(), gd = g.dimensions(), wd = w.dimensions();
  const int64_t rank = hd.size();
  if (rank < 1 || static_cast<int64_t>(gd.size()) != rank || static_cast<int64_t>(wd.size()) != rank - 1)
    return refuse("swiglu_combine_grad: expected h [..., 2F], g [..., F] and w [...]");
  const int64_t F = gd[rank - 1];
  for (int64_t i = 0; i + 1 < rank; ++i)
    if (gd[i] != hd[i] || wd[i] != hd[i]) return refuse("swiglu_combine_grad: h, g and w must share leading dims");
  if (hd[rank - 1] != 2 * F) return refuse("swiglu_combine_grad: h must be [..., 2F] for g [..., F]");
  if (!same_dims(act_w.dimensions(), gd)) return refuse("swiglu_combine_grad: act_w must be [..., F] like g");
  if (!same_dims(d_h.dimensions(), hd) || !same_dims(d_w.dimensions(), wd))
    return refuse("swiglu_combine_grad: d_h must be shaped like h and d_w like w");
  if (rank < 2 || static_cast<int64_t>(valid.dimensions().size()) != rank - 2 ||
      !std::equal(valid.dimensions().begin(), valid.dimensions().end(), hd.begin()))
    return refuse("swiglu_combine_grad: expected valid [...] (rows to compute of each [M, 2F] problem of h)");
  const int64_t rows = leading_product(hd, 1);
  if (rows >= (int64_t{1} << 36))  // the CUDA grid: a warp per row
    return refuse("swiglu_combine_grad: too many rows: h must have < 2^36 rows (leading dims x M)");
  return SwigluCombineGradDims{rows, hd[rank - 2], F};
}

// The _fp8 target: the checks above, then 2F a positive multiple of 128 and the quantised results' shapes.
inline ffi::ErrorOr<SwigluCombineGradDims> check_swiglu_combine_grad_fp8(
    ffi::AnyBuffer h, ffi::AnyBuffer g, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> valid, ffi::AnyBuffer d_h,
    ffi::Buffer<ffi::F32> d_w, ffi::AnyBuffer act_w, ffi::AnyBuffer d_h_q, ffi::AnyBuffer d_h_scale) {
  auto dims = check_swiglu_combine_grad(h, g, w, valid, d_h, d_w, act_w);
  if (!dims) return dims;
  const ffi::DataType qt = d_h_q.element_type();
  if (qt != ffi::DataType::F8E4M3FN && qt != ffi::DataType::F8E5M2)
    return refuse("swiglu_combine_grad_fp8: d_h_q must be float8_e4m3fn or float8_e5m2");
  if (d_h_scale.element_type() != ffi::DataType::F32)
    return refuse("swiglu_combine_grad_fp8: d_h_scale must be float32");
  auto hd = h.dimensions();
  const int64_t rank = hd.size(), two_f = 2 * dims->F;
  if (two_f <= 0 || two_f % kSwigluGradTile != 0)
    return refuse("swiglu_combine_grad_fp8: h's 2F must be a positive multiple of 128 (the FP8 scale tiles), got 2F=" +
                  std::to_string(two_f));
  if (!same_dims(d_h_q.dimensions(), hd) ||
      !has_shape(d_h_scale.dimensions(), hd, rank - 2, {hd[rank - 2], two_f / kSwigluGradTile}))
    return refuse("swiglu_combine_grad_fp8: expected results d_h_q [..., M, 2F] and d_h_scale [..., M, 2F/128]");
  dims->e4m3 = qt == ffi::DataType::F8E4M3FN;
  return dims;
}

template <typename Binding>
auto swiglu_combine_grad_signature(Binding&& binding) {  // a reference: the _fp8 signature extends it
  return std::move(binding).template Arg<ffi::AnyBuffer>()             // h [..., 2F]
      .template Arg<ffi::AnyBuffer>()                      // g [..., F]
      .template Arg<ffi::Buffer<ffi::F32>>()               // w [..., M]
      .template Arg<ffi::Buffer<ffi::S32>>()               // valid [...]: rows to compute
      .template Ret<ffi::AnyBuffer>()                      // d_h [..., 2F]
      .template Ret<ffi::Buffer<ffi::F32>>()               // d_w [...]
      .template Ret<ffi::AnyBuffer>();                     // act_w [..., F]
}

template <typename Binding>
auto swiglu_combine_grad_fp8_signature(Binding&& binding) {
  return swiglu_combine_grad_signature(std::move(binding))
      .template Ret<ffi::AnyBuffer>()   // d_h_q [..., M, 2F] e4m3fn or e5m2
      .template Ret<ffi::AnyBuffer>();  // d_h_scale [..., M, 2F/128] float32
}

}  // namespace turbo_moe
