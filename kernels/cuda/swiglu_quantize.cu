// CUDA FFI handler turbo_moe_swiglu_quantize (contract: kernels/contracts/swiglu_quantize.h; CPU:
// kernels/cpu/swiglu_quantize.cc): the FP8 expert block's SwiGLU written in FP8 per 1x128 tile in one pass over h, in
// place of XLA's SwiGLU writing act and quantize_rows reading it again.
// One warp per row, a chunk of the row at a time: gate and up are read 16 bytes a lane, act = gate / (1 +
// expf(-gate)) * up in float32 (grouped_gemm_swiglu.cu's formula) rounded to h's dtype and staged in the warp's
// shared memory, then row_quantize.cuh's warp step (quantize_rows.cu's) quantises the staged act, so the codes and
// scales are quantize_rows' of that act bit for bit. Staged because that step's lanes hold 4 values of a tile and a
// 16-byte load 8 bf16: shared memory regroups them, and the step stays the one quantize_rows runs.
// Rows from valid on are skipped (left unwritten). No scratch, no host synchronisation, one launch on the stream:
// safe in XLA's command buffers.
#include "../contracts/registration.h"
#include "../contracts/swiglu_quantize.h"
#include "common.cuh"
#include "row_quantize.cuh"

namespace turbo_moe {
namespace {

static_assert(kRowQuantizeTile == kSwigluQuantizeTile);

constexpr int kThreads = 256;  // 8 warps, 8 rows at a time
constexpr int kWarps = kThreads / 32;
constexpr int kLoads = 2;  // 16-byte loads of gate (and of up) a lane has in flight per chunk
constexpr int kMinBlocks = 3;  // resident blocks an SM: caps registers at 80, no spills (4 loads took 113 for bf16)
constexpr int64_t kMaxBlocks = int64_t{1} << 30;

// A chunk is 32 lanes x kLoads x 16 bytes of act (512 bf16/f16 or 256 float32 values): a multiple of the tile.
template <typename T>
constexpr int chunk_values() {
  return 32 * kLoads * (16 / static_cast<int>(sizeof(T)));
}

template <__nv_fp8_interpretation_t kFormat, typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    swiglu_quantize_kernel(const T* __restrict__ h, const int32_t* __restrict__ valid, uint32_t* __restrict__ q,
                           float* __restrict__ scale, int64_t rows, int64_t M, int64_t F) {
  constexpr int V = 16 / sizeof(T), kChunk = chunk_values<T>();
  using Wide = Pack<T, V>;
  __shared__ Wide stage[kWarps][kChunk / V];  // each warp's act chunk, in h's dtype
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + warp; r < rows; r += warps) {
    if (r % M >= valid[r / M]) continue;  // past the problem's valid rows (a worst-case EP tail): unwritten
    const Wide* gate = reinterpret_cast<const Wide*>(h + r * 2 * F);
    const Wide* up = reinterpret_cast<const Wide*>(h + r * 2 * F + F);
    for (int64_t c0 = 0; c0 < F; c0 += kChunk) {
      const int64_t width = min64(kChunk, F - c0), packs = width / V;
      Wide g[kLoads], u[kLoads];
#pragma unroll
      for (int j = 0; j < kLoads; ++j)  // every load issued before the first exp (latency)
        if (j * 32 + lane < packs) {
          g[j] = gate[c0 / V + j * 32 + lane];
          u[j] = up[c0 / V + j * 32 + lane];
        }
#pragma unroll
      for (int j = 0; j < kLoads; ++j)
        if (j * 32 + lane < packs) {
          Wide a;
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const float x = to_f32(g[j].v[i]);
            a.v[i] = from_f32<T>(x / (1.0f + expf(-x)) * to_f32(u[j].v[i]));
          }
          stage[warp][j * 32 + lane] = a;
        }
      __syncwarp();
      warp_quantize_row<kFormat>(reinterpret_cast<const T*>(stage[warp]), width, q + (r * F + c0) / 4,
                                 scale + r * (F / kSwigluQuantizeTile) + c0 / kSwigluQuantizeTile, lane);
      __syncwarp();  // the stage is read before the next chunk overwrites it
    }
  }
}

template <__nv_fp8_interpretation_t kFormat>
void launch(cudaStream_t stream, ffi::AnyBuffer h, const int32_t* valid, uint32_t* q, float* scale,
            const SwigluQuantizeDims& dims) {
  const unsigned blocks = static_cast<unsigned>(min64(ceil_div(dims.rows, kWarps), kMaxBlocks));
  dispatch_float(h.element_type(), [&](auto tag) {
    using Elem = decltype(tag);
    swiglu_quantize_kernel<kFormat, Elem><<<blocks, kThreads, 0, stream>>>(
        static_cast<const Elem*>(h.untyped_data()), valid, q, scale, dims.rows, dims.M, dims.F);
  });
}

ffi::Error SwigluQuantizeImpl(cudaStream_t stream, ffi::AnyBuffer h, ffi::Buffer<ffi::S32> valid,
                              ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> scale) {
  auto dims = check_swiglu_quantize(h, valid, *q, *scale);
  if (!dims) return dims.error();
  if (dims->rows == 0) return ffi::Error::Success();
  // XLA's buffers are aligned and F is a multiple of 128, so every row's gate and up start on 16 bytes.
  auto* q_p = static_cast<uint32_t*>(q->untyped_data());
  auto* s_p = static_cast<float*>(scale->untyped_data());
  if (dims->e4m3)
    launch<__NV_E4M3>(stream, h, valid.typed_data(), q_p, s_p, *dims);
  else
    launch<__NV_E5M2>(stream, h, valid.typed_data(), q_p, s_p, *dims);
  return last_cuda_error("swiglu_quantize");
}

}  // namespace
}  // namespace turbo_moe

TURBO_MOE_CUDA_HANDLER(turbo_moe_swiglu_quantize, turbo_moe::SwigluQuantizeImpl,
                       turbo_moe::swiglu_quantize_signature);
