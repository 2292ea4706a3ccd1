// CUTLASS 3.x ptr-array grouped GEMM for sm_90a (TMA, warp-specialized,
// persistent group tile scheduler), one template for fprop, dgrad and wgrad.
//
// Instantiated once per translation unit by generated files (see
// groupgrad/kernels/build.py, Variant.translation_unit and VARIANTS) through
// GROUPGRAD_REGISTER_VARIANT.
#pragma once

#include <atomic>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.hpp"

#include "launch_api.h"

namespace groupgrad {

// Compile-time description of one instantiation.
//   ElementIn: A and B (cutlass::bfloat16_t or cutlass::half_t)
//   ElementOut: D (and C when accumulating): bf16, fp16 or float
//   HasSource: true -> a C operand aliasing D, D = A B + beta C with beta = 1 when the
//              launch accumulates and beta = 0 otherwise (C is then never loaded);
//              false -> no C operand at all (overwrite only)
//   ARowMajor / BKMajor: operand layouts (see GemmLaunch in launch_api.h)
//   EpilogueN: 0 lets CUTLASS choose the epilogue tile (64 x 32 per ping-pong warp
//              group, 128 x 32 cooperative); otherwise the epilogue works in subtiles
//              of 64 (ping-pong) or 128 (cooperative) rows by EpilogueN columns
template <class ElementIn_, class ElementOut_, bool HasSource_, bool ARowMajor_, bool BKMajor_,
          bool Pingpong_, int TileM_, int TileN_, int TileK_, int ClusterM_, int ClusterN_,
          int EpilogueN_ = 0>
struct GemmConfig {
  using ElementIn = ElementIn_;
  using ElementOut = ElementOut_;
  static constexpr bool kHasSource = HasSource_;
  static constexpr bool kARowMajor = ARowMajor_;
  static constexpr bool kBKMajor = BKMajor_;
  static constexpr bool kPingpong = Pingpong_;
  using TileShape = cute::Shape<cute::Int<TileM_>, cute::Int<TileN_>, cute::Int<TileK_>>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM_>, cute::Int<ClusterN_>, cute::_1>;
  using EpilogueTile =
      std::conditional_t<EpilogueN_ == 0, cutlass::epilogue::collective::EpilogueTileAuto,
                         cute::Shape<cute::Int<Pingpong_ ? 64 : 128>, cute::Int<EpilogueN_>>>;
};

template <class Config>
struct GroupedGemm {
  using ElementA = typename Config::ElementIn;
  using ElementB = typename Config::ElementIn;
  using ElementD = typename Config::ElementOut;
  using ElementC = std::conditional_t<Config::kHasSource, ElementD, void>;
  using ElementAccumulator = float;
  using ElementCompute = float;

  using LayoutA = std::conditional_t<Config::kARowMajor, cutlass::layout::RowMajor,
                                     cutlass::layout::ColumnMajor>;
  // CUTLASS names B's layout as a K x N matrix: ColumnMajor is K-major.
  using LayoutB = std::conditional_t<Config::kBKMajor, cutlass::layout::ColumnMajor,
                                     cutlass::layout::RowMajor>;
  using LayoutD = cutlass::layout::RowMajor;

  static constexpr int kAlignmentIn = 16 / sizeof(ElementA);
  static constexpr int kAlignmentOut = 16 / sizeof(ElementD);

  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;

  using KernelSchedule =
      std::conditional_t<Config::kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule =
      std::conditional_t<Config::kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                         cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

  using FusionOp =
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementCompute, ElementC, ElementCompute>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::TileShape,
      typename Config::ClusterShape, typename Config::EpilogueTile,
      ElementAccumulator, ElementCompute, ElementC, LayoutD*, kAlignmentOut, ElementD, LayoutD*,
      kAlignmentOut, EpilogueSchedule, FusionOp>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignmentIn, ElementB,
      LayoutB*, kAlignmentIn, ElementAccumulator, typename Config::TileShape,
      typename Config::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;

