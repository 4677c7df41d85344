// CUDA FFI handler of the router's expert choice (contract of kernels/cpu/router_topk.cc):
//   turbo_moe_router_topk: selection (B, S, E) f32, bias (E,) f32 -> expert_ids (B, S, k) int32
// DeepSeek-V3 group-limited top-k on `selection - penalty * max(share - 1, 0) + bias`, share from the
// picks of the earlier chunks of the token's sequence. One thread per token, the same float32
// arithmetic as the CPU handler (explicit __f*_rn intrinsics: nvcc must not contract them).
//   penalty > 0: each sequence walks its chunks in order, counts and penalties in shared memory; the
//     tokens of a chunk are independent and run in parallel, each over n_groups lanes when the groups
//     allow it, on a cluster of up to 8 blocks per sequence on Hopper (penalized_cluster_kernel), else on
//     one block (penalized_lanes_kernel); one thread each otherwise (penalized_kernel).
//   penalty == 0 (or one chunk): no dependence, a grid over all tokens.
// Limits (kernels/contracts/router_topk.h and turbo_moe/ops/router_topk.py): E <= 4096 (three E-vectors in 48 KB of
// shared memory), n_groups <= 64 (a 64-bit mask of kept groups), top_k <= 32 (per-thread arrays).
// Values are read again from global memory rather than held: L1 serves the repeats.
#include <cooperative_groups.h>

#include <cmath>

#include "../contracts/registration.h"
#include "../contracts/router_topk.h"
#include "common.cuh"

