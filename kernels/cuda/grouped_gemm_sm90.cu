// Chooses the Hopper instance for an element type. Host code only, so it builds for every
// target; without CUTLASS (TURBO_MOE_WITH_SM90 undefined) the portable kernels are used.
#include "grouped_gemm.h"

namespace turbo_moe {

#ifdef TURBO_MOE_WITH_SM90
namespace sm90 {
ffi::Error forward_bf16(const GroupedGemmArgs&, void*, size_t, int, cudaStream_t);
ffi::Error forward_f16(const GroupedGemmArgs&, void*, size_t, int, cudaStream_t);
ffi::Error weight_grad_bf16(const GroupedGemmArgs&, void*, size_t, int, cudaStream_t);
ffi::Error weight_grad_f16(const GroupedGemmArgs&, void*, size_t, int, cudaStream_t);
size_t scratch_bytes_bf16(int64_t n, int device);
size_t scratch_bytes_f16(int64_t n, int device);
}  // namespace sm90

bool sm90_available() { return true; }

size_t sm90_scratch_bytes(const GroupedGemmArgs& a, bool /*weight_grad*/, int device) {
  const int64_t n = a.batch * a.G;
  return a.in_type == ffi::DataType::BF16 ? sm90::scratch_bytes_bf16(n, device)
                                          : sm90::scratch_bytes_f16(n, device);
}

ffi::Error launch_grouped_gemm_sm90(const GroupedGemmArgs& a, void* scratch, size_t bytes, int device,
                                    cudaStream_t stream) {
  return a.in_type == ffi::DataType::BF16 ? sm90::forward_bf16(a, scratch, bytes, device, stream)
                                          : sm90::forward_f16(a, scratch, bytes, device, stream);
}

ffi::Error launch_weight_grad_sm90(const GroupedGemmArgs& a, void* scratch, size_t bytes, int device,
                                   cudaStream_t stream) {
  return a.in_type == ffi::DataType::BF16 ? sm90::weight_grad_bf16(a, scratch, bytes, device, stream)
                                          : sm90::weight_grad_f16(a, scratch, bytes, device, stream);
}
#else
bool sm90_available() { return false; }
size_t sm90_scratch_bytes(const GroupedGemmArgs&, bool, int) { return 0; }
ffi::Error launch_grouped_gemm_sm90(const GroupedGemmArgs&, void*, size_t, int, cudaStream_t) {
  return ffi::Error::Internal("turbo_moe was built without the Hopper (CUTLASS) kernels");
}
ffi::Error launch_weight_grad_sm90(const GroupedGemmArgs&, void*, size_t, int, cudaStream_t) {
  return ffi::Error::Internal("turbo_moe was built without the Hopper (CUTLASS) kernels");
}
#endif

}  // namespace turbo_moe

// Which grouped GEMM this build holds (1: the Hopper CUTLASS kernels, 0: the portable ones only), for
// turbo_moe/ops/_ffi.py `kernel_info()` and its warning on a Hopper GPU without the fast kernel.
extern "C" int turbo_moe_grouped_gemm_has_sm90() { return turbo_moe::sm90_available() ? 1 : 0; }
