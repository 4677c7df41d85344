// The grouped GEMM's forward (grouped_gemm.cc) for the handlers that run it as their first step
// (grouped_gemm_swiglu.cc): out[r] = lhs[r] @ rhs[g(r)], rows past sum(group_sizes) zero, or NaN when !zero_tail
// (see tail_fill in common.h). `totals` (may be null) gets each batch's sum(group_sizes), clamped to M.
#pragma once

#include "../contracts/grouped_gemm.h"
#include "common.h"

namespace turbo_moe {

ffi::Error run_grouped_gemm(ffi::ThreadPool* pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                            ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer out, bool transpose_rhs, bool zero_tail,
                            std::vector<int64_t>* totals = nullptr);

}  // namespace turbo_moe
