// CUTLASS 4.2 ptr-array grouped GEMM for sm_90a on e4m3 operands with fp32
// blockwise scales (KernelPtrArrayTmaWarpSpecialized*FP8Blockwise): one
// template for FP8 fprop, dgrad and wgrad.
//
// Instantiated once per translation unit by generated files (see
// groupgrad/kernels/build.py, Fp8Variant.translation_unit and FP8_VARIANTS)
// through GROUPGRAD_REGISTER_FP8_VARIANT.
//
// FP8 wgmma reads both operands K-major, so A is row-major (M, K) and B is
// "column-major" (K-major (N, K)) for every op; fp8_setup.h says which tensor
// plays which role.
//
// Scales. The mainloop multiplies each 128-deep k-block's partial product by
// SFA[m block, k block] * SFB[n block, k block] (promotion into a second fp32
// accumulator). CUTLASS 4.2's grouped sm90 collective
// (sm90_mma_array_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp,
// tensors_perform_update -> load_init) ignores the layout_SFA / layout_SFB
// arguments: for each group it rebuilds the scale layout from the group's
// (M, N, K) with ScaleConfig::tile_atom_to_shape_SF{A,B}
// (cutlass/detail/blockwise_scale_layout.hpp), a packed matrix of
// ceil(M / gM) x ceil(K / 128) scales whose majorness comes from the layout
// type's strides (MMajorSFA / NMajorSFB). Packed per group means:
//   MN-major: scale (i, j) at i + j * ceil(M / gM)    K-major: at i * ceil(K / 128) + j
// The launch therefore passes null layout arrays and chooses the majors so that
// the given scale tensors are those packed matrices (fp8_setup.h has the
// per-op mapping); GROUPGRAD_FP8_CHECKED_CUTLASS pins the version where this
// was read in the headers.
#pragma once

#include <atomic>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/device_kernel.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.hpp"
#include "cutlass/version.h"

#include "fp8_overlap_mainloop.cuh"
#include "launch_api.h"

// The collective's use of the scale layouts (see above) was checked in 4.2.
#define GROUPGRAD_FP8_CHECKED_CUTLASS (CUTLASS_MAJOR == 4 && CUTLASS_MINOR == 2)
static_assert(GROUPGRAD_FP8_CHECKED_CUTLASS,
              "re-check that CUTLASS's sm90 grouped blockwise-FP8 collective derives the "
              "scale layouts from the problem shape (fp8_gemm.cuh), then update this check");

// TMA reduce-add as the epilogue's store (Config::kAddsToD). CUTLASS 4.2's
// SM90_TMA_REDUCE_ADD traits lack the with(descriptor) that the ptr-array
// epilogue calls to swap in each group's tensor map, so these two ops carry
// the traits SM90_TMA_STORE has (same descriptor: the tensor map does not say
// store or add) and issue cp.reduce.async.bulk.tensor ... .add instead: L2
// adds the fp32 result to D, the epilogue never loads D.
namespace groupgrad {
struct TmaReduceAdd : cute::SM90_TMA_REDUCE_ADD {};
struct TmaReduceAddPtr : cute::SM90_TMA_REDUCE_ADD {};

// The builder's epilogue with its smem -> gmem op replaced by StoreOp.
template <class Epilogue, class StoreOp>
struct WithStoreOp;
template <class Policy, class Tile, class EpiTile, class EC, class SC, class ED, class SD,
          class Fusion, class G2S, class SmemC, class S2R, class S2G, class SmemD, class R2S,
          class AtomC, class R2R, class StoreOp>
struct WithStoreOp<cutlass::epilogue::collective::CollectiveEpilogue<
                       Policy, Tile, EpiTile, EC, SC, ED, SD, Fusion, G2S, SmemC, S2R, S2G, SmemD,
                       R2S, AtomC, R2R>,
                   StoreOp> {
  using type = cutlass::epilogue::collective::CollectiveEpilogue<
      Policy, Tile, EpiTile, EC, SC, ED, SD, Fusion, G2S, SmemC, S2R, StoreOp, SmemD, R2S, AtomC,
      R2R>;
};
}  // namespace groupgrad

namespace cute {

template <class NumBitsPerTMA>
struct Copy_Traits<groupgrad::TmaReduceAddPtr, NumBitsPerTMA> {
  using ThrID = Layout<_1>;
  using SrcLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using DstLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using RefLayout = SrcLayout;

  TmaDescriptor const* tma_desc_;

