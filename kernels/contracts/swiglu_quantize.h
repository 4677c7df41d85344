// Contract of turbo_moe_swiglu_quantize (kernels/cpu/swiglu_quantize.cc, kernels/cuda/swiglu_quantize.cu): the FP8
// expert block's SwiGLU written straight into the down GEMM's FP8 lhs.
//   h [..., M, 2F] = [gate | up] float32/bfloat16/float16, valid [...] int32 -> q [..., M, F] float8_e4m3fn or
//   float8_e5m2 (q's dtype picks the format), scale [..., M, F/128] float32; F a positive multiple of 128, M >= 0.
// act = gate / (1 + exp(-gate)) * up in float32 (grouped_gemm_swiglu's formula), rounded to h's dtype, then each
// row quantised per 1x128 tile exactly as turbo_moe_quantize_rows quantises that rounded act
// (kernels/contracts/quantize_rows.h). Rows from valid[b] on of problem b are left unspecified.
#pragma once

#include <string>

#include "contract.h"

namespace turbo_moe {

constexpr int64_t kSwigluQuantizeTile = 128;  // act's scale tile along F

struct SwigluQuantizeDims {
  int64_t rows;  // the product of h's leading dims and M
  int64_t M;     // rows of one problem (valid counts per problem)
  int64_t F;
  bool e4m3;  // q's format: float8_e4m3fn, else float8_e5m2
};

inline ffi::ErrorOr<SwigluQuantizeDims> check_swiglu_quantize(ffi::AnyBuffer h, ffi::Buffer<ffi::S32> valid,
                                                              ffi::AnyBuffer q, ffi::AnyBuffer scale) {
  if (!is_float_type(h.element_type())) return refuse("swiglu_quantize: h must be float32/bfloat16/float16");
  const ffi::DataType qt = q.element_type();
  if (qt != ffi::DataType::F8E4M3FN && qt != ffi::DataType::F8E5M2)
    return refuse("swiglu_quantize: q must be float8_e4m3fn or float8_e5m2");
  if (scale.element_type() != ffi::DataType::F32) return refuse("swiglu_quantize: scale must be float32");
  auto hd = h.dimensions();
  if (hd.size() < 2) return refuse("swiglu_quantize: expected h [..., M, 2F]");
  const int64_t rank = hd.size(), lead = rank - 2;
  const int64_t M = hd[rank - 2], F = hd[rank - 1] / 2;
  if (hd[rank - 1] % 2 != 0 || F <= 0 || F % kSwigluQuantizeTile != 0)
    return refuse("swiglu_quantize: h must be [..., M, 2F] with F a positive multiple of 128 (the FP8 scale "
                  "tiles), got a last dim of " + std::to_string(hd[rank - 1]));
  if (!has_shape(q.dimensions(), hd, lead, {M, F}) ||
      !has_shape(scale.dimensions(), hd, lead, {M, F / kSwigluQuantizeTile}))
    return refuse("swiglu_quantize: expected results q [..., M, F] and scale [..., M, F/128]");
  if (!has_shape(valid.dimensions(), hd, lead, {}))
    return refuse("swiglu_quantize: expected valid [...] (rows to compute of each [M, 2F] problem of h)");
  return SwigluQuantizeDims{leading_product(hd, 2) * M, M, F, qt == ffi::DataType::F8E4M3FN};
}

template <typename Binding>
auto swiglu_quantize_signature(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // h [..., M, 2F] = [gate | up]
      .template Arg<ffi::Buffer<ffi::S32>>()                // valid [...]: rows to compute of each problem
      .template Ret<ffi::AnyBuffer>()                       // q [..., M, F] e4m3fn or e5m2
      .template Ret<ffi::AnyBuffer>();                      // scale [..., M, F/128] float32
}

}  // namespace turbo_moe
