// The FP8 blockwise mainloop with each 128-deep block's promotion overlapped
// with the next block's WGMMAs.
//
// CUTLASS 4.2's sm90 blockwise collective issues a k-block's WGMMAs into a
// partial accumulator, waits for all of them (warpgroup_wait<0>), then scales
// the partial product by the block's SFA x SFB and adds it to the main
// accumulator in the same warps: the tensor cores idle while those warps
// wait out the WGMMA pipeline and run the promotion. This mainloop keeps two
// partial accumulators and issues block k+1's WGMMAs into one before
// promoting block k from the other (warpgroup_wait<1>), so the promotion
// runs while the tensor cores work; with one weight scale per tile (fprop,
// dgrad) even the promotion's scale loads are issued before its wait. The
// arithmetic is CUTLASS's, term for term and in the same order (for each
// block: accum += partial * scale), so the results are bitwise those of the
// CUTLASS mainloop; the main accumulator starts at zero explicitly (CUTLASS's
// adds to the fragment as the kernel allocates it).
//
// Everything but mma() is CUTLASS's collective (loads, pipelines, tensor
// maps): the kernel layer calls mma() on this type. Used when
// Fp8GemmConfig::kOverlap is set (fp8_gemm.cuh); otherwise CUTLASS's own
// mainloop runs, behind ClearedAccumulatorMainloop (below).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"

namespace groupgrad {

template <class Cutlass>
struct OverlappedPromotionMainloop : Cutlass {
  using TiledMma = typename Cutlass::TiledMma;
  using TileShape = typename Cutlass::TileShape;
  using Scale = typename Cutlass::ElementBlockScale;

  static_assert(Cutlass::ScaleGranularityK == cute::size<2>(TileShape{}),
                "one promotion per k tile: the scales' K block must be the tile's depth");
  static_assert(Cutlass::ScaleMsPerTile > 1,
                "groupgrad's FP8 operands scale every row of A (granularity 1 along M)");