  template <class TS, class SLayout, class TD, class DLayout>
  CUTE_HOST_DEVICE friend constexpr void copy_unpack(Copy_Traits const& traits,
                                                     Tensor<TS, SLayout> const& src,
                                                     Tensor<TD, DLayout>& dst) {
    static_assert(is_smem<TS>::value, "Expected smem src for a TMA reduce-add");
    auto dst_coord = dst.data().coord_;
    return detail::explode_tuple(detail::CallCOPY<SM90_TMA_REDUCE_ADD>{},
                                 make_tuple(static_cast<void const*>(traits.tma_desc_),
                                            static_cast<void const*>(raw_pointer_cast(src.data()))),
                                 seq<0, 1>{}, dst_coord, tuple_seq<decltype(dst_coord)>{});
  }
};

template <class NumBitsPerTMA, class AuxParams_>
struct Copy_Traits<groupgrad::TmaReduceAdd, NumBitsPerTMA, AuxParams_> {
  using ThrID = Layout<_1>;
  using SrcLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using DstLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using RefLayout = SrcLayout;

  TmaDescriptor tma_desc_;
  using AuxParams = AuxParams_;
  AuxParams aux_params_;

  CUTE_HOST_DEVICE constexpr TmaDescriptor const* get_tma_descriptor() const { return &tma_desc_; }

  template <class GShape>
  CUTE_HOST_DEVICE constexpr auto get_tma_tensor(GShape const& g_shape) const {
    static_assert(is_congruent<decltype(g_shape), decltype(aux_params_.g_stride_)>::value);
    return make_coord_tensor(make_layout(g_shape, aux_params_.g_stride_));
  }

  // The same op on another group's tensor map (the ptr-array epilogue's per-group swap).
  CUTE_HOST_DEVICE constexpr Copy_Traits<groupgrad::TmaReduceAddPtr, NumBitsPerTMA> with(
      TmaDescriptor const* new_tma_desc) const {
    return {new_tma_desc};
  }

  template <class TS, class SLayout, class TD, class DLayout>
  CUTE_HOST_DEVICE friend constexpr void copy_unpack(Copy_Traits const& traits,
                                                     Tensor<TS, SLayout> const& src,
                                                     Tensor<TD, DLayout>& dst) {
    copy_unpack(Copy_Traits<groupgrad::TmaReduceAddPtr, NumBitsPerTMA>{&traits.tma_desc_}, src,
                dst);
  }
};

}  // namespace cute

namespace groupgrad {

// Compile-time description of one FP8 instantiation.
//   ElementOut: D (and C when accumulating): bf16, fp16 or float
//   HasSource: true -> a C operand aliasing D (beta 1 accumulates, beta 0
//              overwrites and C is never loaded); false -> no C operand
//   AddsToD: D is stored with TMA reduce-add (D += result, added in L2): no C
//            operand, the kernel only accumulates (fp32 D)
//   ScaleN: scale granularity along GEMM N (128: weights, 1: per channel);
//           along M it is always 1 (per token or per channel), along K 128
//   SfbMnMajor: SFB's packed matrix is N-block-major (else K-block-major);
//           SFA is always M-major
//   Overlap: promote each k-block while the next one's WGMMAs run
//           (fp8_overlap_mainloop.cuh), else CUTLASS's mainloop (its main
//           accumulator cleared first, ClearedAccumulatorMainloop)
template <class ElementOut_, bool HasSource_, bool AddsToD_, int ScaleN_, bool SfbMnMajor_,
          bool Pingpong_, bool Overlap_, int TileM_, int TileN_, int TileK_, int ClusterM_,
          int ClusterN_>
struct Fp8GemmConfig {
  using ElementOut = ElementOut_;
  static constexpr bool kHasSource = HasSource_;
  static constexpr bool kAddsToD = AddsToD_;
  static_assert(!(HasSource_ && AddsToD_), "a reduce-add store reads no C operand");
  static_assert(!AddsToD_ || std::is_same_v<ElementOut_, float>,
                "TMA reduce-add of a 16-bit D would round the product before the add");
  static constexpr int kScaleN = ScaleN_;
  static constexpr bool kSfbMnMajor = SfbMnMajor_;
  static constexpr bool kPingpong = Pingpong_;
  static constexpr bool kOverlap = Overlap_;
  using TileShape = cute::Shape<cute::Int<TileM_>, cute::Int<TileN_>, cute::Int<TileK_>>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM_>, cute::Int<ClusterN_>, cute::_1>;
};

template <class Config>
struct Fp8GroupedGemm {
  using ElementIn = cutlass::float_e4m3_t;
  using ElementD = typename Config::ElementOut;
  using ElementC = std::conditional_t<Config::kHasSource, ElementD, void>;
  using ElementAccumulator = float;
  using ElementCompute = float;

