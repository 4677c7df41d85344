// The FP8 grouped GEMM's consumer mainloop with the promotion overlapped (used by grouped_gemm_fp8.cu).
//
// CUTLASS's blockwise-scaled Hopper mainloop waits for each 128-deep K block's wgmma to finish
// (`warpgroup_wait<0>`) before it scales that block's float32 partial sums into the accumulator, and only then
// issues the next block's wgmma: the tensor cores idle for the wait and the promotion's FMAs every K block. Here
// each consumer warpgroup alternates two partial-sum fragments: it issues block k's wgmma into one, waits only for
// block k-1's (`warpgroup_wait<1>`), promotes that one with block k-1's scales (read from its shared-memory stage,
// which it still holds) and releases the stage. DeepSeek-V3's recipe is unchanged: one promotion every 128 of K.
// Everything else (TMA loads, the scale copies, the pipeline, tensor maps) is CUTLASS's collective, inherited.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"

namespace turbo_moe::fp8 {

template <class Base>
struct OverlappedPromotionMma : Base {
  using typename Base::DispatchPolicy;
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
  static constexpr int ScaleMsPerTile = Base::ScaleMsPerTile;
  static constexpr int ScaleNsPerTile = Base::ScaleNsPerTile;
  // One promotion per mainloop step, i.e. the tile's K (128) is the scale block's K.
  static_assert(Base::ScalePromotionInterval * cute::size<2>(typename TiledMma::AtomShape_MNK{}) ==
                    cute::size<2>(TileShape{}),
                "the overlapped mainloop promotes once per K tile: the tile's K must equal the scale block's");

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum, int k_tile_count,
                          int thread_idx, TensorStorage& shared_tensors, Params const&) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "the accumulator must be in registers");
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BLK_N, BLK_K, PIPE)
    // The scales seen as (BLK_M, BLK_N, (BLK_K, PIPE)) tensors broadcast over the other mode (stride 0), so that
    // partitioning them like C gives each thread the scales of its accumulator elements.
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
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));
    Tensor sfa = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));  // (MMA, MMA_M, MMA_N), stride-0 modes
    Tensor sfb = make_tensor_like<ElementBlockScale>(tCsSFB(_, _, _, _0{}));

    // Two partial-sum fragments: block k's wgmma writes one while block k-1's is promoted from the other.
    Tensor partial0 = make_fragment_like(accum);
    Tensor partial1 = make_fragment_like(accum);
    clear(accum);

    auto issue = [&](auto& partial, int stage) {
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;  // each K block starts its own partial sums
      warpgroup_fence_operand(partial);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
        cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), partial);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(partial);
    };
    // accum += partial * (its block's scales), the scales read from the block's stage, which is still held.
    auto promote = [&](auto& partial, int stage) {
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), sfa);
      copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), sfb);
      warpgroup_fence_operand(partial);
      if constexpr (ScaleMsPerTile == 1 && ScaleNsPerTile == 1) {
        const ElementBlockScale s = sfa(_0{}) * sfb(_0{});
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += partial(i) * s;
      } else if constexpr (ScaleMsPerTile > 1 && ScaleNsPerTile == 1) {
        const ElementBlockScale b = sfb(_0{});
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(filter_zeros(sfa)); ++i) filter_zeros(sfa)(i) = filter_zeros(sfa)(i) * b;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += partial(i) * sfa(i);
      } else if constexpr (ScaleMsPerTile == 1 && ScaleNsPerTile > 1) {
        const ElementBlockScale a = sfa(_0{});
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(filter_zeros(sfb)); ++i) filter_zeros(sfb)(i) = filter_zeros(sfb)(i) * a;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += partial(i) * sfb(i);
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += partial(i) * (sfa(i) * sfb(i));
      }
      warpgroup_fence_operand(partial);
    };

    if (k_tile_count <= 0) return;
    PipelineState smem_pipe_release = smem_pipe_read;
    auto token = pipeline.consumer_try_wait(smem_pipe_read);
    pipeline.consumer_wait(smem_pipe_read, token);
    issue(partial0, smem_pipe_read.index());
    ++smem_pipe_read;

    // One step: issue block k into `next`, wait for block k-1 (in `done`), promote it, release its stage. The
    // fragments alternate, so the loop is unrolled by two to keep both in registers.
    auto step = [&](auto& next, auto& done) {
      auto wait_token = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, wait_token);
      issue(next, smem_pipe_read.index());
      ++smem_pipe_read;
      warpgroup_wait<1>();
      promote(done, smem_pipe_release.index());
      pipeline.consumer_release(smem_pipe_release);  // the last block's stage is released by mma_tail
      ++smem_pipe_release;
    };
    // The exits sit inside the loop, so that no partial-sum fragment is live across a branch that merges paths
    // while its wgmma is in flight (ptxas would wait there for it, C7517).
    int k = 1;
    CUTLASS_PRAGMA_NO_UNROLL
    while (true) {
      if (k >= k_tile_count) {
        warpgroup_wait<0>();
        promote(partial0, smem_pipe_release.index());
        break;
      }
      step(partial1, partial0);
      if (++k >= k_tile_count) {
        warpgroup_wait<0>();
        promote(partial1, smem_pipe_release.index());
        break;
      }
      step(partial0, partial1);
      ++k;
    }
  }
};

}  // namespace turbo_moe::fp8
