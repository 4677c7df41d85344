// Benchmark aids, built into their own library (libturbo_moe_cuda_bench.so), never into the ops' one: a CUDA-event
// marker that runs on XLA's own stream, so that benchmarks/grouped_gemm.py can time a jitted region with device
// events, and a plain device-to-device copy (the permute benchmark's baseline).
//   turbo_moe_bench_event: anchor (any) -> token int32[1]; records event `slot` on the stream.
//   turbo_moe_bench_copy: x -> a copy of x (one cudaMemcpyAsync).
//   turbo_moe_bench_elapsed_ms(start, end): waits for event `end`, returns the time between them.
#include <mutex>

#include "common.cuh"

namespace turbo_moe {
namespace {

constexpr int64_t kSlots = 16;
cudaEvent_t g_events[kSlots];
bool g_created[kSlots] = {};
std::mutex g_mutex;

ffi::Error BenchEventImpl(cudaStream_t stream, ffi::AnyBuffer /*anchor*/,
                          ffi::Result<ffi::Buffer<ffi::S32>> token, int64_t slot) {
  if (slot < 0 || slot >= kSlots) return invalid("bench_event: slot must be in [0, 16)");
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!g_created[slot]) {
      if (cudaEventCreate(&g_events[slot]) != cudaSuccess) return last_cuda_error("bench_event");
      g_created[slot] = true;
    }
  }
  cudaMemsetAsync(token->typed_data(), 0, sizeof(int32_t), stream);
  cudaEventRecord(g_events[slot], stream);
  return last_cuda_error("bench_event");
}

// The copy baseline of the permute benchmark: one device-to-device cudaMemcpyAsync.
ffi::Error BenchCopyImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  if (x.size_bytes() != y->size_bytes()) return invalid("bench_copy: x and y must have the same size");
  cudaMemcpyAsync(y->untyped_data(), x.untyped_data(), x.size_bytes(), cudaMemcpyDeviceToDevice, stream);
  return last_cuda_error("bench_copy");
}

}  // namespace
}  // namespace turbo_moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(turbo_moe_bench_copy, turbo_moe::BenchCopyImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()                 // x
                                  .Ret<xla::ffi::AnyBuffer>());               // y, a copy of x

XLA_FFI_DEFINE_HANDLER_SYMBOL(turbo_moe_bench_event, turbo_moe::BenchEventImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()                 // anchor: orders the marker
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()     // token [1]
                                  .Attr<int64_t>("slot"));

// Milliseconds between two recorded events; negative when either slot was never recorded.
extern "C" float turbo_moe_bench_elapsed_ms(int start, int end) {
  using namespace turbo_moe;
  if (start < 0 || end < 0 || start >= kSlots || end >= kSlots || !g_created[start] || !g_created[end])
    return -1.f;
  if (cudaEventSynchronize(g_events[end]) != cudaSuccess) return -2.f;
  float ms = 0.f;
  if (cudaEventElapsedTime(&ms, g_events[start], g_events[end]) != cudaSuccess) return -3.f;
  return ms;
}