  using LayoutA = cutlass::layout::RowMajor;     // K-major (M, K)
  using LayoutB = cutlass::layout::ColumnMajor;  // K-major (N, K), in CUTLASS's K x N naming
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignmentIn = 16 / sizeof(ElementIn);
  static constexpr int kAlignmentOut = 16 / sizeof(ElementD);

  static constexpr int kScaleK = 128;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<
      1, Config::kScaleN, kScaleK, cute::GMMA::Major::MN,
      Config::kSfbMnMajor ? cute::GMMA::Major::MN : cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;

  // Cooperative is the tested configuration: the second (promotion)
  // accumulator doubles the registers per tile, which a 128 x 128 ping-pong
  // warp group would spill; ping-pong suits 64-row tiles.
  using KernelSchedule = std::conditional_t<
      Config::kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>;
  using EpilogueSchedule =
      std::conditional_t<Config::kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                         cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

  using FusionOp =
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementCompute, ElementC, ElementCompute>;

  using BuiltEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::TileShape,
      typename Config::ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto,
      ElementAccumulator, ElementCompute, ElementC, LayoutD*, kAlignmentOut, ElementD, LayoutD*,
      kAlignmentOut, EpilogueSchedule, FusionOp>::CollectiveOp;
  using CollectiveEpilogue =
      std::conditional_t<Config::kAddsToD, typename WithStoreOp<BuiltEpilogue, TmaReduceAdd>::type,
                         BuiltEpilogue>;

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn,
      cute::tuple<LayoutA*, LayoutSFA*>, kAlignmentIn, ElementIn, cute::tuple<LayoutB*, LayoutSFB*>,
      kAlignmentIn, ElementAccumulator, typename Config::TileShape, typename Config::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using CollectiveMainloop =
      std::conditional_t<Config::kOverlap, OverlappedPromotionMainloop<BuiltMainloop>,
                         ClearedAccumulatorMainloop<BuiltMainloop>>;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;

  // The setup kernel writes one int64 per group for every stride array and
  // three int32 per problem shape (as for the bf16 kernels).
  static_assert(sizeof(StrideA) == sizeof(int64_t), "StrideA must hold one int64");
  static_assert(sizeof(StrideB) == sizeof(int64_t), "StrideB must hold one int64");
  static_assert(sizeof(StrideD) == sizeof(int64_t), "StrideD must hold one int64");
  static_assert(sizeof(typename ProblemShape::UnderlyingProblemShape) == 3 * sizeof(int),
                "problem shape must be three int32");
  static_assert(cute::is_static<decltype(cute::get<1>(StrideA{}))>::value, "A must be K-major");
  static_assert(cute::is_static<decltype(cute::get<1>(StrideB{}))>::value, "B must be K-major");
  static_assert(cute::is_static<decltype(cute::get<1>(StrideD{}))>::value, "D must be row-major");
  static_assert(CollectiveMainloop::ScaleGranularityM == 1 &&
                    CollectiveMainloop::ScaleGranularityN == Config::kScaleN &&
                    CollectiveMainloop::ScaleGranularityK == kScaleK,
                "unexpected scale granularity");
  static_assert(CollectiveMainloop::MMajorSFA && CollectiveMainloop::NMajorSFB == Config::kSfbMnMajor,
                "unexpected scale majorness");

  template <class To>
  static To cast(const void* from) {
    return static_cast<To>(const_cast<void*>(from));
  }

  static typename Gemm::Arguments arguments(const Fp8GemmLaunch& launch) {
    const GemmLaunch& p = launch.gemm;
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    // Shapes on the device only: can_implement skips its per-group alignment
    // checks, which the binding does on the host instead.
    args.problem_shape = {p.groups,
                          reinterpret_cast<typename ProblemShape::UnderlyingProblemShape*>(
                              p.problem_shapes),
                          nullptr};
    args.mainloop.ptr_A = cast<ElementIn const**>(p.ptr_A);
    args.mainloop.dA = cast<StrideA*>(p.ld_A);
    args.mainloop.ptr_B = cast<ElementIn const**>(p.ptr_B);
    args.mainloop.dB = cast<StrideB*>(p.ld_B);
    args.mainloop.ptr_SFA = cast<float const**>(launch.ptr_SFA);
    args.mainloop.ptr_SFB = cast<float const**>(launch.ptr_SFB);
    // Never read by the collective (see the top of this file).
    args.mainloop.layout_SFA = nullptr;
    args.mainloop.layout_SFB = nullptr;
    auto& fusion = args.epilogue.thread;
    fusion.alpha = 1.0f;
    // beta = 0 makes CUTLASS skip the C load, so an overwritten D is never read.
    fusion.beta = (Config::kHasSource && p.accumulate) ? 1.0f : 0.0f;
    fusion.alpha_ptr = nullptr;
    fusion.beta_ptr = nullptr;
    fusion.alpha_ptr_array = nullptr;
    fusion.beta_ptr_array = nullptr;
    if constexpr (Config::kHasSource) {
      args.epilogue.ptr_C = cast<ElementD const**>(p.ptr_D);  // C is D: in place
      args.epilogue.dC = cast<StrideD*>(p.ld_D);
    } else {
      args.epilogue.ptr_C = nullptr;
      args.epilogue.dC = nullptr;
    }
    args.epilogue.ptr_D = cast<ElementD**>(p.ptr_D);
    args.epilogue.dD = cast<StrideD*>(p.ld_D);
    args.hw_info.device_id = p.device_id;
    args.hw_info.sm_count = p.sm_count;
    args.scheduler.max_swizzle_size = p.max_swizzle;
    using RasterOrder = decltype(args.scheduler.raster_order);
    args.scheduler.raster_order = p.raster_along_n ? RasterOrder::AlongN : RasterOrder::AlongM;
    return args;
  }