namespace turbo_moe {
namespace {

constexpr int64_t kMaxGroups = kRouterMaxGroups, kMaxTopK = kRouterMaxTopK;  // the contract's bounds
constexpr unsigned kMaxCluster = 8;  // blocks per sequence in the cluster walk (the portable cluster size)

// a ranks before b: larger value, ties to the lower index (jax.lax.top_k's order).
__device__ __forceinline__ bool ahead(float va, int ia, float vb, int ib) {
  return va > vb || (va == vb && ia < ib);
}

// Writes the group-limited top-k of the E values value(e) to ids[0:k], best first.
template <typename Value>
__device__ void select_token(const Value& value, int E, int n_groups, int topk_groups, int k, int32_t* ids) {
  const int per = E / n_groups;
  uint64_t kept = ~uint64_t{0};
  if (topk_groups < n_groups) {
    float score[kMaxGroups];  // the sum of each group's two best values
    for (int g = 0; g < n_groups; ++g) {
      float b1 = -INFINITY, b2 = -INFINITY;
      for (int e = g * per; e < (g + 1) * per; ++e) {
        const float v = value(e);
        if (v > b1) { b2 = b1; b1 = v; } else if (v > b2) { b2 = v; }
      }
      score[g] = per == 1 ? b1 : __fadd_rn(b1, b2);
    }
    kept = 0;
    for (int r = 0; r < topk_groups; ++r) {
      int best = -1;
      for (int g = 0; g < n_groups; ++g)
        if (!((kept >> g) & 1) && (best < 0 || ahead(score[g], g, score[best], best))) best = g;
      kept |= uint64_t{1} << best;
    }
  }
  float top[kMaxTopK];
  int idx[kMaxTopK];
  int filled = 0;  // insertion into the sorted list (top, idx): experts arrive in index order
  for (int e = 0; e < E; ++e) {
    if (!((kept >> (e / per)) & 1)) continue;
    const float v = value(e);
    if (filled == k && !ahead(v, e, top[k - 1], idx[k - 1])) continue;
    int j = filled < k ? filled++ : k - 1;
    for (; j > 0 && ahead(v, e, top[j - 1], idx[j - 1]); --j) { top[j] = top[j - 1]; idx[j] = idx[j - 1]; }
    top[j] = v;
    idx[j] = e;
  }
  for (int j = 0; j < k; ++j) ids[j] = idx[j];
}

struct Shape {
  int64_t B, S, E, sequences;
  int n_groups, topk_groups, k;
};

// No chunk dependence: thread per token over the whole (sequences * S) grid.
__global__ void plain_kernel(const float* __restrict__ sel, const float* __restrict__ bias, int32_t* ids,
                             Shape s) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (token >= s.sequences * s.S) return;
  const float* x = sel + token * s.E;
  const float* b = bias + (token / s.S / s.B) * s.E;  // each vmap element has its own bias
  auto value = [&](int e) { return __fadd_rn(x[e], __ldg(b + e)); };
  select_token(value, static_cast<int>(s.E), s.n_groups, s.topk_groups, s.k, ids + token * s.k);
}

// A penalized walk's shared memory: this sequence's bias, the current chunk's penalty and the picks by the earlier
// chunks (3 E-vectors). Loads the bias and zeroes the rest.
__device__ void start_sequence(const float* bias, const Shape& s, int64_t seq, float* b, float* pen, int* counts) {
  for (int64_t e = threadIdx.x; e < s.E; e += blockDim.x) {
    b[e] = bias[(seq / s.B) * s.E + e];  // each vmap element has its own bias
    pen[e] = 0.0f;
    counts[e] = 0;
  }
}

// The penalty of the chunk starting at `start` > 0 from the earlier chunks' counts. The float32 steps are those of
// the CPU handler's ChunkPenalty (XLA:CPU's program: the constant division as a reciprocal multiply fused with "- 1").
__device__ void chunk_penalty(const Shape& s, int64_t start, int64_t prior, float penalty, const int* counts,
                              float* pen) {
  const double fair = static_cast<double>(s.k) / static_cast<double>(s.E);
  const float c1 = static_cast<float>(fair * static_cast<double>(prior));
  const float rcp = __fdiv_rn(1.0f, static_cast<float>(static_cast<double>(start + prior) * fair));
  for (int64_t e = threadIdx.x; e < s.E; e += blockDim.x) {
    const float excess = fmaxf(__fmaf_rn(__fadd_rn(static_cast<float>(counts[e]), c1), rcp, -1.0f), 0.0f);
    pen[e] = __fmul_rn(penalty, excess);
  }
}

// One block per sequence, chunk after chunk, one thread per token.
__global__ void penalized_kernel(const float* __restrict__ sel, const float* __restrict__ bias, int32_t* ids,
                                 Shape s, float penalty, int64_t chunk, int64_t prior) {
  extern __shared__ float smem[];
  float* b = smem;                                         // E: this sequence's bias
  float* pen = smem + s.E;                                 // E: this chunk's penalty per expert
  int* counts = reinterpret_cast<int*>(smem + 2 * s.E);   // E: picks by the earlier chunks
  const int64_t seq = blockIdx.x;
  start_sequence(bias, s, seq, b, pen, counts);
  __syncthreads();
  for (int64_t start = 0; start < s.S; start += chunk) {
    if (start > 0) {  // the first chunk has no past: share is the prior, exactly 1
      chunk_penalty(s, start, prior, penalty, counts, pen);
      __syncthreads();
    }
    const int64_t end = min64(s.S, start + chunk);
    for (int64_t t = start + threadIdx.x; t < end; t += blockDim.x) {
      const float* x = sel + (seq * s.S + t) * s.E;
      auto value = [&](int e) { return __fadd_rn(__fsub_rn(x[e], pen[e]), b[e]); };
      int32_t* out = ids + (seq * s.S + t) * s.k;
      select_token(value, static_cast<int>(s.E), s.n_groups, s.topk_groups, s.k, out);
      for (int j = 0; j < s.k; ++j) atomicAdd(&counts[out[j]], 1);
    }
    __syncthreads();  // counts complete, pen free to overwrite
  }
}

// One token's group-limited top-k over the L = n_groups lanes of a warp (lane g holds group g's PER values v, in
// registers): the group scores, the kept groups and each top-k round are shuffles among the L lanes. Lane 0 writes
// the picks to out and counts them in counts (shared memory) when the token is live. Same picks and float32 steps
// as select_token (ties to the lower index everywhere).
template <int PER>
__device__ __forceinline__ void pick_over_lanes(const float (&v)[PER], int g, int L, unsigned seg, unsigned mask,
                                                const Shape& s, bool live, int32_t* out, int* counts) {
  float b1 = -INFINITY, b2 = -INFINITY;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    if (v[i] > b1) { b2 = b1; b1 = v[i]; } else if (v[i] > b2) { b2 = v[i]; }
  }
  const float score = PER == 1 ? b1 : __fadd_rn(b1, b2);
  int rank = 0;  // groups ahead of mine
  for (int j = 1; j < L; ++j) {
    const int h = (g + j) % L;
    const float other = __shfl_sync(mask, score, static_cast<int>(seg) + h);
    rank += ahead(other, h, score, g);
  }
  const bool kept = rank < s.topk_groups;
  unsigned taken = 0;
  for (int r = 0; r < s.k; ++r) {
    float best = -INFINITY;
    int best_e = INT32_MAX;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int e = g * PER + i;
      if (kept && !((taken >> i) & 1u) && ahead(v[i], e, best, best_e)) { best = v[i]; best_e = e; }
    }
    for (int off = 1; off < L; off <<= 1) {
      const float ov = __shfl_xor_sync(mask, best, off);
      const int oe = __shfl_xor_sync(mask, best_e, off);
      if (ahead(ov, oe, best, best_e)) { best = ov; best_e = oe; }
    }
    if (best_e / PER == g) taken |= 1u << (best_e % PER);
    if (g == 0 && live) {
      out[r] = best_e;
      atomicAdd(&counts[best_e], 1);
    }
  }
}

