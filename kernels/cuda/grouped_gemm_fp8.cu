// CUDA FFI handlers of the FP8 grouped GEMM with DeepSeek-V3's fine-grained scaling (contract:
// kernels/contracts/grouped_gemm_fp8.h; the Python side, quantisers and the emulated CPU path:
// turbo_moe/ops/grouped_gemm_fp8.py):
//   turbo_moe_grouped_gemm_fp8:             out[r] = (lhs[r] * s_lhs[r]) @ (rhs[g(r)] * s_rhs[g(r)])^T   -> [M, N] bf16
//   turbo_moe_grouped_gemm_fp8_weight_grad: d_rhs[g] = lhs_t[:, rows_g] @ d_out_t[:, rows_g]^T, each side scaled
//                                           per (column, 128 rows) tile                               -> [G, K, N] bf16
// Hopper only (sm_90a): CUTLASS's ptr-array grouped kernel with blockwise scaling (TMA loads, fp8 wgmma, two
// consumer warpgroups); the mainloop scales each 128-deep K block's float32 partial sums and adds them into a float32
// accumulator, DeepSeek-V3's promotion interval (forward and data gradient: our consumer mainloop for a 128x256 tile,
// fp8_wide_tile_mainloop.cuh). As in grouped_gemm_sm90, a one-block prologue kernel turns the
// device-resident group sizes into per-group problem shapes, pointers, strides and scale pointers: no host sync, and
// the handlers are command-buffer compatible. FP8 wgmma reads both operands K-major, hence the layouts in the contract.
#include "group_walk.cuh"
#include "common.cuh"
#include "fp8_wide_tile_mainloop.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "../contracts/grouped_gemm_fp8.h"
#include "../contracts/registration.h"

namespace turbo_moe::fp8 {

using namespace cute;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
using Fp8 = cutlass::float_e4m3_t;
using Out = cutlass::bfloat16_t;

// One 128-deep K block per mainloop step: one promotion per step. Forward and data gradient use 128x256 tiles (our
// mainloop, fp8_wide_tile_mainloop.cuh: 25% fewer L2 bytes a FLOP, +9-20% against 128x128 on an H200), the weight
// gradient 128x128 (CUTLASS's mainloop: the wide tile measured 0-12% slower there; docs/notes/fp8-kernel.md).
template <int TileN>
using TileShapeN = Shape<_128, Int<TileN>, _128>;
using ClusterShape = Shape<_1, _1, _1>;  // any N (no cluster rounding of the N tiles)

// The epilogue (bf16 D = the float32 accumulator, no C) of a tile shape.
template <int TileN>
using EpilogueFor = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShapeN<TileN>, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, cutlass::layout::RowMajor*, 8,  // no C
    Out, cutlass::layout::RowMajor*, 8,   // D: 16 bytes of bf16
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<Out, float>>::CollectiveOp;
// Its shared memory, carved out of the mainloop's stages: constants here, since `sizeof(Epilogue::SharedStorage)`
// written inside the Config template reaches GCC's host pass as a type it cannot parse.
constexpr int kEpilogueSmem128 = static_cast<int>(sizeof(EpilogueFor<128>::SharedStorage));
constexpr int kEpilogueSmem256 = static_cast<int>(sizeof(EpilogueFor<256>::SharedStorage));
// The 64x128 FP8 wgmma, two warpgroups along M: what a 128x256 tile runs as two halves.
using HalfTiledMma = decltype(make_tiled_mma(
    cute::GMMA::ss_op_selector<Fp8, Fp8, float, Shape<_128, _128, _128>, cute::GMMA::Major::K, cute::GMMA::Major::K>(),
    Layout<Shape<_2, _1, _1>>{}));

// One kernel configuration. GranM / GranN: rows of A / B sharing one scale (K blocks are always 128 deep);
// kSfaKMajor: A's scales stored [rows, K/128] (the forward) rather than [K/128, rows] (the weight gradient).
template <int GranM, int GranN, bool kSfaKMajor, int TileN>
struct Config {
  using TileShape = TileShapeN<TileN>;
  using ClusterShape = fp8::ClusterShape;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<
      GranM, GranN, 128, kSfaKMajor ? cute::GMMA::Major::K : cute::GMMA::Major::MN, cute::GMMA::Major::MN>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  static constexpr int kAlignIn = 16;  // 16 bytes of fp8

