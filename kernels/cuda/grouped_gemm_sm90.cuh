// Hopper grouped GEMM on CUTLASS 3 (ptr-array grouped kernel: TMA loads, wgmma, warp-specialised
// cooperative schedule, persistent group tile scheduler). Per-group problem shapes, pointers and
// strides are built on the device from group_sizes, so nothing waits on the host. Included only
// by the grouped_gemm_sm90_*.cu instance files, which are compiled for sm_90a alone.
#pragma once

#include <string>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "group_walk.cuh"
#include "grouped_gemm.h"

namespace turbo_moe::sm90 {

using namespace cute;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group

// Cooperative schedule: two consumer warpgroups share a 128x256 tile; a 1x2 cluster multicasts
// the lhs tile to the two CTAs of neighbouring N tiles. (A ping-pong 128x128 weight-grad variant
// measured slower on every benchmark shape: docs/performance.md, "The grouped GEMM".)
struct Cooperative {
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<_1, _2, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// The same tile without the cluster, for outputs whose count of 256-wide N tiles is odd: the group
// tile scheduler rounds each problem's N tiles up to the cluster's 2, so at N = 1280 (5 tiles, the
// `reduced` model's d_model) a sixth of the CTAs' tiles were empty, and the kernel ran well below its rate at
// even counts (docs/kernels.md).
struct CooperativeNoCluster {
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<_1, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// Whether an output N wide takes the cluster-free instance (an odd number of N tiles).
inline bool odd_n_tiles(int64_t N) { return (N + 255) / 256 % 2 == 1; }

// One grouped GEMM configuration: D (row-major) = A @ B, float32 accumulation, no C operand.
template <typename Element, typename LayoutA, typename LayoutB, typename Schedule = Cooperative>
struct Config {
  using TileShape = typename Schedule::TileShape;
  using ClusterShape = typename Schedule::ClusterShape;
  static constexpr int kAlign = 8;  // 16 bytes of a 16-bit type: TMA needs K, N % 8 == 0

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor*, kAlign,     // no C
      Element, cutlass::layout::RowMajor*, kAlign,  // D
      typename Schedule::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element,
      LayoutB*, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
};

// Device arrays the grouped kernel reads, carved from XLA scratch (n = batch * G problems).
template <typename Cfg, typename Element>
struct DeviceArgs {
  typename Cfg::Shape3* shapes;
  const Element** ptr_a;
  const Element** ptr_b;
  Element** ptr_d;
  typename Cfg::StrideA* stride_a;
  typename Cfg::StrideB* stride_b;
  typename Cfg::StrideD* stride_d;