// A token's lanes: L divides 32, so they share a warp; `seg` is the token's first lane.
struct Lanes {
  int L, g;
  unsigned seg, mask;
  __device__ explicit Lanes(int n_groups) : L(n_groups), g(static_cast<int>(threadIdx.x) % n_groups) {
    seg = (threadIdx.x & 31u) - static_cast<unsigned>(g);
    mask = L == 32 ? 0xffffffffu : ((1u << L) - 1u) << seg;
  }
};

// The penalized walk with a token split over L = n_groups lanes, one block per sequence. A chunk then runs on up
// to 1024 threads instead of 128 single threads that each scan all E values: the walk is latency-bound (8 blocks
// at b8), and this cuts each chunk's chain of dependent steps.
template <int PER>
__global__ void __launch_bounds__(1024) penalized_lanes_kernel(const float* __restrict__ sel, const float* __restrict__ bias, int32_t* ids,
                                       Shape s, float penalty, int64_t chunk, int64_t prior) {
  extern __shared__ float smem[];
  float* b = smem;
  float* pen = smem + s.E;
  int* counts = reinterpret_cast<int*>(smem + 2 * s.E);
  const Lanes ln(s.n_groups);
  const int g = ln.g;
  const int64_t seq = blockIdx.x, per_pass = blockDim.x / ln.L;
  start_sequence(bias, s, seq, b, pen, counts);
  __syncthreads();
  for (int64_t start = 0; start < s.S; start += chunk) {
    if (start > 0) {
      chunk_penalty(s, start, prior, penalty, counts, pen);
      __syncthreads();
    }
    const int64_t end = min64(s.S, start + chunk);
    // Every thread of the block runs the same number of passes (whole warps in the shuffles).
    for (int64_t first = start; first < end; first += per_pass) {
      const int64_t t = first + threadIdx.x / ln.L;
      const bool live = t < end;
      float v[PER];
      const float* x = sel + (seq * s.S + (live ? t : start)) * s.E + g * PER;
#pragma unroll
      for (int i = 0; i < PER; ++i) v[i] = __fadd_rn(__fsub_rn(x[i], pen[g * PER + i]), b[g * PER + i]);
      pick_over_lanes<PER>(v, g, ln.L, ln.seg, ln.mask, s, live, ids + (seq * s.S + t) * s.k, counts);
    }
    __syncthreads();  // counts complete, pen free to overwrite
  }
}