  using Epilogue = EpilogueFor<TileN>;

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Fp8, cute::tuple<cutlass::layout::RowMajor*, LayoutSFA*>, kAlignIn,     // A: [rows, K], K contiguous
      Fp8, cute::tuple<cutlass::layout::ColumnMajor*, LayoutSFB*>, kAlignIn,  // B: [N, K], K contiguous
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<TileN == 256 ? kEpilogueSmem256 : kEpilogueSmem128>,
      KernelSchedule>::CollectiveOp;
  using Mainloop = std::conditional_t<TileN == 256,
                                      WideTileMma<typename WithTiledMma<BuiltMainloop, HalfTiledMma>::type>,
                                      BuiltMainloop>;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
};

// forward and data gradient: 1x128 activations, 128x128 weights
using RowsConfig = Config<1, 128, true, 256>;
// weight gradient: 128x1 tiles of activations and output gradients
using WeightGradConfig = Config<1, 1, false, 128>;

// The per-problem device arrays the grouped kernel reads, carved from the call's workspace.
template <typename Cfg>
struct DeviceArgs {
  typename Cfg::Shape3* shapes;
  const Fp8** ptr_a;
  const Fp8** ptr_b;
  const float** ptr_sfa;
  const float** ptr_sfb;
  Out** ptr_d;
  typename Cfg::StrideA* stride_a;
  typename Cfg::StrideB* stride_b;
  typename Cfg::StrideD* stride_d;
  typename Cfg::LayoutSFA* layout_sfa;
  typename Cfg::LayoutSFB* layout_sfb;

