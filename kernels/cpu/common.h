// Shared pieces of the CPU FFI handlers, compiled for the baseline ISA only (isa.h): element types,
// group layout, a deadlock-free parallel_for on XLA's intra-op thread pool (the checks: kernels/contracts).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../contracts/contract.h"
#include "convert.h"
#include "xla/ffi/api/ffi.h"

namespace turbo_moe {

namespace ffi = xla::ffi;

// ---- element conversion: convert.h; the XLA element types it handles ---------------------------
inline bool to_dtype(ffi::DataType t, Dtype* out) {
  switch (t) {
    case ffi::DataType::F32: *out = Dtype::kF32; return true;
    case ffi::DataType::BF16: *out = Dtype::kBF16; return true;
    case ffi::DataType::F16: *out = Dtype::kF16; return true;
    default: return false;
  }
}

// The Dtype of an element type its op's contract has checked (float32/bfloat16/float16).
inline Dtype dtype_of(ffi::DataType t) {
  Dtype d = Dtype::kF32;
  to_dtype(t, &d);
  return d;
}

// ---- group layout ------------------------------------------------------------------------------
// Group sizes are runtime data: negative sizes count as 0 and the cumulative layout is clamped
// to `rows`, so a bad size can never make a kernel write out of bounds. starts has G+1 entries;
// group g owns rows [starts[g], starts[g+1]); rows past starts[G] belong to no group.
inline std::vector<int64_t> group_starts(const int32_t* sizes, int64_t num_groups, int64_t rows) {
  std::vector<int64_t> starts(num_groups + 1, 0);
  int64_t acc = 0;
  for (int64_t g = 0; g < num_groups; ++g) {
    starts[g] = acc;
    acc = std::min(rows, acc + std::max<int64_t>(0, sizes[g]));
  }
  starts[num_groups] = acc;
  return starts;
}

// ---- rows past the groups -----------------------------------------------------------------------
// The memset byte of the rows that belong to no group: 0, or 0xFF (NaN in float32, bfloat16 and float16) where the
// caller passed zero_tail=false, i.e. promised to read only group rows. The CUDA handlers leave such rows
// unwritten; here they are poisoned, so a reader that breaks the promise shows NaN in the CPU tests.
inline int tail_fill(bool zero_tail) { return zero_tail ? 0 : 0xFF; }

// ---- parallel_for on XLA's intra-op pool -------------------------------------------------------
// The caller works too and only waits for helpers that actually started, so the loop finishes
// even when every pool thread is busy elsewhere (no deadlock when called from a pool thread).
inline void parallel_for(ffi::ThreadPool* pool, int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  int64_t threads = pool ? pool->num_threads() : 0;
  if (n == 1 || threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0};
    std::mutex mu;
    std::condition_variable cv;
    int64_t active = 0;
    bool closed = false;
  };
  auto shared = std::make_shared<Shared>();
  const std::function<void(int64_t)>* body = &fn;
  auto drain = [shared, body, n]() {
    for (int64_t i; (i = shared->next.fetch_add(1)) < n;) (*body)(i);
  };
  int64_t helpers = std::min<int64_t>(threads, n) - 1;
  for (int64_t h = 0; h < helpers; ++h) {
    pool->Schedule([shared, drain]() {
      {
        std::lock_guard<std::mutex> lock(shared->mu);
        if (shared->closed) return;  // started too late: the caller finished the work
        ++shared->active;
      }
      drain();
      std::lock_guard<std::mutex> lock(shared->mu);
      if (--shared->active == 0) shared->cv.notify_all();
    });
  }
  drain();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->closed = true;
  shared->cv.wait(lock, [&] { return shared->active == 0; });
}

// copy(b, t, r) for every routed copy of a (batch, T, k) row index: token t of batch b goes to row r in [0, T*k)
// (other entries are dropped copies). Tokens run in parallel, `chunk` of them a work item; each row has one writer.
template <typename Copy>
void for_each_routed_copy(ffi::ThreadPool* pool, const int32_t* row_p, int64_t batch, int64_t T, int64_t k,
                          int64_t chunk, const Copy& copy) {
  const int64_t slots = T * k, chunks = (T + chunk - 1) / chunk;
  parallel_for(pool, batch * chunks, [&](int64_t item) {
    const int64_t b = item / chunks, t0 = (item % chunks) * chunk, t1 = std::min(T, t0 + chunk);
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t j = 0; j < k; ++j) {
        const int32_t r = row_p[b * slots + t * k + j];
        if (r >= 0 && r < slots) copy(b, t, r);
      }
  });
}

}  // namespace turbo_moe