// The lane-split walk with each sequence spread over a cluster of C blocks (Hopper): block r picks tokens
// [r * per_block, (r + 1) * per_block) of every chunk and counts them in its own shared memory; after a cluster
// barrier every block adds the C blocks' counts through distributed shared memory and computes the next penalty
// itself. At b8 the walk runs on 8 x C SMs instead of 8 (on one SM per sequence it was compute-bound); each
// thread loads its next token's values before the barrier. Counts are integers: the same picks as the one-block
// walk, whatever the order of the adds.
template <int PER>
__global__ void __launch_bounds__(1024) penalized_cluster_kernel(const float* __restrict__ sel, const float* __restrict__ bias,
                                                                 int32_t* ids, Shape s, float penalty, int64_t chunk,
                                                                 int64_t prior, int64_t per_block) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  extern __shared__ float smem[];
  float* b = smem;
  float* pen = smem + s.E;
  int* counts = reinterpret_cast<int*>(smem + 2 * s.E);  // E: picks by the earlier chunks, the whole sequence
  int* part = counts + s.E;                              // 2 E: this block's picks in the even / odd chunks
  const Lanes ln(s.n_groups);
  const int g = ln.g;
  const unsigned C = cluster.num_blocks();
  const int64_t seq = blockIdx.x / C, mine = threadIdx.x / ln.L;
  const int64_t offset = static_cast<int64_t>(cluster.block_rank()) * per_block + mine;  // token within a chunk
  start_sequence(bias, s, seq, b, pen, counts);
  for (int64_t e = threadIdx.x; e < 2 * s.E; e += blockDim.x) part[e] = 0;
  float raw[PER];
  auto load = [&](int64_t start) {  // this thread's values of its token in the chunk at `start` (< S)
    const int64_t t = start + offset;
    const float* x = sel + (seq * s.S + (t < s.S ? t : start)) * s.E + g * PER;
#pragma unroll
    for (int i = 0; i < PER; ++i) raw[i] = x[i];
  };
  load(0);
  __syncthreads();
  int parity = 0;
  for (int64_t start = 0; start < s.S; start += chunk, parity ^= 1) {
    if (start > 0) {
      const int* done = part + (parity ^ 1) * s.E;  // every block's picks in the previous chunk
      for (int64_t e = threadIdx.x; e < s.E; e += blockDim.x) {
        int got[kMaxCluster];  // the remote reads issued before the first add (timed no faster than a loop)
#pragma unroll
        for (unsigned r = 0; r < kMaxCluster; ++r) got[r] = r < C ? cluster.map_shared_rank(done, r)[e] : 0;
        int sum = 0;
#pragma unroll
        for (unsigned r = 0; r < kMaxCluster; ++r) sum += got[r];
        counts[e] += sum;
      }
      chunk_penalty(s, start, prior, penalty, counts, pen);  // the same e per thread as the sum above
      __syncthreads();
    }
    const int64_t t = start + offset;
    const bool live = mine < per_block && t < min64(s.S, start + chunk);
    float v[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) v[i] = __fadd_rn(__fsub_rn(raw[i], pen[g * PER + i]), b[g * PER + i]);
    pick_over_lanes<PER>(v, g, ln.L, ln.seg, ln.mask, s, live, ids + (seq * s.S + t) * s.k, part + parity * s.E);
    if (start + chunk < s.S) load(start + chunk);
    cluster.sync();  // every block's part[parity] complete and visible to the cluster
    // Every block read the other parity's counts before this barrier: clear them for the next chunk (the
    // __syncthreads after its penalty orders this before the next chunk's adds).
    for (int64_t e = threadIdx.x; e < s.E; e += blockDim.x) part[(parity ^ 1) * s.E + e] = 0;
  }
  // No block reads another's shared memory after the last barrier: blocks may exit.
#endif
}

// True when the device runs the cluster walk's Hopper code: the library carries it as an sm_90a cubin, which only
// a compute capability 9.0 device loads (another would JIT the sm_80 PTX, whose body is empty). Device attribute
// queries only: safe while XLA captures a command buffer.
inline bool cluster_walk_available() {
  int dev = 0;
  return cudaGetDevice(&dev) == cudaSuccess && device_attribute<cudaDevAttrComputeCapabilityMajor>(dev) == 9 &&
         device_attribute<cudaDevAttrComputeCapabilityMinor>(dev) == 0 &&
         device_attribute<cudaDevAttrClusterLaunch>(dev) != 0;
}

// The cluster walk (a chunk's tokens over C <= 8 blocks, one pass each) where it fits, else the one-block walk.
template <int PER>
void launch_lanes_walk(const float* sel, const float* bias, int32_t* ids, const Shape& s, float penalty,
                       int64_t chunk, int64_t prior, cudaStream_t stream) {
  const int L = s.n_groups;
  const int64_t C = std::min<int64_t>(kMaxCluster, chunk), per_block = ceil_div(chunk, C);
  const int64_t cluster_threads = ceil_div(per_block * L, 32) * 32;
  const size_t cluster_smem = 5 * s.E * sizeof(float);  // bias, penalty, counts, two chunks' own picks
  if (cluster_threads <= 1024 && cluster_smem <= 48 * 1024 && s.sequences * C <= INT32_MAX &&
      cluster_walk_available()) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(s.sequences * C));
    cfg.blockDim = dim3(static_cast<unsigned>(cluster_threads));
    cfg.dynamicSmemBytes = cluster_smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(C);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    cudaLaunchKernelEx(&cfg, penalized_cluster_kernel<PER>, sel, bias, ids, s, penalty, chunk, prior, per_block);
    return;  // a launch error surfaces in last_cuda_error
  }
  const int threads = static_cast<int>(std::min<int64_t>(1024, std::max<int64_t>(32, ceil_div(chunk * L, 32) * 32)));
  penalized_lanes_kernel<PER><<<static_cast<unsigned>(s.sequences), threads, 3 * s.E * sizeof(float), stream>>>(
      sel, bias, ids, s, penalty, chunk, prior);
}

