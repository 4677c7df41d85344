// Aligned XLA scratch allocation for the handlers that need device scratch memory.
#pragma once

#include "common.cuh"

namespace turbo_moe {

// XLA's FFI scratch allocator rejects alignments above 16 bytes: over-allocate by 256 bytes and
// align the base here (TMA descriptors and 16-byte vectors in the workspace need more than 16).
inline void* allocate_scratch_aligned(ffi::ScratchAllocator& scratch, size_t bytes) {
  auto mem = scratch.Allocate(bytes + 256, 16);
  if (!mem.has_value()) return nullptr;
  return reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(*mem) + 255) & ~uintptr_t(255));
}

}  // namespace turbo_moe