  // The setup kernel writes one int64 per group for every stride array and
  // three int32 per problem shape; check that this is the memory layout of
  // CUTLASS's stride and shape types, and that the dynamic mode is where the
  // launch API says it is.
  static_assert(sizeof(StrideA) == sizeof(int64_t), "StrideA must hold one int64");
  static_assert(sizeof(StrideB) == sizeof(int64_t), "StrideB must hold one int64");
  static_assert(sizeof(StrideD) == sizeof(int64_t), "StrideD must hold one int64");
  static_assert(sizeof(typename ProblemShape::UnderlyingProblemShape) == 3 * sizeof(int),
                "problem shape must be three int32");
  static_assert(cute::is_static<decltype(cute::get<Config::kARowMajor ? 1 : 0>(StrideA{}))>::value,
                "A's unit stride is not where expected");
  static_assert(cute::is_static<decltype(cute::get<Config::kBKMajor ? 1 : 0>(StrideB{}))>::value,
                "B's unit stride is not where expected");
  static_assert(cute::is_static<decltype(cute::get<1>(StrideD{}))>::value,
                "D must be row-major");

  // The launch API's arrays are untyped; CUTLASS wants them typed.
  template <class To>
  static To cast(const void* from) {
    return static_cast<To>(const_cast<void*>(from));
  }

  static typename Gemm::Arguments arguments(const GemmLaunch& p) {
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {p.groups,
                          reinterpret_cast<typename ProblemShape::UnderlyingProblemShape*>(
                              p.problem_shapes),
                          nullptr};
    args.mainloop.ptr_A = cast<ElementA const**>(p.ptr_A);
    args.mainloop.dA = cast<StrideA*>(p.ld_A);
    args.mainloop.ptr_B = cast<ElementB const**>(p.ptr_B);
    args.mainloop.dB = cast<StrideB*>(p.ld_B);
    auto& fusion = args.epilogue.thread;
    fusion.alpha = 1.0f;
    // beta = 0 makes CUTLASS skip the C load entirely (is_C_load_needed() is
    // false and the source fragment is cleared), so an overwritten D is never read.
    fusion.beta = (Config::kHasSource && p.accumulate) ? 1.0f : 0.0f;
    fusion.alpha_ptr = nullptr;
    fusion.beta_ptr = nullptr;
    fusion.alpha_ptr_array = nullptr;
    fusion.beta_ptr_array = nullptr;
    if constexpr (Config::kHasSource) {
      args.epilogue.ptr_C = cast<ElementD const**>(p.ptr_D);  // C is D: in place, beta = 1
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

  static size_t workspace_size(const GemmLaunch& p) {
    return Gemm::get_workspace_size(arguments(p));
  }

  // CUTLASS's adapter (GemmUniversalAdapter::initialize and run) sets the kernel's
  // function attributes on every call; they belong to the function, so this sets
  // them once per device and launches the kernel itself, as the adapter would.
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

  static const char* run(const GemmLaunch& p, void* workspace) {
    const auto args = arguments(p);
    if (Gemm::can_implement(args) != cutlass::Status::kSuccess) {
      return "CUTLASS can_implement rejected the grouped GEMM arguments";
    }
    if (Kernel::initialize_workspace(args, workspace, p.stream) != cutlass::Status::kSuccess) {
      return "CUTLASS could not initialise the grouped GEMM's workspace";
    }
    if (!function_attributes_set(p.device_id)) {
      return "cudaFuncSetAttribute failed for the grouped GEMM's shared memory";
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
      return "CUTLASS grouped GEMM launch failed";
    }
    return nullptr;
  }
};

}  // namespace groupgrad

// Registers GroupedGemm<CONFIG> under NAME (the Python side looks it up by that name).
#define GROUPGRAD_REGISTER_VARIANT(NAME, CONFIG)                                      \
  namespace {                                                                         \
  using NAME##_gemm = ::groupgrad::GroupedGemm<CONFIG>;                               \
  [[maybe_unused]] const bool NAME##_registered =                                     \
      ::groupgrad::register_variant(::groupgrad::KernelVariant{                       \
          #NAME, CONFIG::kHasSource, &NAME##_gemm::workspace_size, &NAME##_gemm::run}); \
  }
