// What every op contract (kernels/contracts/<op>.h) is made of. A contract is host-only C++17: it checks an FFI
// call's operands and results and derives the sizes the kernels need, and both the CPU handler
// (kernels/cpu/<op>.cc) and the CUDA handler (kernels/cuda/<op>.cu) call it first. So both backends accept the
// same calls and refuse a bad one with the same message. A bound that only one backend's kernel needs (a CUDA
// grid dimension, a shared-memory table) is part of the contract too: a program that runs on the CPU then runs on
// the GPU. Only what one backend alone owns (the CUDA workspace sizes) is checked by that handler.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace turbo_moe {

namespace ffi = xla::ffi;

using Dims = ffi::AnyBuffer::Dimensions;

inline ffi::Error invalid(const std::string& msg) { return ffi::Error::InvalidArgument(msg); }

// A contract's refusal: converts to the ffi::ErrorOr<...> the contract returns.
inline ffi::Unexpected<ffi::Error> refuse(const std::string& msg) { return ffi::Unexpected<ffi::Error>(invalid(msg)); }

// The float element types every kernel takes.
inline bool is_float_type(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

// vmap uses `broadcast_all`: every operand carries the same leading batch dims. The product of the leading dims
// of a buffer whose trailing `core_rank` dims are the op's own.
inline int64_t leading_product(Dims dims, int64_t core_rank) {
  int64_t p = 1;
  for (int64_t i = 0; i + core_rank < static_cast<int64_t>(dims.size()); ++i) p *= dims[i];
  return p;
}

// dims == lead[0:lead_rank] + core: a buffer with `lead`'s first lead_rank (batch) dims, then its own.
inline bool has_shape(Dims dims, Dims lead, int64_t lead_rank, std::initializer_list<int64_t> core) {
  if (static_cast<int64_t>(dims.size()) != lead_rank + static_cast<int64_t>(core.size()) ||
      static_cast<int64_t>(lead.size()) < lead_rank)
    return false;
  for (int64_t i = 0; i < lead_rank; ++i)
    if (dims[i] != lead[i]) return false;
  int64_t i = lead_rank;
  for (int64_t d : core)
    if (dims[i++] != d) return false;
  return true;
}

inline bool same_dims(Dims a, Dims b) { return has_shape(a, b, static_cast<int64_t>(b.size()), {}); }

// Row counts, row indices and group offsets travel as int32 on both backends.
constexpr int64_t kInt32Rows = int64_t{1} << 31;

}  // namespace turbo_moe
