// Row-copy helpers of the permute/unpermute kernels: the widest vector type (16/8/4/2 bytes) that
// divides a row and every row base, so rows move as 16-byte loads/stores whenever they can.
#pragma once

#include "common.cuh"

namespace turbo_moe {

// Largest power-of-two width in {16, 8, 4, 2, 1} bytes dividing row_bytes and all base pointers.
inline int vector_bytes(int64_t row_bytes, std::initializer_list<const void*> bases) {
  for (int w : {16, 8, 4, 2}) {
    bool ok = row_bytes % w == 0;
    for (const void* p : bases) ok = ok && reinterpret_cast<uintptr_t>(p) % w == 0;
    if (ok) return w;
  }
  return 1;
}

// Calls fn(V{}) with V a trivially copyable type of `bytes` bytes.
template <typename Fn>
void dispatch_vector(int bytes, Fn&& fn) {
  switch (bytes) {
    case 16: fn(uint4{}); break;
    case 8: fn(uint2{}); break;
    case 4: fn(uint32_t{}); break;
    case 2: fn(uint16_t{}); break;
    default: fn(uint8_t{}); break;
  }
}

}  // namespace turbo_moe
