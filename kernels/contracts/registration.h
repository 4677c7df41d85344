// Registers an op's handler with the FFI signature its contract declares (`<op>_signature` in
// kernels/contracts/<op>.h: the operands, results and attributes after the backend's context), so the CPU and
// CUDA handlers of one target take the same call. The CPU handler gets XLA's intra-op thread pool; the CUDA
// handler the stream, and it says it is command-buffer compatible: no handler here takes XLA scratch or
// synchronises with the host (a workspace is a result that Python sizes).
#pragma once

#include "xla/ffi/api/ffi.h"

#define TURBO_MOE_CPU_HANDLER(symbol, impl, signature) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, impl, signature(::xla::ffi::Ffi::Bind().Ctx<::xla::ffi::ThreadPool>()))

// The including .cu has cudaStream_t (cuda_runtime.h).
#define TURBO_MOE_CUDA_HANDLER(symbol, impl, signature)                                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, impl,                                                              \
                                signature(::xla::ffi::Ffi::Bind().Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()), \
                                {::xla::ffi::Traits::kCmdBufferCompatible})