  static DeviceArgs carve(ScratchArena& arena, int64_t n) {
    DeviceArgs d;
    d.shapes = arena.take<typename Cfg::Shape3>(n);
    d.ptr_a = arena.take<const Fp8*>(n);
    d.ptr_b = arena.take<const Fp8*>(n);
    d.ptr_sfa = arena.take<const float*>(n);
    d.ptr_sfb = arena.take<const float*>(n);
    d.ptr_d = arena.take<Out*>(n);
    d.stride_a = arena.take<typename Cfg::StrideA>(n);
    d.stride_b = arena.take<typename Cfg::StrideB>(n);
    d.stride_d = arena.take<typename Cfg::StrideD>(n);
    d.layout_sfa = arena.take<typename Cfg::LayoutSFA>(n);
    d.layout_sfb = arena.take<typename Cfg::LayoutSFB>(n);
    return d;
  }
};

constexpr int kPrologueThreads = 256;

// Rows prologue, grid 1 + Z blocks. Block 0: problem g = rows [start, start + rows_g) of lhs times rhs[g] ([N, K]);
// an empty group gets M = 0 (no tiles). Blocks 1..Z zero out's rows past the groups (the GEMM does not write them).
__global__ void __launch_bounds__(kPrologueThreads)
    rows_prologue(const int32_t* sizes, const Fp8* lhs, const float* lhs_scale, const Fp8* rhs, const float* rhs_scale,
                  Out* out, int64_t M, int64_t K, int64_t N, int64_t G, DeviceArgs<RowsConfig> d) {
  using Cfg = RowsConfig;
  const int64_t kb = K / kFp8Block, nb = N / kFp8Block;
  if (blockIdx.x == 0) {
    scan_group_rows(sizes, G, M, [&](int64_t g, int64_t start, int64_t rows) {
      if (g >= G) return;
      const int m = static_cast<int>(rows), k = static_cast<int>(K), n = static_cast<int>(N);
      d.shapes[g] = Cfg::Shape3(m, n, k);
      d.ptr_a[g] = lhs + start * K;
      d.ptr_b[g] = rhs + g * N * K;
      d.ptr_sfa[g] = lhs_scale + start * kb;  // [rows, K/128] stays valid for a row slice
      d.ptr_sfb[g] = rhs_scale + g * kb * nb;
      d.ptr_d[g] = out + start * N;
      d.stride_a[g] = cutlass::make_cute_packed_stride(Cfg::StrideA{}, make_shape(max(m, 1), k, 1));
      d.stride_b[g] = cutlass::make_cute_packed_stride(Cfg::StrideB{}, make_shape(n, k, 1));
      d.stride_d[g] = cutlass::make_cute_packed_stride(Cfg::StrideD{}, make_shape(max(m, 1), n, 1));
      d.layout_sfa[g] = Cfg::ScaleConfig::tile_atom_to_shape_SFA(make_shape(max(m, 1), n, k, 1));
      d.layout_sfb[g] = Cfg::ScaleConfig::tile_atom_to_shape_SFB(make_shape(max(m, 1), n, k, 1));
    });
  } else {
    const int64_t total = scan_group_rows(sizes, G, M, [](int64_t, int64_t, int64_t) {});
    const int64_t row_bytes = N * static_cast<int64_t>(sizeof(Out));  // N % 128 == 0: a multiple of 16
    zero_span(reinterpret_cast<char*>(out), total * row_bytes, M * row_bytes, blockIdx.x - 1, gridDim.x - 1);
  }
}

// Weight-grad prologue, grid 1 + Z blocks. Block 0: problem g = (K x P_g) @ (P_g x N) over group g's padded columns
// [start, start + P_g) of lhs_t and d_out_t (row stride P); the padding columns are zero, so P_g (a multiple of 128)
// is the contraction and every 128-deep K block is one scale tile. Blocks 1..Z zero d_rhs[g] of every empty group.
__global__ void __launch_bounds__(kPrologueThreads)
    weight_grad_prologue(const int32_t* sizes, const Fp8* lhs_t, const float* lhs_t_scale, const Fp8* d_out_t,
                         const float* d_out_t_scale, Out* d_rhs, int64_t M, int64_t K, int64_t N, int64_t G, int64_t P,
                         DeviceArgs<WeightGradConfig> d) {
  using Cfg = WeightGradConfig;
  if (blockIdx.x == 0) {
    scan_group_rows<kFp8Block>(sizes, G, M, [&](int64_t g, int64_t start, int64_t rows) {
      if (g >= G) return;
      const int64_t padded = (rows + kFp8Block - 1) / kFp8Block * kFp8Block;
      const int kk = static_cast<int>(K), n = static_cast<int>(N);
      const int p = padded > 0 ? static_cast<int>(padded) : 128;  // an empty group: M = 0, no tiles
      d.shapes[g] = Cfg::Shape3(rows > 0 ? kk : 0, n, p);
      d.ptr_a[g] = lhs_t + start;
      d.ptr_b[g] = d_out_t + start;
      d.ptr_sfa[g] = lhs_t_scale + start / kFp8Block * K;  // [P/128, K]: tile rows of this group onwards
      d.ptr_sfb[g] = d_out_t_scale + start / kFp8Block * N;
      d.ptr_d[g] = d_rhs + g * K * N;
      // Row stride P (the whole padded layout), not the group's own width.
      d.stride_a[g] = cutlass::make_cute_packed_stride(Cfg::StrideA{}, make_shape(kk, static_cast<int>(P), 1));
      d.stride_b[g] = cutlass::make_cute_packed_stride(Cfg::StrideB{}, make_shape(n, static_cast<int>(P), 1));
      d.stride_d[g] = cutlass::make_cute_packed_stride(Cfg::StrideD{}, make_shape(kk, n, 1));
      d.layout_sfa[g] = Cfg::ScaleConfig::tile_atom_to_shape_SFA(make_shape(kk, n, p, 1));
      d.layout_sfb[g] = Cfg::ScaleConfig::tile_atom_to_shape_SFB(make_shape(kk, n, p, 1));
    });
  } else {
    const int64_t group_bytes = K * N * static_cast<int64_t>(sizeof(Out));  // N % 16 == 0: a multiple of 16
    __shared__ int32_t empty[kPrologueThreads];
    __shared__ int n_empty;
    if (threadIdx.x == 0) n_empty = 0;
    __syncthreads();
    scan_group_rows(sizes, G, M, [&](int64_t g, int64_t, int64_t rows) {
      if (g < G && rows == 0) empty[atomicAdd(&n_empty, 1)] = static_cast<int32_t>(g);
      __syncthreads();
      for (int e = 0; e < n_empty; ++e)
        zero_span(reinterpret_cast<char*>(d_rhs) + empty[e] * group_bytes, 0, group_bytes, blockIdx.x - 1,
                  gridDim.x - 1);
      __syncthreads();  // empty[] and n_empty are reused by the next chunk
      if (threadIdx.x == 0) n_empty = 0;
      __syncthreads();
    });
  }
}

template <typename Cfg>
typename Cfg::Gemm::Arguments make_arguments(const DeviceArgs<Cfg>& d, int64_t n, int device) {
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
      {static_cast<int>(n), d.shapes, nullptr},  // shapes on the device only
      {d.ptr_a, d.stride_a, d.ptr_b, d.stride_b, d.ptr_sfa, d.layout_sfa, d.ptr_sfb, d.layout_sfb},
      {fusion, nullptr, nullptr, d.ptr_d, d.stride_d},
      hw};
  return args;
}