  static DeviceArgs carve(ScratchArena& arena, int64_t n) {
    DeviceArgs d;
    d.shapes = arena.take<typename Cfg::Shape3>(n);
    d.ptr_a = arena.take<const Element*>(n);
    d.ptr_b = arena.take<const Element*>(n);
    d.ptr_d = arena.take<Element*>(n);
    d.stride_a = arena.take<typename Cfg::StrideA>(n);
    d.stride_b = arena.take<typename Cfg::StrideB>(n);
    d.stride_d = arena.take<typename Cfg::StrideD>(n);
    return d;
  }
};

constexpr int kPrologueThreads = 256;

// Forward prologue, grid (1 + Z, batch). Block (0, b) writes batch b's offsets and the GEMM's arguments: problem
// i = (b, g) is rows [offsets[g], offsets[g+1]) of lhs times rhs[b, g]; an empty group gets M = 0 (no tiles).
// Blocks (1.., b) zero out's rows past the groups, which the GEMM does not write. One launch instead of three
// (offsets, arguments, tail): each was a tiny kernel, hundreds of them a `reduced` step.
template <typename Cfg, typename Element, bool kTransposeRhs>
__global__ void __launch_bounds__(kPrologueThreads)
    forward_prologue(const int32_t* sizes, int32_t* offsets, const Element* lhs, const Element* rhs, Element* out,
                     int64_t M, int64_t K, int64_t N, int64_t G, DeviceArgs<Cfg, Element> d) {
  const int64_t b = blockIdx.y;
  int32_t* off = offsets + b * (G + 1);
  if (blockIdx.x == 0) {
    const int64_t total = scan_group_rows(sizes + b * G, G, M, [&](int64_t g, int64_t start, int64_t rows) {
      if (g >= G) return;
      off[g] = static_cast<int32_t>(start);
      const int64_t i = b * G + g;
      const int m = static_cast<int>(rows), k = static_cast<int>(K), nn = static_cast<int>(N);
      d.shapes[i] = typename Cfg::Shape3(m, nn, k);
      d.ptr_a[i] = lhs + (b * M + start) * K;
      d.ptr_b[i] = rhs + i * K * N;
      d.ptr_d[i] = out + (b * M + start) * N;
      d.stride_a[i] = cutlass::make_cute_packed_stride(typename Cfg::StrideA{}, make_shape(max(m, 1), k, 1));
      d.stride_b[i] = cutlass::make_cute_packed_stride(typename Cfg::StrideB{}, make_shape(nn, k, 1));
      d.stride_d[i] = cutlass::make_cute_packed_stride(typename Cfg::StrideD{}, make_shape(max(m, 1), nn, 1));
    });
    if (threadIdx.x == 0) off[G] = static_cast<int32_t>(total);
  } else {
    const int64_t total = scan_group_rows(sizes + b * G, G, M, [](int64_t, int64_t, int64_t) {});
    const int64_t row_bytes = N * static_cast<int64_t>(sizeof(Element));  // N % 8 == 0: a multiple of 16
    zero_span(reinterpret_cast<char*>(out + b * M * N), total * row_bytes, M * row_bytes, blockIdx.x - 1,
              gridDim.x - 1);
  }
}

// Weight-grad prologue, grid (1 + Z, batch). Block (0, b): offsets, then the arguments of problem i = (b, g), (K x
// rows_g) @ (rows_g x N) with A = lhs[rows_g]^T (column-major view of the row-major lhs) and B = d_out[rows_g]; an
// empty group gets M = 0. Blocks (1.., b) zero dw[b, g] of every empty group, which the GEMM does not write.
template <typename Cfg, typename Element>
__global__ void __launch_bounds__(kPrologueThreads)
    weight_grad_prologue(const int32_t* sizes, int32_t* offsets, const Element* lhs, const Element* d_out,
                         Element* dw, int64_t M, int64_t K, int64_t N, int64_t G, DeviceArgs<Cfg, Element> d) {
  const int64_t b = blockIdx.y;
  int32_t* off = offsets + b * (G + 1);
  if (blockIdx.x == 0) {
    const int64_t total = scan_group_rows(sizes + b * G, G, M, [&](int64_t g, int64_t start, int64_t) {
      if (g < G) off[g] = static_cast<int32_t>(start);
    });
    if (threadIdx.x == 0) off[G] = static_cast<int32_t>(total);
    __syncthreads();  // the whole table, written by this block, before the ranks below read it
    for (int64_t g = threadIdx.x; g < G; g += blockDim.x) {
      const int64_t start = off[g], rows = off[g + 1] - start;
      // Problems go heaviest group first (slot = rank by rows, ties by index; the output stays dw[i]). Every tile
      // of a problem runs its group's rows as the K loop, and the persistent scheduler deals tile t to CTA t mod
      // grid: in input order, a CTA could draw several long tiles of heavy groups while others idle.
      int64_t rank = 0;
      for (int64_t h = 0; h < G; ++h) {
        const int64_t other = off[h + 1] - off[h];
        rank += other > rows || (other == rows && h < g);
      }
      const int64_t slot = b * G + rank, i = b * G + g;
      const int r = static_cast<int>(rows), k = static_cast<int>(K), nn = static_cast<int>(N);
      d.shapes[slot] = typename Cfg::Shape3(r > 0 ? k : 0, nn, max(r, 1));
      d.ptr_a[slot] = lhs + (b * M + start) * K;
      d.ptr_b[slot] = d_out + (b * M + start) * N;
      d.ptr_d[slot] = dw + i * K * N;
      d.stride_a[slot] = cutlass::make_cute_packed_stride(typename Cfg::StrideA{}, make_shape(k, max(r, 1), 1));
      d.stride_b[slot] = cutlass::make_cute_packed_stride(typename Cfg::StrideB{}, make_shape(nn, max(r, 1), 1));
      d.stride_d[slot] = cutlass::make_cute_packed_stride(typename Cfg::StrideD{}, make_shape(k, nn, 1));
    }
  } else {  // each chunk's empty groups listed, then zeroed by all the zero blocks together
    __shared__ int32_t empty[kPrologueThreads];
    __shared__ int n_empty;
    const int64_t group_bytes = K * N * static_cast<int64_t>(sizeof(Element));  // N % 8 == 0: a multiple of 16
    if (threadIdx.x == 0) n_empty = 0;
    __syncthreads();
    scan_group_rows(sizes + b * G, G, M, [&](int64_t g, int64_t, int64_t rows) {
      if (g < G && rows == 0) empty[atomicAdd(&n_empty, 1)] = static_cast<int32_t>(g);
      __syncthreads();
      for (int e = 0; e < n_empty; ++e)
        zero_span(reinterpret_cast<char*>(dw) + (b * G + empty[e]) * group_bytes, 0, group_bytes, blockIdx.x - 1,
                  gridDim.x - 1);
      __syncthreads();  // n_empty and empty[] are reused by the next chunk
      if (threadIdx.x == 0) n_empty = 0;
      __syncthreads();
    });
  }
}

template <typename Cfg, typename Element>
typename Cfg::Gemm::Arguments make_arguments(const DeviceArgs<Cfg, Element>& d, int64_t n, int device) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count(device);
  typename Cfg::Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.f;
  fusion.beta = 0.f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {_0{}, _0{}, 0};
  fusion.dBeta = {_0{}, _0{}, 0};
  args = typename Cfg::Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {static_cast<int>(n), d.shapes, nullptr},  // no host copy of the shapes: they live on the device
      {d.ptr_a, d.stride_a, d.ptr_b, d.stride_b},
      {fusion, nullptr, nullptr, d.ptr_d, d.stride_d},
      hw};
  return args;
}

// Scratch for the device arrays of n problems plus CUTLASS's own workspace.
template <typename Cfg, typename Element>
size_t scratch_bytes(int64_t n, int device) {
  ScratchArena sizing;  // base == nullptr: only counts
  DeviceArgs<Cfg, Element> d = DeviceArgs<Cfg, Element>::carve(sizing, n);
  auto args = make_arguments<Cfg, Element>(d, n, device);
  return sizing.used + 256 + Cfg::Gemm::get_workspace_size(args) + 256;
}

template <typename Cfg, typename Element>
ffi::Error run_gemm(const DeviceArgs<Cfg, Element>& d, int64_t n, ScratchArena& arena, int device,
                    cudaStream_t stream, const char* what) {
  auto args = make_arguments<Cfg, Element>(d, n, device);
  typename Cfg::Gemm gemm;
  const size_t workspace_bytes = Cfg::Gemm::get_workspace_size(args);
  void* workspace = arena.take<char>(workspace_bytes);
  if (arena.used > arena.size) return ffi::Error::Internal(std::string(what) + ": scratch too small");
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess)
    return invalid(std::string(what) + ": CUTLASS cannot run this problem: " +
                   cutlassGetStatusString(status));
  status = gemm.initialize(args, workspace, stream);
  if (status != cutlass::Status::kSuccess)
    return ffi::Error::Internal(std::string(what) + ": CUTLASS initialize failed: " +
                                cutlassGetStatusString(status));
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess)
    return ffi::Error::Internal(std::string(what) + ": CUTLASS run failed: " +
                                cutlassGetStatusString(status));
  return last_cuda_error(what);
}

