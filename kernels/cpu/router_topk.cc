// CPU FFI handler of the router's expert choice (DeepSeek-V3 group-limited top-k with the causal
// sequence load penalty fused in):
//   turbo_moe_router_topk: selection (B, S, E) f32, bias (E,) f32 -> expert_ids (B, S, k) int32
// The ids, in order, of jax.lax.top_k on the group-masked `penalized + bias`, where `penalized` is
// turbo_moe.model.router.seq_load_penalized_selection: each sequence runs chunk by chunk (`chunk`
// tokens), and a token of chunk j > 0 sees selection - penalty * max(share - 1, 0), share_e =
// (picks of e by chunks < j + fair * P) / ((j * chunk + P) * fair), fair = k / E, P = prior_tokens.
// penalty == 0: plain group-limited top-k (no chunk dependence). Optional leading (vmap) dims are
// shared by both operands. A plain loop per sequence; sequences run in parallel.
#include <cmath>
#include <limits>

#include "../contracts/registration.h"
#include "../contracts/router_topk.h"
#include "common.h"

namespace turbo_moe {
namespace {

// The float32 arithmetic of XLA:CPU's compiled seq_load_penalized_selection (jax 0.10): the division
// by the chunk's constant is rewritten as a multiply by its float32 reciprocal and fused with the
// "- 1" into an fma; the penalty product is rounded before the subtraction. The first chunk is left
// as is (share is the prior, exactly 1; XLA folds it to 0). Another compiler or backend (XLA:GPU
// may fuse `x - p * m` into one fma) can differ by an ulp, which changes a pick only at a near-tie.
struct ChunkPenalty {
  float c1, rcp;  // fair * P, 1 / ((start + P) * fair), each rounded to float32 as JAX does

  ChunkPenalty(int64_t start, int64_t top_k, int64_t E, int64_t prior) {
    const double fair = static_cast<double>(top_k) / static_cast<double>(E);
    c1 = static_cast<float>(fair * static_cast<double>(prior));
    rcp = 1.0f / static_cast<float>(static_cast<double>(start + prior) * fair);
  }
  float operator()(float count, float penalty) const {
    const float excess = std::max(std::fma(count + c1, rcp, -1.0f), 0.0f);
    return penalty * excess;
  }
};

// a ranks before b: larger value, ties to the lower index (jax.lax.top_k's order).
inline bool ahead(float va, int64_t ia, float vb, int64_t ib) { return va > vb || (va == vb && ia < ib); }

// ids[0:k] = group-limited top-k of v (E biased values), best first. group_score: n_groups floats.
void select_token(const float* v, int64_t E, int64_t n_groups, int64_t topk_groups, int64_t k,
                  float* group_score, std::vector<char>& kept, int32_t* ids, float* top) {
  const int64_t per = E / n_groups;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < n_groups; ++g) {  // the sum of the group's two best values
    float b1 = neg_inf, b2 = neg_inf;
    for (int64_t i = g * per; i < (g + 1) * per; ++i) {
      if (v[i] > b1) { b2 = b1; b1 = v[i]; } else if (v[i] > b2) { b2 = v[i]; }
    }
    group_score[g] = per == 1 ? b1 : b1 + b2;
  }
  std::fill(kept.begin(), kept.end(), 0);
  for (int64_t r = 0; r < topk_groups; ++r) {
    int64_t best = -1;
    for (int64_t g = 0; g < n_groups; ++g)
      if (!kept[g] && (best < 0 || ahead(group_score[g], g, group_score[best], best))) best = g;
    if (best < 0) break;  // unreachable (topk_groups <= n_groups); keeps the compiler sure of the index
    kept[best] = 1;
  }
  int64_t filled = 0;  // insertion into the sorted list (top, ids): experts arrive in index order
  for (int64_t e = 0; e < E; ++e) {
    if (!kept[e / per]) continue;
    if (filled == k && !ahead(v[e], e, top[k - 1], ids[k - 1])) continue;
    int64_t j = filled < k ? filled++ : k - 1;
    for (; j > 0 && ahead(v[e], e, top[j - 1], ids[j - 1]); --j) { top[j] = top[j - 1]; ids[j] = ids[j - 1]; }
    top[j] = v[e];
    ids[j] = static_cast<int32_t>(e);
  }
}

ffi::Error RouterTopkImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> selection, ffi::Buffer<ffi::F32> bias,
                          ffi::Result<ffi::Buffer<ffi::S32>> expert_ids, int64_t top_k, int64_t n_groups,
                          int64_t topk_groups, float penalty, int64_t chunk, int64_t prior_tokens) {
  auto dims = check_router_topk(selection, bias, *expert_ids, top_k, n_groups, topk_groups, penalty, chunk,
                                prior_tokens);
  if (!dims) return dims.error();
  const int64_t B = dims->B, S = dims->S, E = dims->E, k = dims->k, sequences = dims->sequences;
  if (sequences == 0 || S == 0) return ffi::Error::Success();
  const float* sel_p = selection.typed_data();
  const float* bias_p = bias.typed_data();
  int32_t* ids_p = expert_ids->typed_data();
  const bool chunked = penalty > 0.0f && chunk < S;  // one chunk: no past, no penalty

  parallel_for(&pool, sequences, [&](int64_t seq) {
    const float* b = bias_p + (seq / B) * E;  // each vmap element has its own bias
    std::vector<float> v(E), pen(E, 0.0f), counts(E, 0.0f), group_score(n_groups), top(k);
    std::vector<char> kept(n_groups);
    for (int64_t start = 0; start < S; start += chunked ? chunk : S) {
      const int64_t end = chunked ? std::min(S, start + chunk) : S;
      if (chunked && start > 0) {
        const ChunkPenalty share(start, k, E, prior_tokens);
        for (int64_t e = 0; e < E; ++e) pen[e] = share(counts[e], penalty);
      }
      for (int64_t t = start; t < end; ++t) {
        const float* x = sel_p + (seq * S + t) * E;
        for (int64_t e = 0; e < E; ++e) v[e] = (x[e] - pen[e]) + b[e];
        int32_t* ids = ids_p + (seq * S + t) * k;
        select_token(v.data(), E, n_groups, topk_groups, k, group_score.data(), kept, ids, top.data());
        if (chunked)
          for (int64_t j = 0; j < k; ++j) counts[ids[j]] += 1.0f;
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CPU_HANDLER(turbo_moe_router_topk, turbo_moe::RouterTopkImpl, turbo_moe::router_topk_signature);