  // Issues one k tile's WGMMAs into `partial` (zeroed by its first WGMMA) as one batch.
  template <class Partial, class FragA, class FragB>
  CUTLASS_DEVICE static void issue(TiledMma& tiled_mma, Partial& partial, FragA const& tCrA,
                                   FragB const& tCrB, int stage) {
    using namespace cute;
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(partial);
    warpgroup_arrive();
    CUTLASS_PRAGMA_UNROLL
    for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
      cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), partial);
      tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_fence_operand(partial);
  }

  // The scales of the k tile in `stage`, from shared memory into registers: SFA per row and
  // SFB; with one SFB per tile it is folded into SFA first, as CUTLASS does.
  template <class SmemSFA, class SmemSFB>
  CUTLASS_DEVICE static auto scales(SmemSFA const& tCsSFA, SmemSFB const& tCsSFB, int stage) {
    using namespace cute;
    Tensor sfa = make_tensor_like<Scale>(tCsSFA(_, _, _, _0{}));
    Tensor sfb = make_tensor_like<Scale>(tCsSFB(_, _, _, _0{}));
    copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), sfa);
    copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), sfb);
    if constexpr (Cutlass::ScaleNsPerTile == 1) {
      Scale scale_b = sfb(_0{});
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(filter_zeros(sfa)); ++i) {
        filter_zeros(sfa)(i) = filter_zeros(sfa)(i) * scale_b;
      }
    }
    return make_tuple(sfa, sfb);
  }

  // accum += partial * (SFA x SFB), as CUTLASS computes it: partial * SFA with the tile's one
  // SFB folded in, else partial * SFA * SFB. `partial` is fenced by the caller, after its wait.
  template <class Accum, class Partial, class Scales>
  CUTLASS_DEVICE static void promote(Accum& accum, Partial& partial, Scales const& scales) {
    using namespace cute;
    auto const& sfa = get<0>(scales);
    auto const& sfb = get<1>(scales);
    if constexpr (Cutlass::ScaleNsPerTile == 1) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) {
        accum(i) += partial(i) * sfa(i);
      }
    } else {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) {
        accum(i) += partial(i) * sfa(i) * sfb(i);
      }
    }
  }

  // Waits until at most `Pending` WGMMA batches are in flight, then promotes `partial` with the
  // scales of `stage`. With one SFB per tile (fprop, dgrad) the scales are read before the wait,
  // so their latency passes while the WGMMAs run; the wgrad's per-column SFB would hold 32 more
  // registers across the wait, which its three accumulators leave no room for.
  template <int Pending, class Accum, class Partial, class SmemSFA, class SmemSFB>
  CUTLASS_DEVICE static void wait_and_promote(Accum& accum, Partial& partial,
                                              SmemSFA const& tCsSFA, SmemSFB const& tCsSFB,
                                              int stage) {
    if constexpr (Cutlass::ScaleNsPerTile == 1) {
      auto const s = scales(tCsSFA, tCsSFB, stage);
      cute::warpgroup_wait<Pending>();
      cute::warpgroup_fence_operand(partial);
      promote(accum, partial, s);
    } else {
      cute::warpgroup_wait<Pending>();
      cute::warpgroup_fence_operand(partial);
      promote(accum, partial, scales(tCsSFA, tCsSFB, stage));
    }
  }

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(typename Cutlass::MainloopPipeline pipeline,
                          typename Cutlass::PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx,
                          typename Cutlass::TensorStorage& shared_tensors,
                          typename Cutlass::Params const& /*mainloop_params*/) {
    using namespace cute;
    using SmemLayoutA = typename Cutlass::SmemLayoutA;
    using SmemLayoutB = typename Cutlass::SmemLayoutB;
    using SmemLayoutSFA = typename Cutlass::SmemLayoutSFA;
    using SmemLayoutSFB = typename Cutlass::SmemLayoutSFB;
    static_assert(is_rmem<FrgTensorC>::value, "C tensor must be rmem resident.");

    // The operand and scale views of CUTLASS's mma(), unchanged.
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    Tensor sSFA = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFA.data()),
        make_layout(make_shape(shape<0>(SmemLayoutSFA{}), get<1>(TileShape{}),
                               make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
                    make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                                make_stride(stride<1>(SmemLayoutSFA{}),
                                            stride<2>(SmemLayoutSFA{})))));  // (BLK_M,BLK_N,(BLK_K,P))
    Tensor sSFB = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFB.data()),
        make_layout(make_shape(get<0>(TileShape{}), shape<0>(SmemLayoutSFB{}),
                               make_shape(shape<1>(SmemLayoutSFB{}), shape<2>(SmemLayoutSFB{}))),
                    make_stride(_0{}, stride<0>(SmemLayoutSFB{}),
                                make_stride(stride<1>(SmemLayoutSFB{}),
                                            stride<2>(SmemLayoutSFB{})))));  // (BLK_M,BLK_N,(BLK_K,P))

    constexpr int MmaWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    Layout warp_group_thread_layout =
        make_layout(Int<MmaWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx));
    Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);
    Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA,MMA_M,MMA_K,PIPE)
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA,MMA_N,MMA_K,PIPE)

    clear(accum);
    if (k_tile_count <= 0) {
      return;
    }
    Tensor partial0 = make_fragment_like(accum);
    Tensor partial1 = make_fragment_like(accum);
    auto smem_pipe_release = smem_pipe_read;

    // The k tiles alternate between the two partial accumulators; a promoted tile's stage is
    // released at once except the last, which mma_tail releases (CUTLASS's contract).
    pipeline.consumer_wait(smem_pipe_read);
    issue(tiled_mma, partial0, tCrA, tCrB, smem_pipe_read.index());
    int pending_stage = smem_pipe_read.index();
    ++smem_pipe_read;
    --k_tile_count;
    // Issues the next k tile into `next`, then promotes the pending one from `done`.
    auto step = [&](auto& next, auto& done) {
      pipeline.consumer_wait(smem_pipe_read);
      issue(tiled_mma, next, tCrA, tCrB, smem_pipe_read.index());
      wait_and_promote<1>(accum, done, tCsSFA, tCsSFB, pending_stage);
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_release;
      pending_stage = smem_pipe_read.index();
      ++smem_pipe_read;
      --k_tile_count;
    };

    CUTLASS_PRAGMA_NO_UNROLL
    while (k_tile_count > 0) {
      step(partial1, partial0);
      if (k_tile_count == 0) {
        wait_and_promote<0>(accum, partial1, tCsSFA, tCsSFB, pending_stage);
        warpgroup_fence_operand(accum);
        return;
      }
      step(partial0, partial1);
    }
    wait_and_promote<0>(accum, partial0, tCsSFA, tCsSFB, pending_stage);
    warpgroup_fence_operand(accum);
  }
};

// CUTLASS's own blockwise mainloop with its main accumulator cleared first.
// That mainloop adds every promoted block to `accum` (accum += partial *
// scale), the first one included, but never zeroes it, and the kernel layer
// hands it the fragment as allocated: in a persistent kernel, registers that
// held the previous tile. The results were right only because the compiler
// folded the undefined addend away. Used when Fp8GemmConfig::kOverlap is
// not set (fp8_gemm.cuh).
template <class Cutlass>
struct ClearedAccumulatorMainloop : Cutlass {
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(typename Cutlass::MainloopPipeline pipeline,
                          typename Cutlass::PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx,
                          typename Cutlass::TensorStorage& shared_tensors,
                          typename Cutlass::Params const& mainloop_params) {
    cute::clear(accum);
    Cutlass::mma(pipeline, smem_pipe_read, accum, k_tile_count, thread_idx, shared_tensors,
                 mainloop_params);
  }
};

}  // namespace groupgrad