template <typename Element, bool kTransposeRhs, typename Schedule>
ffi::Error forward(const GroupedGemmArgs& a, void* scratch, size_t scratch_size, int device,
                   cudaStream_t stream) {
  // rhs[g] is (K, N) row-major = N-contiguous B; transposed (N, K) row-major = K-contiguous B.
  using LayoutB = std::conditional_t<kTransposeRhs, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using Cfg = Config<Element, cutlass::layout::RowMajor, LayoutB, Schedule>;
  const int64_t n = a.batch * a.G;
  if (a.batch > 65535) return invalid("grouped_gemm (sm90): at most 65535 leading batch problems");
  ScratchArena arena{static_cast<char*>(scratch), 0, scratch_size};
  auto d = DeviceArgs<Cfg, Element>::carve(arena, n);
  // Zero blocks sized for the whole output (a tail can be most of it: worst-case EP buffers); with no tail
  // (the one-device dropless path) each only sums the sizes; none where the caller leaves the tail unwritten.
  const int64_t zero_blocks =
      a.zero_tail ? std::min<int64_t>(ceil_div(a.M * a.N * static_cast<int64_t>(sizeof(Element)), 16 * 256 * 4),
                                      2 * sm_count(device))
                  : 0;
  forward_prologue<Cfg, Element, kTransposeRhs>
      <<<dim3(static_cast<unsigned>(1 + zero_blocks), static_cast<unsigned>(a.batch)), kPrologueThreads, 0, stream>>>(
          a.sizes, a.offsets, static_cast<const Element*>(a.lhs), static_cast<const Element*>(a.rhs),
          static_cast<Element*>(a.out), a.M, a.K, a.N, a.G, d);
  return run_gemm<Cfg, Element>(d, n, arena, device, stream, "grouped_gemm (sm90)");
}

