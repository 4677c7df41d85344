// The FP8 grouped GEMM's consumer mainloop for a tile twice as wide as one wgmma (used by grouped_gemm_fp8.cu).
//
// A 128x256 tile reads 48 KB from L2 per 128-deep K block for 8.4 MFLOP where a 128x128 tile reads 32 KB for 4.2:
// 25% fewer bytes a FLOP, what the bf16 kernel's 128x256 tile gets. With DeepSeek-V3's promotion every 128 of K, a
// consumer warpgroup would need 128 float32 accumulators plus 128 partial sums for a 64x256 wgmma, over the
// 232-register budget of CUTLASS's cooperative kernel; here each K block runs as two 64x128 wgmma halves sharing one
// 64-register partial-sum fragment: issue half n, wait, promote it into accum(_, _, n) with its scales, next half.
// Everything else (TMA loads, scale copies, the pipeline, tensor maps, the epilogue) is CUTLASS's collective.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"

namespace turbo_moe::fp8 {

// CUTLASS's collective with its TiledMma replaced (the builder picks the widest wgmma that fits the tile).
template <class Op, class NewTiledMma>
struct WithTiledMma;
template <class DP, class TS, class EA, class SA, class EB, class SB, class TM, class GA, class LA, class CA, class TA,
          class GB, class LB, class CB, class TB, class NewTiledMma>
struct WithTiledMma<cutlass::gemm::collective::CollectiveMma<DP, TS, EA, SA, EB, SB, TM, GA, LA, CA, TA, GB, LB, CB, TB>,
                    NewTiledMma> {
  using type = cutlass::gemm::collective::CollectiveMma<DP, TS, EA, SA, EB, SB, NewTiledMma, GA, LA, CA, TA, GB, LB, CB,
                                                        TB>;
};

template <class Base>
struct WideTileMma : Base {
  using typename Base::ElementBlockScale;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::Params;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::SmemLayoutSFA;
  using typename Base::SmemLayoutSFB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  using typename Base::TiledMma;
  static_assert(Base::ScalePromotionInterval * cute::size<2>(typename TiledMma::AtomShape_MNK{}) ==
                    cute::size<2>(TileShape{}),
                "one promotion per K tile: the tile's K must equal the scale block's");

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum, int k_tile_count,
                          int thread_idx, TensorStorage& shared_tensors, Params const&) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "the accumulator must be in registers");
    static_assert(size<1>(FrgTensorC{}) == 1, "one wgmma row block a warpgroup");
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BLK_N, BLK_K, PIPE)
    // Scales as (BLK_M, BLK_N, (BLK_K, PIPE)) tensors broadcast over the other mode (stride 0): partitioned like C,
    // each thread gets the scales of its accumulator elements.
    Tensor sSFA = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFA.data()),
        make_layout(make_shape(shape<0>(SmemLayoutSFA{}), get<1>(TileShape{}),
                               make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
                    make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                                make_stride(stride<1>(SmemLayoutSFA{}), stride<2>(SmemLayoutSFA{})))));
    Tensor sSFB = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFB.data()),
        make_layout(make_shape(get<0>(TileShape{}), shape<0>(SmemLayoutSFB{}),
                               make_shape(shape<1>(SmemLayoutSFB{}), shape<2>(SmemLayoutSFB{}))),
                    make_stride(_0{}, stride<0>(SmemLayoutSFB{}),
                                make_stride(stride<1>(SmemLayoutSFB{}), stride<2>(SmemLayoutSFB{})))));

    constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    Layout warp_group_layout = make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    const int warp_group = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(warp_group_layout(warp_group));
    Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);  // (MMA, MMA_M, MMA_N, (MMA_K, PIPE))
    Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE) descriptors
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)
    Tensor sfa = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));  // (MMA, MMA_M, MMA_N), stride-0 modes
    Tensor sfb = make_tensor_like<ElementBlockScale>(tCsSFB(_, _, _, _0{}));
    Tensor partial = make_fragment_like(accum(_, 0, 0));  // one wgmma's (V) partial sums
    clear(accum);

    PipelineState smem_pipe_release = smem_pipe_read;
    CUTLASS_PRAGMA_NO_UNROLL
    for (int k = 0; k < k_tile_count; ++k) {
      auto token = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, token);
      const int stage = smem_pipe_read.index();
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), sfa);
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < size<2>(accum); ++n) {
        copy(tCsSFB(_, _, n, make_coord(_0{}, stage)), sfb(_, _, n));  // one half's at a time: fewer live registers
        tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
        warpgroup_fence_operand(partial);
        warpgroup_arrive();
        CUTLASS_PRAGMA_UNROLL
        for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
          cute::gemm(tiled_mma, tCrA(_, 0, k_block, stage), tCrB(_, n, k_block, stage), partial);
          tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
        warpgroup_wait<0>();
        warpgroup_fence_operand(partial);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(partial); ++i) accum(i, 0, n) += partial(i) * (sfa(i, 0, n) * sfb(i, 0, n));
      }
      ++smem_pipe_read;
      if (k + 1 < k_tile_count) {  // the last block's stage is released by mma_tail
        pipeline.consumer_release(smem_pipe_release);
        ++smem_pipe_release;
      }
    }
  }
};

}  // namespace turbo_moe::fp8