template <typename Cfg>
size_t scratch_bytes(int64_t n, int device) {
  ScratchArena sizing;  // base == nullptr: only counts
  DeviceArgs<Cfg> d = DeviceArgs<Cfg>::carve(sizing, n);
  return sizing.used + 256 + Cfg::Gemm::get_workspace_size(make_arguments<Cfg>(d, n, device)) + 256;
}

template <typename Cfg>
ffi::Error run_gemm(const DeviceArgs<Cfg>& d, int64_t n, ScratchArena& arena, int device, cudaStream_t stream,
                    const char* what) {
  auto args = make_arguments<Cfg>(d, n, device);
  typename Cfg::Gemm gemm;
  void* workspace = arena.take<char>(Cfg::Gemm::get_workspace_size(args));
  if (arena.used > arena.size) return ffi::Error::Internal(std::string(what) + ": workspace too small");
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess)
    return invalid(std::string(what) + ": CUTLASS cannot run this problem: " + cutlassGetStatusString(status));
  status = gemm.initialize(args, workspace, stream);
  if (status != cutlass::Status::kSuccess)
    return ffi::Error::Internal(std::string(what) + ": CUTLASS initialize failed: " + cutlassGetStatusString(status));
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess)
    return ffi::Error::Internal(std::string(what) + ": CUTLASS run failed: " + cutlassGetStatusString(status));
  return last_cuda_error(what);
}

// The workspace: the device arrays + CUTLASS's own, 256-byte aligned (+ 256 for aligning the base).
size_t workspace_bytes(int64_t groups, bool weight_grad, int device) {
  return (weight_grad ? scratch_bytes<WeightGradConfig>(groups, device) : scratch_bytes<RowsConfig>(groups, device)) +
         256;
}

ffi::Error open_workspace(ffi::AnyBuffer workspace, int64_t groups, bool weight_grad, int device, const char* what,
                          ScratchArena* arena) {
  const size_t need = workspace_bytes(groups, weight_grad, device);
  if (workspace.size_bytes() < need)
    return invalid(std::string(what) + ": workspace of " + std::to_string(workspace.size_bytes()) +
                   " bytes, this call needs " + std::to_string(need) +
                   " (turbo_moe/ops/grouped_gemm_fp8.py sizes it with turbo_moe_grouped_gemm_fp8_workspace_bytes)");
  const uintptr_t raw = reinterpret_cast<uintptr_t>(workspace.untyped_data());
  *arena = ScratchArena{reinterpret_cast<char*>((raw + 255) & ~uintptr_t(255)), 0, need - 256};
  return ffi::Error::Success();
}

ffi::Error check_hopper(int device, const char* what) {
  if (compute_capability_major(device) != 9)
    return invalid(std::string(what) + ": the FP8 kernel needs a Hopper GPU (compute capability 9.x); elsewhere use "
                   "grouped_gemm_fp8(..., impl=\"emulated\")");
  return ffi::Error::Success();
}

int64_t zero_blocks(int64_t bytes, int device) {
  return std::min<int64_t>(ceil_div(bytes, 16 * kPrologueThreads * 4), 2 * sm_count(device));
}

