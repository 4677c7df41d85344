// Contract of turbo_moe_router_topk (kernels/cpu/router_topk.cc, kernels/cuda/router_topk.cu):
//   selection [..., B, S, E] float32, bias [..., E] float32 -> expert_ids [..., B, S, top_k] int32.
// The bounds are the CUDA kernel's (three E-vectors in 48 KB of shared memory, a 64-bit mask of kept groups,
// per-thread top-k arrays) and turbo_moe/ops/router_topk.py's MAX_EXPERTS, MAX_GROUPS, MAX_TOP_K.
#pragma once

#include <cmath>

#include "contract.h"

namespace turbo_moe {

constexpr int64_t kRouterMaxExperts = 4096, kRouterMaxGroups = 64, kRouterMaxTopK = 32;

struct RouterTopkDims {
  int64_t B, S, E, k;
  int64_t sequences;  // every leading dim and B
};

inline ffi::ErrorOr<RouterTopkDims> check_router_topk(ffi::Buffer<ffi::F32> selection, ffi::Buffer<ffi::F32> bias,
                                                      ffi::Buffer<ffi::S32> expert_ids, int64_t top_k,
                                                      int64_t n_groups, int64_t topk_groups, float penalty,
                                                      int64_t chunk, int64_t prior_tokens) {
  auto sd = selection.dimensions(), bd = bias.dimensions(), od = expert_ids.dimensions();
  const int64_t rank = sd.size();
  if (rank < 3 || static_cast<int64_t>(bd.size()) != rank - 2 || static_cast<int64_t>(od.size()) != rank)
    return refuse("router_topk: expected selection [..., B, S, E], bias [..., E], expert_ids [..., B, S, k]");
  const int64_t B = sd[rank - 3], S = sd[rank - 2], E = sd[rank - 1], k = top_k;
  for (int64_t i = 0; i + 1 < static_cast<int64_t>(bd.size()); ++i)
    if (bd[i] != sd[i]) return refuse("router_topk: bias must share selection's leading (vmap) dims");
  if (bd[bd.size() - 1] != E) return refuse("router_topk: bias must have E entries like selection's last dim");
  if (!has_shape(od, sd, rank - 3, {B, S, k})) return refuse("router_topk: expert_ids must be [..., B, S, top_k]");
  if (E <= 0 || E > kRouterMaxExperts) return refuse("router_topk: the number of experts must be in [1, 4096]");
  if (n_groups <= 0 || n_groups > kRouterMaxGroups || E % n_groups != 0)
    return refuse("router_topk: n_groups must be in [1, 64] and divide the number of experts");
  if (topk_groups <= 0 || topk_groups > n_groups) return refuse("router_topk: topk_groups must be in [1, n_groups]");
  if (k <= 0 || k > kRouterMaxTopK || k > topk_groups * (E / n_groups))
    return refuse("router_topk: top_k must be in [1, min(32, experts of the topk_groups kept groups)]");
  if (!(penalty >= 0.0f) || !std::isfinite(penalty)) return refuse("router_topk: penalty must be finite and >= 0");
  if (chunk <= 0 || prior_tokens <= 0) return refuse("router_topk: chunk and prior_tokens must be positive");
  const int64_t sequences = leading_product(sd, 2);
  if (sequences * S >= kInt32Rows)  // the CUDA grids: a block per sequence, or a thread per token
    return refuse("router_topk: too many tokens: selection must have < 2^31 tokens (leading dims x B x S)");
  return RouterTopkDims{B, S, E, k, sequences};
}

template <typename Binding>
auto router_topk_signature(Binding binding) {
  return std::move(binding).template Arg<ffi::Buffer<ffi::F32>>()     // selection [..., B, S, E]
      .template Arg<ffi::Buffer<ffi::F32>>()               // bias [..., E]
      .template Ret<ffi::Buffer<ffi::S32>>()               // expert_ids [..., B, S, k]
      .template Attr<int64_t>("top_k")
      .template Attr<int64_t>("n_groups")
      .template Attr<int64_t>("topk_groups")
      .template Attr<float>("penalty")                     // float32, as JAX rounds the Python scalar
      .template Attr<int64_t>("chunk")                     // tokens per chunk of a sequence
      .template Attr<int64_t>("prior_tokens");             // router.SEQ_LOAD_PRIOR_TOKENS
}

}  // namespace turbo_moe
