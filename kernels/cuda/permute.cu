// CUDA FFI handlers of the single-device MoE dispatch (contract of kernels/cpu/permute.cc):
//   turbo_moe_permute: x (T, H), expert_ids (T, k) -> x_sorted (T*k, H), group_sizes (E,), row_index (T, k)
//   turbo_moe_permute_rows: x (T, H), row_index (T, k), group_sizes (E,) -> x_sorted (T*k, H): the copy step of a
//     permute whose row_index and group sizes are known (step 4 alone; the expert block's backward rebuilds rows).
// Token copies are stably sorted by expert in flat slot order s = t*k + j; a copy whose expert id
// is outside [0, E) is dropped (row_index = -1) and the rows past sum(group_sizes) are zero.
// Counting sort on the device, deterministic, no atomics on global memory, no host sync:
//   1. per chunk of kChunk slots, count each bucket (E experts + 1 "dropped" bucket);
//   2. one exclusive scan over the bucket-major (bucket, chunk) counts = each chunk's first row
//      per bucket; group sizes are differences of that scan;
//   3. per chunk, one warp ranks its slots in order (warp match) -> row_index;
//   4. one warp per slot copies the token's row; rows past the valid total are zero-filled.
// The counts live in a workspace result that Python sizes with turbo_moe_permute_workspace_bytes (not
// XLA scratch, which is per call and keeps a handler out of XLA's command buffers).
#include "../contracts/permute.h"
#include "../contracts/registration.h"
#include "block_scan.cuh"
#include "common.cuh"
#include "row_copy.cuh"