template <typename Element, typename Schedule>
ffi::Error weight_grad(const GroupedGemmArgs& a, void* scratch, size_t scratch_size, int device,
                       cudaStream_t stream) {
  // A = lhs^T is (K x rows) with K contiguous: column-major; B = d_out rows, N contiguous.
  using Cfg = Config<Element, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, Schedule>;
  const int64_t n = a.batch * a.G;
  if (a.batch > 65535) return invalid("grouped_gemm_weight_grad (sm90): at most 65535 leading batch problems");
  ScratchArena arena{static_cast<char*>(scratch), 0, scratch_size};
  auto d = DeviceArgs<Cfg, Element>::carve(arena, n);
  // Zero blocks for one group's weights (empty groups are zeroed one after another; none is the common case).
  const int64_t group_bytes = a.K * a.N * static_cast<int64_t>(sizeof(Element));
  const int64_t zero_blocks = std::min<int64_t>(ceil_div(group_bytes, 16 * 256 * 4), 2 * sm_count(device));
  weight_grad_prologue<Cfg, Element>
      <<<dim3(static_cast<unsigned>(1 + zero_blocks), static_cast<unsigned>(a.batch)), kPrologueThreads, 0, stream>>>(
          a.sizes, a.offsets, static_cast<const Element*>(a.lhs), static_cast<const Element*>(a.rhs),
          static_cast<Element*>(a.out), a.M, a.K, a.N, a.G, d);
  return run_gemm<Cfg, Element>(d, n, arena, device, stream, "grouped_gemm_weight_grad (sm90)");
}

}  // namespace turbo_moe::sm90

// Declares/defines the extern entry points of one element type (one .cu file per type, so the
// heavy template instantiations compile in parallel). Each op picks the cluster-free instance when
// its output has an odd number of N tiles.
#define TURBO_MOE_SM90_INSTANCE(SUFFIX, ELEMENT)                                                   \
  namespace turbo_moe::sm90 {                                                                      \
  ffi::Error forward_##SUFFIX(const GroupedGemmArgs& a, void* s, size_t sb, int dev, cudaStream_t st) { \
    if (odd_n_tiles(a.N))                                                                          \
      return a.transpose_rhs ? forward<ELEMENT, true, CooperativeNoCluster>(a, s, sb, dev, st)     \
                             : forward<ELEMENT, false, CooperativeNoCluster>(a, s, sb, dev, st);   \
    return a.transpose_rhs ? forward<ELEMENT, true, Cooperative>(a, s, sb, dev, st)                \
                           : forward<ELEMENT, false, Cooperative>(a, s, sb, dev, st);              \
  }                                                                                                \
  ffi::Error weight_grad_##SUFFIX(const GroupedGemmArgs& a, void* s, size_t sb, int dev, cudaStream_t st) { \
    return odd_n_tiles(a.N) ? weight_grad<ELEMENT, CooperativeNoCluster>(a, s, sb, dev, st)        \
                            : weight_grad<ELEMENT, Cooperative>(a, s, sb, dev, st);                \
  }                                                                                                \
  template <typename Schedule>                                                                     \
  size_t scratch_bytes_of_##SUFFIX(int64_t n, int dev) {                                           \
    using Fwd = Config<ELEMENT, cutlass::layout::RowMajor, cutlass::layout::RowMajor, Schedule>;   \
    using FwdT = Config<ELEMENT, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, Schedule>; \
    using Wgrad = Config<ELEMENT, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, Schedule>; \
    return std::max({scratch_bytes<Fwd, ELEMENT>(n, dev), scratch_bytes<FwdT, ELEMENT>(n, dev),    \
                     scratch_bytes<Wgrad, ELEMENT>(n, dev)});                                      \
  }                                                                                                \
  size_t scratch_bytes_##SUFFIX(int64_t n, int dev) {                                              \
    return std::max(scratch_bytes_of_##SUFFIX<Cooperative>(n, dev),                                \
                    scratch_bytes_of_##SUFFIX<CooperativeNoCluster>(n, dev));                      \
  }                                                                                                \
  }
