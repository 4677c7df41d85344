// Contracts of turbo_moe_permute_fp8 and turbo_moe_permute_rows_fp8 (kernels/cpu/permute_fp8.cc,
// kernels/cuda/permute_fp8.cu): the permute's row copy writing FP8 rows with DeepSeek-V3's 1x128 activation scales,
// the lhs layout of turbo_moe_grouped_gemm_fp8.
//   permute_fp8:      x [..., T, H] float32/bfloat16/float16, row_index [..., T, k] int32, group_sizes [..., E] int32
//                       -> q [..., T*k, H] e4m3fn, scale [..., T*k, H/128] float32; H a positive multiple of 128.
//   permute_rows_fp8: the same operands -> rows [..., T*k, H] like x (turbo_moe_permute_rows' result, bit for bit),
//                       q [..., T*k, H] e4m3fn or e5m2 (q's dtype picks the format), scale [..., T*k, H/128] float32:
//                       both from one read of x (the FP8 expert block's backward needs d_y's rows in both).
// q[row_index[t, j]] and its scales quantise x[t] per 128-wide tile: scale = amax * (1/fmax) (1 for an all-zero
// tile; fmax 448 for e4m3fn, 57344 for e5m2), q = fp8(clip(x * (1/scale), -fmax, fmax)), rounded to nearest even, bit
// for bit the jnp quantiser's `quantize_rows` (turbo_moe/ops/fp8_scaling.py). Rows from sum(group_sizes) on are those
// of a zero row (rows 0, q 0, scale 1), or unwritten with zero_tail=false.
#pragma once

#include <string>

#include "contract.h"

namespace turbo_moe {

constexpr int64_t kPermuteFp8Tile = 128;  // activations' scale tile along H
constexpr float kE4m3Max = 448.0f;

struct PermuteFp8Dims {
  int64_t batch, T, H, k, E;
  int64_t slots;  // T * k: rows of q per problem
  bool e4m3;      // q's format: float8_e4m3fn, else float8_e5m2
};

// The checks both targets share; `op` names the target in the messages, `e5m2_ok` whether q may be float8_e5m2.
inline ffi::ErrorOr<PermuteFp8Dims> check_routed_fp8(const std::string& op, bool e5m2_ok, ffi::AnyBuffer x,
                                                     ffi::Buffer<ffi::S32> row_index, ffi::Buffer<ffi::S32> group_sizes,
                                                     ffi::AnyBuffer q, ffi::AnyBuffer scale) {
  if (!is_float_type(x.element_type())) return refuse(op + ": x must be float32/bfloat16/float16");
  const ffi::DataType qt = q.element_type();
  if (!(qt == ffi::DataType::F8E4M3FN || (e5m2_ok && qt == ffi::DataType::F8E5M2)) ||
      scale.element_type() != ffi::DataType::F32)
    return refuse(op + (e5m2_ok ? ": q must be float8_e4m3fn or float8_e5m2 and scale float32"
                                : ": q must be float8_e4m3fn and scale float32"));
  auto xd = x.dimensions(), rd = row_index.dimensions(), gd = group_sizes.dimensions();
  if (xd.size() < 2 || rd.size() != xd.size() || gd.size() + 1 != xd.size())
    return refuse(op + ": expected x [..., T, H], row_index [..., T, k] and group_sizes [..., E]");
  const int64_t rank = xd.size(), lead = rank - 2;
  const int64_t T = xd[rank - 2], H = xd[rank - 1], k = rd[rank - 1], E = gd[rank - 2];
  if (H <= 0 || H % kPermuteFp8Tile != 0)
    return refuse(op + ": x's H must be a positive multiple of 128 (the FP8 scale tiles), got H=" + std::to_string(H));
  if (!has_shape(rd, xd, lead, {T, k})) return refuse(op + ": row_index must have T rows like x");
  if (!has_shape(gd, xd, lead, {E})) return refuse(op + ": group_sizes must share x's leading (vmap) dims");
  if (T * k >= kInt32Rows) return refuse(op + ": T * k must be < 2^31");
  if (!has_shape(q.dimensions(), xd, lead, {T * k, H}) ||
      !has_shape(scale.dimensions(), xd, lead, {T * k, H / kPermuteFp8Tile}))
    return refuse(op + ": expected results q [..., T*k, H] and scale [..., T*k, H/128]");
  return PermuteFp8Dims{leading_product(xd, 2), T, H, k, E, T * k, qt == ffi::DataType::F8E4M3FN};
}

inline ffi::ErrorOr<PermuteFp8Dims> check_permute_fp8(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> row_index,
                                                      ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer q,
                                                      ffi::AnyBuffer scale) {
  return check_routed_fp8("permute_fp8", /*e5m2_ok=*/false, x, row_index, group_sizes, q, scale);
}

inline ffi::ErrorOr<PermuteFp8Dims> check_permute_rows_fp8(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> row_index,
                                                           ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer rows,
                                                           ffi::AnyBuffer q, ffi::AnyBuffer scale) {
  auto dims = check_routed_fp8("permute_rows_fp8", /*e5m2_ok=*/true, x, row_index, group_sizes, q, scale);
  if (!dims) return dims;
  if (rows.element_type() != x.element_type() || !same_dims(rows.dimensions(), q.dimensions()))
    return refuse("permute_rows_fp8: expected result rows [..., T*k, H] of x's dtype");
  return dims;
}

template <typename Binding>
auto permute_fp8_signature(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()             // x [..., T, H]
      .template Arg<ffi::Buffer<ffi::S32>>()               // row_index [..., T, k]
      .template Arg<ffi::Buffer<ffi::S32>>()               // group_sizes [..., E]
      .template Ret<ffi::AnyBuffer>()                      // q [..., T*k, H] e4m3fn
      .template Ret<ffi::AnyBuffer>()                      // scale [..., T*k, H/128] float32
      .template Attr<bool>("zero_tail");                   // false: rows past the groups unwritten (CPU: NaN)
}

template <typename Binding>
auto permute_rows_fp8_signature(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()             // x [..., T, H]
      .template Arg<ffi::Buffer<ffi::S32>>()               // row_index [..., T, k]
      .template Arg<ffi::Buffer<ffi::S32>>()               // group_sizes [..., E]
      .template Ret<ffi::AnyBuffer>()                      // rows [..., T*k, H] like x
      .template Ret<ffi::AnyBuffer>()                      // q [..., T*k, H] e4m3fn or e5m2
      .template Ret<ffi::AnyBuffer>()                      // scale [..., T*k, H/128] float32
      .template Attr<bool>("zero_tail");                   // false: rows past the groups unwritten (CPU: NaN)
}

}  // namespace turbo_moe