namespace turbo_moe {
namespace {

constexpr int kChunk = 2048;  // slots per chunk (steps 1 and 3)

// int32 counts per batch element: (E + 1) buckets x chunks, + the total.
int64_t count_table_size(int64_t slots, int64_t E) { return (E + 1) * ceil_div(slots, kChunk) + 1; }

__device__ __forceinline__ int bucket_of(int32_t id, int64_t E) {
  return (id >= 0 && id < E) ? id : static_cast<int>(E);
}

// counts[b][bucket * chunks + c] = slots of chunk c in bucket (bucket-major for step 2).
__global__ void count_chunks_kernel(const int32_t* ids, int64_t slots, int64_t E, int64_t chunks,
                                    int32_t* counts) {
  extern __shared__ int32_t hist[];  // E + 1
  const int64_t b = blockIdx.y, c = blockIdx.x;
  for (int64_t e = threadIdx.x; e <= E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int32_t* chunk_ids = ids + b * slots + c * kChunk;
  const int64_t n = min64(kChunk, slots - c * kChunk);
  for (int64_t s = threadIdx.x; s < n; s += blockDim.x) atomicAdd(&hist[bucket_of(chunk_ids[s], E)], 1);
  __syncthreads();
  int32_t* out = counts + b * ((E + 1) * chunks + 1);
  for (int64_t e = threadIdx.x; e <= E; e += blockDim.x) out[e * chunks + c] = hist[e];
}

// In-place exclusive scan of each batch's (E+1)*chunks counts; element [len] gets the total.
// Each thread sums a contiguous segment, the block scans the segment sums, then each thread
// rewrites its segment. Also writes group_sizes[e] = first row of bucket e+1 - first row of e.
__global__ void scan_counts_kernel(int32_t* counts, int64_t E, int64_t chunks, int32_t* group_sizes) {
  __shared__ long long warp_sums[32];
  const int64_t b = blockIdx.x, len = (E + 1) * chunks;
  int32_t* v = counts + b * (len + 1);
  const int64_t seg = ceil_div(len, blockDim.x);
  const int64_t lo = min64(len, threadIdx.x * seg), hi = min64(len, lo + seg);
  long long sum = 0;
  for (int64_t i = lo; i < hi; ++i) sum += v[i];
  long long total;
  long long run = block_inclusive_scan(sum, warp_sums, &total) - sum;
  for (int64_t i = lo; i < hi; ++i) {
    const int32_t x = v[i];
    v[i] = static_cast<int32_t>(run);
    run += x;
  }
  if (threadIdx.x == 0) v[len] = static_cast<int32_t>(total);
  __syncthreads();
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x)
    group_sizes[b * E + e] = v[(e + 1) * chunks] - v[e * chunks];
}

// One warp per chunk ranks the chunk's slots in order: row = first row of (bucket, chunk) +
// number of earlier slots of the chunk in the same bucket.
__global__ void rank_slots_kernel(const int32_t* ids, int64_t slots, int64_t E, int64_t chunks,
                                  const int32_t* scanned, int32_t* row_index) {
  extern __shared__ int32_t smem[];
  int32_t* next_row = smem;               // E + 1
  int32_t* chunk_ids = smem + E + 1;      // kChunk
  const int64_t b = blockIdx.y, c = blockIdx.x;
  const int lane = threadIdx.x;
  const int32_t* base = scanned + b * ((E + 1) * chunks + 1);
  for (int64_t e = lane; e <= E; e += 32) next_row[e] = base[e * chunks + c];
  const int64_t n = min64(kChunk, slots - c * kChunk);
  const int32_t* src = ids + b * slots + c * kChunk;
  for (int64_t s = lane; s < n; s += 32) chunk_ids[s] = src[s];
  __syncwarp();
  int32_t* dst = row_index + b * slots + c * kChunk;
  const unsigned lower = (1u << lane) - 1u;
  for (int64_t s0 = 0; s0 < n; s0 += 32) {
    const int64_t s = s0 + lane;
    const int bucket = s < n ? bucket_of(chunk_ids[s], E) : -1;  // -1: lane past the chunk
    const unsigned peers = __match_any_sync(0xffffffffu, bucket);
    const int row = bucket >= 0 ? next_row[bucket] + __popc(peers & lower) : 0;
    __syncwarp();
    if (bucket >= 0 && lane == 31 - __clz(peers)) next_row[bucket] += __popc(peers);
    __syncwarp();
    if (s < n) dst[s] = bucket < E ? row : -1;
  }
}

// One warp per slot: x_sorted[row_index[s]] = x[s / k] in vectors of V.
template <typename V>
__global__ void gather_rows_kernel(const char* __restrict__ x, const int32_t* __restrict__ row_index,
                                   char* __restrict__ x_sorted, int64_t T, int64_t k, int64_t row_bytes,
                                   int64_t total_slots) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (warp >= total_slots) return;
  const int64_t slots = T * k, b = warp / slots, s = warp % slots;
  const int32_t r = row_index[warp];
  if (r < 0 || r >= slots) return;  // a dropped copy (permute_rows: any row outside the output)
  const V* src = reinterpret_cast<const V*>(x + (b * T + s / k) * row_bytes);
  V* dst = reinterpret_cast<V*>(x_sorted + (b * slots + r) * row_bytes);
  const int64_t n = row_bytes / static_cast<int64_t>(sizeof(V));
  // Up to kBatch loads in flight per lane before the first store (a 2560-byte bf16 row at d 1280 is 5 per
  // lane): one load at a time left the copy latency-bound (docs/notes/step-time.md).
  constexpr int kBatch = 8;
  for (int64_t i0 = lane; i0 < n; i0 += 32 * kBatch) {
    V tmp[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      if (i0 + 32 * j < n) tmp[j] = src[i0 + 32 * j];
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      if (i0 + 32 * j < n) dst[i0 + 32 * j] = tmp[j];
  }
}

ffi::Error PermuteImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> expert_ids,
                       ffi::Result<ffi::AnyBuffer> x_sorted, ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                       ffi::Result<ffi::Buffer<ffi::S32>> row_index, ffi::Result<ffi::AnyBuffer> workspace,
                       int64_t num_experts, bool zero_tail) {
  auto dims = check_permute(x, expert_ids, *x_sorted, *group_sizes, *row_index, num_experts);
  if (!dims) return dims.error();
  const int64_t batch = dims->batch, T = dims->T, H = dims->H, k = dims->k, E = dims->E, slots = dims->slots;
  if (batch == 0) return ffi::Error::Success();
  if (slots == 0) {  // nothing routed: every group is empty
    cudaMemsetAsync(group_sizes->typed_data(), 0, batch * E * sizeof(int32_t), stream);
    return last_cuda_error("permute");
  }
  const int64_t row_bytes = H * byte_width(x.element_type());
  const int64_t chunks = ceil_div(slots, kChunk), table = count_table_size(slots, E);
  const size_t need = static_cast<size_t>(batch * table) * sizeof(int32_t);
  if (workspace->size_bytes() < need)
    return invalid("permute: workspace of " + std::to_string(workspace->size_bytes()) + " bytes, this call needs " +
                   std::to_string(need) + " (turbo_moe/ops/permute.py sizes it with turbo_moe_permute_workspace_bytes)");
  int32_t* counts = static_cast<int32_t*>(workspace->untyped_data());
  const int32_t* ids = expert_ids.typed_data();
  int32_t* rows = row_index->typed_data();

  const dim3 chunk_grid(static_cast<unsigned>(chunks), static_cast<unsigned>(batch));
  count_chunks_kernel<<<chunk_grid, 256, (E + 1) * sizeof(int32_t), stream>>>(ids, slots, E, chunks, counts);
  scan_counts_kernel<<<static_cast<unsigned>(batch), 1024, 0, stream>>>(counts, E, chunks,
                                                                        group_sizes->typed_data());
  rank_slots_kernel<<<chunk_grid, 32, (E + 1 + kChunk) * sizeof(int32_t), stream>>>(ids, slots, E, chunks,
                                                                                    counts, rows);
  if (row_bytes > 0) {
    const char* x_p = static_cast<const char*>(x.untyped_data());
    char* xs_p = static_cast<char*>(x_sorted->untyped_data());
    const int vb = vector_bytes(row_bytes, {x_p, xs_p});
    const int64_t total_slots = batch * slots;
    const unsigned blocks = static_cast<unsigned>(ceil_div(total_slots, 8));
    dispatch_vector(vb, [&](auto tag) {
      gather_rows_kernel<decltype(tag)><<<blocks, 256, 0, stream>>>(x_p, rows, xs_p, T, k, row_bytes, total_slots);
    });
    // Rows past the valid total (dropped copies) are zero, unless the caller leaves them unwritten (a worst-case
    // EP buffer is mostly dropped copies); the total sits at counts[E * chunks].
    if (zero_tail) launch_zero_tail_rows(xs_p, batch, slots, row_bytes, counts + E * chunks, table, stream);
  }
  return last_cuda_error("permute");
}

// Rows [sum(group_sizes[b]), rows) of each batch's (rows, row_bytes) block are zeroed; every block sums the E sizes
// itself (a few KB from L2), so no table of totals is needed.
__global__ void zero_rows_past_groups_kernel(char* data, int64_t rows, int64_t row_bytes, const int32_t* group_sizes,
                                             int64_t E) {
  const int64_t b = blockIdx.y;
  const long long total = block_group_total(group_sizes, b, E);
  char* base = data + b * rows * row_bytes;
  const int64_t begin = min(static_cast<int64_t>(total), rows) * row_bytes, end = rows * row_bytes;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (begin % 16 == 0 && end % 16 == 0 && reinterpret_cast<uintptr_t>(base) % 16 == 0) {
    uint4* v = reinterpret_cast<uint4*>(base + begin);
    for (int64_t i = tid; i < (end - begin) / 16; i += stride) v[i] = make_uint4(0, 0, 0, 0);
  } else {
    for (int64_t i = begin + tid; i < end; i += stride) base[i] = 0;
  }
}

ffi::Error PermuteRowsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> row_index,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> x_sorted, bool zero_tail) {
  auto dims = check_permute_rows(x, row_index, group_sizes, *x_sorted);
  if (!dims) return dims.error();
  const int64_t batch = dims->batch, T = dims->T, H = dims->H, k = dims->k, E = dims->E, slots = dims->slots;
  const int64_t row_bytes = H * byte_width(x.element_type());
  if (batch == 0 || slots == 0 || row_bytes == 0) return ffi::Error::Success();
  const char* x_p = static_cast<const char*>(x.untyped_data());
  char* xs_p = static_cast<char*>(x_sorted->untyped_data());
  const int64_t total_slots = batch * slots;
  dispatch_vector(vector_bytes(row_bytes, {x_p, xs_p}), [&](auto tag) {
    gather_rows_kernel<decltype(tag)><<<static_cast<unsigned>(ceil_div(total_slots, 8)), 256, 0, stream>>>(
        x_p, row_index.typed_data(), xs_p, T, k, row_bytes, total_slots);
  });
  if (zero_tail)
    zero_rows_past_groups_kernel<<<dim3(32, static_cast<unsigned>(batch)), 256, 0, stream>>>(
        xs_p, slots, row_bytes, group_sizes.typed_data(), E);
  return last_cuda_error("permute_rows");
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CUDA_HANDLER(turbo_moe_permute_rows, turbo_moe::PermuteRowsImpl, turbo_moe::permute_rows_signature);

// No scratch, no host synchronisation, every launch on `stream`: command-buffer compatible.
TURBO_MOE_CUDA_HANDLER(turbo_moe_permute, turbo_moe::PermuteImpl, turbo_moe::permute_signature);

// Workspace bytes of one permute call over `batch` leading problems of `slots` = T * k copies and E experts.
extern "C" int64_t turbo_moe_permute_workspace_bytes(int64_t batch, int64_t slots, int64_t num_experts) {
  return batch * turbo_moe::count_table_size(slots, num_experts) * static_cast<int64_t>(sizeof(int32_t));
}