ffi::Error RowsImpl(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer lhs_scale, ffi::AnyBuffer rhs,
                    ffi::AnyBuffer rhs_scale, ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                    ffi::Result<ffi::AnyBuffer> workspace) {
  const char* what = "grouped_gemm_fp8";
  auto dims = check_grouped_gemm_fp8(lhs, lhs_scale, rhs, rhs_scale, group_sizes, *out);
  if (!dims) return dims.error();
  const int64_t M = dims->M, K = dims->K, N = dims->N, G = dims->G;
  if (M == 0 || N == 0) return ffi::Error::Success();
  int device = 0;
  cudaGetDevice(&device);
  if (auto err = check_hopper(device, what); err.failure()) return err;
  ScratchArena arena;
  if (auto err = open_workspace(*workspace, G, false, device, what, &arena); err.failure()) return err;
  auto d = DeviceArgs<RowsConfig>::carve(arena, G);
  const int64_t z = zero_blocks(M * N * static_cast<int64_t>(sizeof(Out)), device);
  rows_prologue<<<static_cast<unsigned>(1 + z), kPrologueThreads, 0, stream>>>(
      group_sizes.typed_data(), static_cast<const Fp8*>(lhs.untyped_data()),
      static_cast<const float*>(lhs_scale.untyped_data()), static_cast<const Fp8*>(rhs.untyped_data()),
      static_cast<const float*>(rhs_scale.untyped_data()), static_cast<Out*>(out->untyped_data()), M, K, N, G, d);
  if (G == 0) return last_cuda_error(what);
  return run_gemm<RowsConfig>(d, G, arena, device, stream, what);
}

ffi::Error WeightGradImpl(cudaStream_t stream, ffi::AnyBuffer lhs_t, ffi::AnyBuffer lhs_t_scale, ffi::AnyBuffer d_out_t,
                          ffi::AnyBuffer d_out_t_scale, ffi::Buffer<ffi::S32> group_sizes,
                          ffi::Result<ffi::AnyBuffer> d_rhs, ffi::Result<ffi::AnyBuffer> workspace, int64_t rows) {
  const char* what = "grouped_gemm_fp8_weight_grad";
  auto dims = check_grouped_gemm_fp8_weight_grad(lhs_t, lhs_t_scale, d_out_t, d_out_t_scale, group_sizes, *d_rhs, rows);
  if (!dims) return dims.error();
  const int64_t M = dims->M, K = dims->K, N = dims->N, G = dims->G, P = dims->P;
  if (G == 0 || K == 0 || N == 0) return ffi::Error::Success();
  int device = 0;
  cudaGetDevice(&device);
  if (auto err = check_hopper(device, what); err.failure()) return err;
  ScratchArena arena;
  if (auto err = open_workspace(*workspace, G, true, device, what, &arena); err.failure()) return err;
  auto d = DeviceArgs<WeightGradConfig>::carve(arena, G);
  const int64_t z = zero_blocks(K * N * static_cast<int64_t>(sizeof(Out)), device);
  weight_grad_prologue<<<static_cast<unsigned>(1 + z), kPrologueThreads, 0, stream>>>(
      group_sizes.typed_data(), static_cast<const Fp8*>(lhs_t.untyped_data()),
      static_cast<const float*>(lhs_t_scale.untyped_data()), static_cast<const Fp8*>(d_out_t.untyped_data()),
      static_cast<const float*>(d_out_t_scale.untyped_data()), static_cast<Out*>(d_rhs->untyped_data()), M, K, N, G, P,
      d);
  return run_gemm<WeightGradConfig>(d, G, arena, device, stream, what);
}

}  // namespace turbo_moe::fp8

// No scratch, no host synchronisation, every launch on `stream`: command-buffer compatible.
TURBO_MOE_CUDA_HANDLER(turbo_moe_grouped_gemm_fp8, turbo_moe::fp8::RowsImpl, turbo_moe::grouped_gemm_fp8_signature);

TURBO_MOE_CUDA_HANDLER(turbo_moe_grouped_gemm_fp8_weight_grad, turbo_moe::fp8::WeightGradImpl,
                       turbo_moe::grouped_gemm_fp8_weight_grad_signature);

// Workspace bytes of one call with `groups` groups on the current device (weight_grad: 1 for the weight-gradient
// handler): what turbo_moe/ops/grouped_gemm_fp8.py gives each call.
extern "C" int64_t turbo_moe_grouped_gemm_fp8_workspace_bytes(int64_t groups, int64_t weight_grad) {
  int device = 0;
  cudaGetDevice(&device);
  return static_cast<int64_t>(turbo_moe::fp8::workspace_bytes(groups, weight_grad != 0, device));
}