  static size_t workspace_size(const Fp8GemmLaunch& launch) {
    return Gemm::get_workspace_size(arguments(launch));
  }

  // Sets the kernel's shared-memory attribute once per device (the adapter
  // would on every call), as GroupedGemm does.
  static bool function_attributes_set(int device_id) {
    static std::atomic<bool> done[kMaxDevices] = {};
    const bool cached = device_id >= 0 && device_id < kMaxDevices;
    if (cached && done[device_id].load(std::memory_order_acquire)) {
      return true;
    }
    const void* kernel = reinterpret_cast<const void*>(&cutlass::device_kernel<Kernel>);
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             Kernel::SharedStorageSize) != cudaSuccess) {
      cudaGetLastError();  // clear the error bit; the caller reports the failure
      return false;
    }
    if (cached) {
      done[device_id].store(true, std::memory_order_release);
    }
    return true;
  }

  static const char* run(const Fp8GemmLaunch& launch, void* workspace) {
    const GemmLaunch& p = launch.gemm;
    const auto args = arguments(launch);
    if (Gemm::can_implement(args) != cutlass::Status::kSuccess) {
      return "CUTLASS can_implement rejected the FP8 grouped GEMM arguments";
    }
    if (Kernel::initialize_workspace(args, workspace, p.stream) != cutlass::Status::kSuccess) {
      return "CUTLASS could not initialise the FP8 grouped GEMM's workspace";
    }
    if (!function_attributes_set(p.device_id)) {
      return "cudaFuncSetAttribute failed for the FP8 grouped GEMM's shared memory";
    }
    typename Kernel::Params params = Kernel::to_underlying_arguments(args, workspace);
    constexpr int kClusterSize = cute::size(typename Config::ClusterShape{});
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = cute::size<0>(typename Config::ClusterShape{});
    cluster.val.clusterDim.y = cute::size<1>(typename Config::ClusterShape{});
    cluster.val.clusterDim.z = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = Kernel::get_grid_shape(params);
    config.blockDim = Kernel::get_block_shape();
    config.dynamicSmemBytes = Kernel::SharedStorageSize;
    config.stream = p.stream;
    config.attrs = &cluster;
    config.numAttrs = kClusterSize > 1 ? 1 : 0;
    void* kernel_params[] = {&params};
    const void* kernel = reinterpret_cast<const void*>(&cutlass::device_kernel<Kernel>);
    if (cudaLaunchKernelExC(&config, kernel, kernel_params) != cudaSuccess) {
      return "CUTLASS FP8 grouped GEMM launch failed";
    }
    return nullptr;
  }
};

}  // namespace groupgrad

// Registers Fp8GroupedGemm<CONFIG> under NAME (the Python side looks it up by that name).
#define GROUPGRAD_REGISTER_FP8_VARIANT(NAME, CONFIG)                                   \
  namespace {                                                                          \
  using NAME##_gemm = ::groupgrad::Fp8GroupedGemm<CONFIG>;                             \
  [[maybe_unused]] const bool NAME##_registered =                                      \
      ::groupgrad::register_fp8_variant(::groupgrad::Fp8KernelVariant{                 \
          #NAME, CONFIG::kHasSource, CONFIG::kAddsToD,                                \
          sizeof(typename CONFIG::ElementOut),                                         \
          CONFIG::kScaleN, CONFIG::kSfbMnMajor, &NAME##_gemm::workspace_size,           \
          &NAME##_gemm::run});                                                          \
  }
