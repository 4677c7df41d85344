// Contract of turbo_moe_permute_fp8 (kernels/cpu/permute_fp8.cc, kernels/cuda/permute_fp8.cu): the permute's row copy
// writing FP8 E4M3 rows with DeepSeek-V3's 1x128 activation scales, the lhs layout of turbo_moe_grouped_gemm_fp8.
//   x [..., T, H] float32/bfloat16/float16, row_index [..., T, k] int32, group_sizes [..., E] int32
//     -> q [..., T*k, H] e4m3fn, scale [..., T*k, H/128] float32; H a positive multiple of 128.
// q[row_index[t, j]] and its scales quantise x[t] per 128-wide tile: scale = amax * (1/448) (1 for an all-zero
// tile), q = e4m3(clip(x * (1/scale), -448, 448)), rounded to nearest even, bit for bit the jnp quantiser's
// `quantize_rows` (turbo_moe/ops/grouped_gemm_fp8.py). Rows from sum(group_sizes) on are those of a zero row (q 0,
// scale 1), or unwritten with zero_tail=false.
#pragma once

#include "contract.h"

namespace turbo_moe {

constexpr int64_t kPermuteFp8Tile = 128;  // activations' scale tile along H
constexpr float kE4m3Max = 448.0f;

struct PermuteFp8Dims {
  int64_t batch, T, H, k, E;
  int64_t slots;  // T * k: rows of q per problem
};

inline ffi::ErrorOr<PermuteFp8Dims> check_permute_fp8(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> row_index,
                                                      ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer q,
                                                      ffi::AnyBuffer scale) {
  if (!is_float_type(x.element_type())) return refuse("permute_fp8: x must be float32/bfloat16/float16");
  if (q.element_type() != ffi::DataType::F8E4M3FN || scale.element_type() != ffi::DataType::F32)
    return refuse("permute_fp8: q must be float8_e4m3fn and scale float32");
  auto xd = x.dimensions(), rd = row_index.dimensions(), gd = group_sizes.dimensions();
  if (xd.size() < 2 || rd.size() != xd.size() || gd.size() + 1 != xd.size())
    return refuse("permute_fp8: expected x [..., T, H], row_index [..., T, k] and group_sizes [..., E]");
  const int64_t rank = xd.size(), lead = rank - 2;
  const int64_t T = xd[rank - 2], H = xd[rank - 1], k = rd[rank - 1], E = gd[rank - 2];
  if (H <= 0 || H % kPermuteFp8Tile != 0)
    return refuse("permute_fp8: x's H must be a positive multiple of 128 (the FP8 scale tiles), got H=" +
                  std::to_string(H));
  if (!has_shape(rd, xd, lead, {T, k})) return refuse("permute_fp8: row_index must have T rows like x");
  if (!has_shape(gd, xd, lead, {E})) return refuse("permute_fp8: group_sizes must share x's leading (vmap) dims");
  if (T * k >= kInt32Rows) return refuse("permute_fp8: T * k must be < 2^31");
  if (!has_shape(q.dimensions(), xd, lead, {T * k, H}) ||
      !has_shape(scale.dimensions(), xd, lead, {T * k, H / kPermuteFp8Tile}))
    return refuse("permute_fp8: expected results q [..., T*k, H] and scale [..., T*k, H/128]");
  return PermuteFp8Dims{leading_product(xd, 2), T, H, k, E, T * k};
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

}  // namespace turbo_moe