// Launches a lane-split walk when the groups fit it (n_groups a power of two <= 32, E / n_groups in
// {1, 2, 4, 8, 16, 32}); false otherwise (the caller runs penalized_kernel).
bool launch_penalized_lanes(const float* sel, const float* bias, int32_t* ids, const Shape& s, float penalty,
                            int64_t chunk, int64_t prior, cudaStream_t stream) {
  const int L = s.n_groups, per = static_cast<int>(s.E / s.n_groups);
  if (L > 32 || (L & (L - 1)) != 0 || per > 32 || (per & (per - 1)) != 0 || s.k > 32) return false;
  switch (per) {
    case 1: launch_lanes_walk<1>(sel, bias, ids, s, penalty, chunk, prior, stream); break;
    case 2: launch_lanes_walk<2>(sel, bias, ids, s, penalty, chunk, prior, stream); break;
    case 4: launch_lanes_walk<4>(sel, bias, ids, s, penalty, chunk, prior, stream); break;
    case 8: launch_lanes_walk<8>(sel, bias, ids, s, penalty, chunk, prior, stream); break;
    case 16: launch_lanes_walk<16>(sel, bias, ids, s, penalty, chunk, prior, stream); break;
    default: launch_lanes_walk<32>(sel, bias, ids, s, penalty, chunk, prior, stream);
  }
  return true;
}

ffi::Error RouterTopkImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> selection, ffi::Buffer<ffi::F32> bias,
                          ffi::Result<ffi::Buffer<ffi::S32>> expert_ids, int64_t top_k, int64_t n_groups,
                          int64_t topk_groups, float penalty, int64_t chunk, int64_t prior_tokens) {
  auto dims = check_router_topk(selection, bias, *expert_ids, top_k, n_groups, topk_groups, penalty, chunk,
                                prior_tokens);
  if (!dims) return dims.error();
  const int64_t B = dims->B, S = dims->S, E = dims->E, k = dims->k, sequences = dims->sequences;
  if (sequences == 0 || S == 0) return ffi::Error::Success();
  const Shape shape{B, S, E, sequences, static_cast<int>(n_groups), static_cast<int>(topk_groups),
                    static_cast<int>(k)};
  const float* sel_p = selection.typed_data();
  const float* bias_p = bias.typed_data();
  int32_t* ids_p = expert_ids->typed_data();
  if (penalty > 0.0f && chunk < S) {
    // Threads: the chunk's tokens (each block walks one sequence; a chunk is its unit of parallel work).
    if (!launch_penalized_lanes(sel_p, bias_p, ids_p, shape, penalty, chunk, prior_tokens, stream)) {
      const int threads = static_cast<int>(std::min<int64_t>(256, ceil_div(chunk, 32) * 32));
      const size_t smem = 3 * E * sizeof(float);
      penalized_kernel<<<static_cast<unsigned>(sequences), threads, smem, stream>>>(
          sel_p, bias_p, ids_p, shape, penalty, chunk, prior_tokens);
    }
  } else {
    const int64_t blocks = ceil_div(sequences * S, 128);  // < 2^24: the contract bounds the tokens
    plain_kernel<<<static_cast<unsigned>(blocks), 128, 0, stream>>>(sel_p, bias_p, ids_p, shape);
  }
  return last_cuda_error("router_topk");
}

}  // namespace
}  // namespace turbo_moe

// No scratch memory, no host sync, launch shapes fixed by the operand shapes: command-buffer compatible.
TURBO_MOE_CUDA_HANDLER(turbo_moe_router_topk, turbo_moe::RouterTopkImpl, turbo_moe::router_topk_signature);
