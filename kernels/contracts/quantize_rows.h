// Contract of turbo_moe_quantize_rows (kernels/cpu/quantize_rows.cc, kernels/cuda/quantize_rows.cu): activations
// quantised to FP8 per 1x128 tile (DeepSeek-V3's activation scaling), row r of q from row r of x.
//   x [..., M, K] float32/bfloat16/float16 -> q [..., M, K] float8_e4m3fn or float8_e5m2 (q's dtype picks the
//   format), scale [..., M, K/128] float32; K a positive multiple of 128, M >= 0.
// Per 128-wide tile: scale = amax * (1/fmax) (1 for an all-zero tile; fmax 448 for e4m3fn, 57344 for e5m2),
// q = fp8(clip(x * (1/scale), -fmax, fmax)) rounded to nearest even: bit for bit the jnp quantiser's `quantize_rows`
// (turbo_moe/ops/fp8_scaling.py), as permute_fp8 is without its permutation. NaN and infinity are where the
// kernels and that reference part (turbo_moe/ops/quantize_rows.py says how).
#pragma once

#include <string>

#include "contract.h"

namespace turbo_moe {

constexpr int64_t kQuantizeRowsTile = 128;  // activations' scale tile along K

struct QuantizeRowsDims {
  int64_t rows, K;  // rows: the product of x's leading dims and M
  bool e4m3;        // q's format: float8_e4m3fn, else float8_e5m2
};

inline ffi::ErrorOr<QuantizeRowsDims> check_quantize_rows(ffi::AnyBuffer x, ffi::AnyBuffer q, ffi::AnyBuffer scale) {
  if (!is_float_type(x.element_type())) return refuse("quantize_rows: x must be float32/bfloat16/float16");
  const ffi::DataType qt = q.element_type();
  if (qt != ffi::DataType::F8E4M3FN && qt != ffi::DataType::F8E5M2)
    return refuse("quantize_rows: q must be float8_e4m3fn or float8_e5m2");
  if (scale.element_type() != ffi::DataType::F32) return refuse("quantize_rows: scale must be float32");
  auto xd = x.dimensions();
  if (xd.size() < 2) return refuse("quantize_rows: expected x [..., M, K]");
  const int64_t rank = xd.size(), lead = rank - 2;
  const int64_t M = xd[rank - 2], K = xd[rank - 1];
  if (K <= 0 || K % kQuantizeRowsTile != 0)
    return refuse("quantize_rows: x's K must be a positive multiple of 128 (the FP8 scale tiles), got K=" +
                  std::to_string(K));
  if (!has_shape(q.dimensions(), xd, lead, {M, K}) ||
      !has_shape(scale.dimensions(), xd, lead, {M, K / kQuantizeRowsTile}))
    return refuse("quantize_rows: expected results q [..., M, K] and scale [..., M, K/128]");
  return QuantizeRowsDims{leading_product(xd, 2) * M, K, qt == ffi::DataType::F8E4M3FN};
}

template <typename Binding>
auto quantize_rows_signature(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // x [..., M, K]
      .template Ret<ffi::AnyBuffer>()                       // q [..., M, K] e4m3fn or e5m2
      .template Ret<ffi::AnyBuffer>();                      // scale [..., M, K/128] float32
}

}  // namespace turbo_moe
