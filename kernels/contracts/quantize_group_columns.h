// Contract of turbo_moe_quantize_group_columns (kernels/cpu/quantize_group_columns.cc,
// kernels/cuda/quantize_group_columns.cu): the FP8 weight gradient's operand, quantised per 128x1 tile within each
// group and written transposed in the group-padded layout the FP8 weight-gradient kernel reads.
//   x [M, C] float32/bfloat16/float16 rows sorted by group, group_sizes [G] int32
//     -> q_t [C, P] float8_e4m3fn or float8_e5m2, scale [P/128, C] float32; P = ceil((M + 127*G) / 128) * 128.
// Group g (sizes clamped as the forward clamps them: negatives count as 0, nothing past M) owns columns
// [pad_start_g, pad_start_g + size_g) of q_t, pad_start_g = sum_{h<g} ceil(size_h / 128) * 128; every 128-column
// tile quantises its rows per column: scale = amax * (1/fmax) (1 for an all-zero tile), q = fp8(clip(x * (1/scale),
// -fmax, fmax)) rounded to nearest even, bit for bit the jnp reference (tests/reference.py). Padding columns and
// tiles past the groups are zero (scale 1); rows past sum(group_sizes) are not read.
#pragma once

#include <string>

#include "contract.h"

namespace turbo_moe {

constexpr int64_t kGroupColumnsTile = 128;    // rows per scale tile, and each group's padding unit

struct QuantizeGroupColumnsDims {
  int64_t M, C, G, P;
  float fmax;  // the fp8 format's largest finite value
};

inline int64_t group_columns_padded_rows(int64_t m, int64_t groups) {
  return (m + (kGroupColumnsTile - 1) * groups + kGroupColumnsTile - 1) / kGroupColumnsTile * kGroupColumnsTile;
}

inline ffi::ErrorOr<QuantizeGroupColumnsDims> check_quantize_group_columns(ffi::AnyBuffer x,
                                                                           ffi::Buffer<ffi::S32> group_sizes,
                                                                           ffi::AnyBuffer q_t, ffi::AnyBuffer scale) {
  if (!is_float_type(x.element_type())) return refuse("quantize_group_columns: x must be float32/bfloat16/float16");
  const ffi::DataType qt = q_t.element_type();
  if (qt != ffi::DataType::F8E4M3FN && qt != ffi::DataType::F8E5M2)
    return refuse("quantize_group_columns: q_t must be float8_e4m3fn or float8_e5m2");
  if (scale.element_type() != ffi::DataType::F32) return refuse("quantize_group_columns: scale must be float32");
  auto xd = x.dimensions(), gd = group_sizes.dimensions();
  if (xd.size() != 2 || gd.size() != 1)
    return refuse("quantize_group_columns: expected x [M, C] and group_sizes [G] (no batch dims, no vmap)");
  const int64_t M = xd[0], C = xd[1], G = gd[0];
  if (C <= 0) return refuse("quantize_group_columns: x must have C >= 1 columns");
  const int64_t P = group_columns_padded_rows(M, G);
  if (P >= kInt32Rows) return refuse("quantize_group_columns: M + 127 * G must be < 2^31");
  if (!has_shape(q_t.dimensions(), xd, 0, {C, P}) || !has_shape(scale.dimensions(), xd, 0, {P / kGroupColumnsTile, C}))
    return refuse("quantize_group_columns: expected results q_t [C, P] and scale [P/128, C] with P = " +
                  std::to_string(P) + " (padded_rows(M, G) in turbo_moe/ops/quantize_group_columns.py)");
  return QuantizeGroupColumnsDims{M, C, G, P, qt == ffi::DataType::F8E4M3FN ? 448.0f : 57344.0f};
}

template <typename Binding>
auto quantize_group_columns_signature(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // x [M, C]
      .template Arg<ffi::Buffer<ffi::S32>>()                // group_sizes [G]
      .template Ret<ffi::AnyBuffer>()                       // q_t [C, P] e4m3fn or e5m2
      .template Ret<ffi::AnyBuffer>();                      // scale [P/128, C] float32
}

}  // namespace turbo_moe
