// Spike: FP8 (e4m3) blockwise-scaled grouped weight-gradient GEMM for MoE experts
// on sm_90a, with CUTLASS 4.2's ptr-array blockwise-scaling mainloop.
//
// Legend: E experts, T tokens, N out_features, K in_features, splits_E tokens per
// expert (on the device), Tp = round_up(T + 15 E, 16) padded token columns,
// NB = ceil(T / 128) + E scale rows.
//
//   dW_e (N, K) fp32 row-major = dy_e^T (N, T_e) · x_e (T_e, K)   [+ dW_e]
//
// Operands (the quantizer's layout):
//   dyq (N, Tp) e4m3 row-major, expert e's tokens in columns [off_e, off_e + T_e),
//       off_e = sum_{j<e} round_up(T_j, 16); xq (K, Tp) likewise.
//   dys (NB, N) fp32 row-major, expert e's 128-token blocks in rows
//       [boff_e, boff_e + ceil(T_e / 128)), boff_e = sum_{j<e} ceil(T_j / 128);
//       xs (NB, K) likewise.
// As a CUTLASS GEMM per expert: M = N, N = K, GEMM-K = T_e; A = dyq + off_e and
// B = xq + off_e, both K-major with row stride Tp; scale granularity (1, 1, 128),
// both scale tensors M/N-major with k-block stride N (SFA) and K (SFB).
//
// Entry points (extern "C", for ctypes): fp8_wgrad_workspace_size, fp8_wgrad,
// fp8_wgrad_last_error. The caller owns every allocation; one call enqueues a
// setup kernel and the GEMM on `stream` and never synchronises, so it can be
// captured in a CUDA graph.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.hpp"

namespace fp8_spike {

// ------------------------------------------------------------------ the kernel

using ElementIn = cutlass::float_e4m3_t;
using ElementOut = float;
using ElementAccumulator = float;
using ElementCompute = float;

// A (M = N out features, GEMM-K = tokens) and B (N = K in features, GEMM-K) are
// both token-contiguous: A row-major, B "column-major" in CUTLASS's K x N naming.
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignmentIn = 16 / sizeof(ElementIn);
constexpr int kAlignmentOut = 16 / sizeof(ElementOut);

// Cooperative, not ping-pong: with a scale per (row, 128 tokens) and per (column,
// 128 tokens) the mainloop promotes every k-tile into a second register
// accumulator, so a warp group holds two fp32 accumulator tiles. Cooperative
// 128 x 128 gives each of its two warp groups 64 x 128 (2 x 64 registers per
// thread); ping-pong 128 x 128 would need 2 x 128 and spill.
// Cluster 1 x 2 (A, i.e. dy, multicast to the CTA pair along K features): the
// configuration of CUTLASS example 68 (tested upstream, incl. K = 960) and of the
// repo's bf16 fp32-wgrad kernel; K features is the same for every expert, so no
// group pays for an odd tile count.
using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
constexpr int kScaleBlockTokens = 128;
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, kScaleBlockTokens>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;

// D = alpha A B + beta C with C aliasing D: beta = 1 accumulates, beta = 0 makes
// the epilogue skip the C load (D is then never read).
using FusionOp =
    cutlass::epilogue::fusion::LinearCombination<ElementOut, ElementCompute, ElementOut, ElementCompute>;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementCompute, ElementOut,
    LayoutD*, kAlignmentOut, ElementOut, LayoutD*, kAlignmentOut, EpilogueSchedule,
    FusionOp>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn,
    cute::tuple<LayoutA*, LayoutSFA*>, kAlignmentIn, ElementIn, cute::tuple<LayoutB*, LayoutSFB*>,
    kAlignmentIn, ElementAccumulator, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    KernelSchedule>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                    CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

using StrideA = typename Kernel::InternalStrideA;
using StrideB = typename Kernel::InternalStrideB;
using StrideD = typename Kernel::InternalStrideD;
using Shape3 = typename ProblemShape::UnderlyingProblemShape;

static_assert(cute::is_static<decltype(cute::get<1>(StrideA{}))>::value, "A must be K-major");
static_assert(cute::is_static<decltype(cute::get<1>(StrideB{}))>::value, "B must be K-major");
static_assert(cute::is_static<decltype(cute::get<1>(StrideD{}))>::value, "D must be row-major");
static_assert(CollectiveMainloop::ScaleGranularityM == 1 && CollectiveMainloop::ScaleGranularityN == 1 &&
                  CollectiveMainloop::ScaleGranularityK == kScaleBlockTokens,
              "scale granularity must be (1, 1, 128)");
static_assert(CollectiveMainloop::MMajorSFA && CollectiveMainloop::NMajorSFB,
              "scales must be stored channel-major within a token block");

// ------------------------------------------------------------------ workspace

constexpr size_t kAlign = 256;

constexpr size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Byte offsets of the per-group argument arrays at the front of the workspace;
// CUTLASS's own workspace (tensor maps, scheduler) follows at `cutlass`.
struct WorkspaceLayout {
  size_t problem_shapes, ptr_A, ptr_B, ptr_SFA, ptr_SFB, stride_A, stride_B, stride_D;
  size_t layout_SFA, layout_SFB, cutlass;

  explicit WorkspaceLayout(int groups) {
    const size_t g = static_cast<size_t>(groups);
    size_t at = 0;
    auto take = [&](size_t bytes) {
      const size_t here = at;
      at += align_up(bytes);
      return here;
    };
    problem_shapes = take(g * sizeof(Shape3));
    ptr_A = take(g * sizeof(void*));
    ptr_B = take(g * sizeof(void*));
    ptr_SFA = take(g * sizeof(void*));
    ptr_SFB = take(g * sizeof(void*));
    stride_A = take(g * sizeof(StrideA));
    stride_B = take(g * sizeof(StrideB));
    stride_D = take(g * sizeof(StrideD));
    layout_SFA = take(g * sizeof(LayoutSFA));
    layout_SFB = take(g * sizeof(LayoutSFB));
    cutlass = at;
  }
};

// ------------------------------------------------------------------ setup kernel

constexpr int kThreads = 128;

struct SetupParams {
  const int64_t* splits = nullptr;  // (E,) device
  int groups = 0;
  int64_t tokens = 0;               // T
  int64_t padded_tokens = 0;        // Tp
  int64_t scale_rows = 0;           // NB
  int out_features = 0;             // N
  int in_features = 0;              // K
  const ElementIn* dyq = nullptr;   // (N, Tp)
  const float* dys = nullptr;       // (NB, N)
  const ElementIn* xq = nullptr;    // (K, Tp)
  const float* xs = nullptr;        // (NB, K)
  float* const* outputs = nullptr;  // (E,) device array of (N, K) row-major fp32
  bool zero_empty_outputs = false;  // overwrite: the GEMM skips empty groups
  Shape3* problem_shapes = nullptr;
  const ElementIn** ptr_A = nullptr;
  const ElementIn** ptr_B = nullptr;
  const float** ptr_SFA = nullptr;
  const float** ptr_SFB = nullptr;
  StrideA* stride_A = nullptr;
  StrideB* stride_B = nullptr;
  StrideD* stride_D = nullptr;
  LayoutSFA* layout_SFA = nullptr;
  LayoutSFB* layout_SFB = nullptr;
};

// Where a group's data starts: its first token, its first (16-aligned) padded
// column and its first 128-token scale row.
struct GroupStart {
  int64_t token = 0;
  int64_t column = 0;
  int64_t scale_row = 0;
};

__device__ int64_t round_up_16(int64_t v) { return (v + 15) / 16 * 16; }
__device__ int64_t scale_blocks(int64_t v) { return (v + kScaleBlockTokens - 1) / kScaleBlockTokens; }

__device__ int64_t warp_sum(int64_t v) {
  for (int offset = 16; offset > 0; offset /= 2) {
    v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  return v;
}

// The three prefix sums of splits[0:group) over the block; every thread gets them.
__device__ GroupStart block_group_start(const int64_t* splits, int group) {
  __shared__ int64_t partial[3][kThreads / 32];
  GroupStart mine;
  for (int i = threadIdx.x; i < group; i += kThreads) {
    const int64_t t = max(splits[i], int64_t{0});
    mine.token += t;
    mine.column += round_up_16(t);
    mine.scale_row += scale_blocks(t);
  }
  mine.token = warp_sum(mine.token);
  mine.column = warp_sum(mine.column);
  mine.scale_row = warp_sum(mine.scale_row);
  if (threadIdx.x % 32 == 0) {
    partial[0][threadIdx.x / 32] = mine.token;
    partial[1][threadIdx.x / 32] = mine.column;
    partial[2][threadIdx.x / 32] = mine.scale_row;
  }
  __syncthreads();
  GroupStart start;
  for (int w = 0; w < kThreads / 32; ++w) {
    start.token += partial[0][w];
    start.column += partial[1][w];
    start.scale_row += partial[2][w];
  }
  return start;
}

// grid = (parts, E): block (0, g) writes group g's CUTLASS arguments; when
// overwriting, every block of a group with no tokens zeroes a share of its rows.
__global__ void __launch_bounds__(kThreads) fp8_wgrad_setup_kernel(const SetupParams p) {
  const int g = blockIdx.y;
  const GroupStart start = block_group_start(p.splits, g);
  // Malformed splits (negative, or summing past T) must never address memory
  // outside the operands: clamp to the tokens left, and drop a group that would
  // not fit the padded columns or the scale rows (possible only past T).
  int64_t tokens = min(max(p.splits[g], int64_t{0}), max(p.tokens - start.token, int64_t{0}));
  if (start.column + tokens > p.padded_tokens ||
      start.scale_row + scale_blocks(tokens) > p.scale_rows) {
    tokens = 0;
  }

  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const int m = p.out_features;
    const int n = p.in_features;
    const int k = static_cast<int>(tokens);
    // A group with no tokens gets M = 0 so the scheduler gives it no tiles: with
    // K = 0 the mainloop would store uninitialised accumulators.
    p.problem_shapes[g] = Shape3{k > 0 ? m : 0, n, k};
    p.ptr_A[g] = p.dyq + start.column;
    p.ptr_B[g] = p.xq + start.column;
    p.ptr_SFA[g] = p.dys + start.scale_row * p.out_features;
    p.ptr_SFB[g] = p.xs + start.scale_row * p.in_features;
    StrideA stride_a{};
    cute::get<0>(stride_a) = p.padded_tokens;
    p.stride_A[g] = stride_a;
    StrideB stride_b{};
    cute::get<0>(stride_b) = p.padded_tokens;
    p.stride_B[g] = stride_b;
    StrideD stride_d{};
    cute::get<0>(stride_d) = p.in_features;
    p.stride_D[g] = stride_d;
    // CUTLASS 4.2's sm90 collective ignores these and derives the same layouts
    // from the problem shape (packed: k-block stride M for SFA, N for SFB), which
    // is exactly our (NB, N) / (NB, K) layout; filled for collectives that read them.
    const auto mnkl = cute::make_shape(m, n, k, 1);
    p.layout_SFA[g] = ScaleConfig::tile_atom_to_shape_SFA(mnkl);
    p.layout_SFB[g] = ScaleConfig::tile_atom_to_shape_SFB(mnkl);
  }

  if (p.zero_empty_outputs && tokens == 0) {
    // N rows of K fp32: K % 4 == 0 (checked on the host); the output must be
    // 16-byte aligned (a documented requirement: the host cannot read the pointer).
    int4* out = reinterpret_cast<int4*>(p.outputs[g]);
    const int64_t vecs_per_row = p.in_features / 4;
    const int4 zero = make_int4(0, 0, 0, 0);
    for (int64_t r = blockIdx.x; r < p.out_features; r += gridDim.x) {
      for (int64_t v = threadIdx.x; v < vecs_per_row; v += kThreads) {
        out[r * vecs_per_row + v] = zero;
      }
    }
  }
}

// ------------------------------------------------------------------ host side

thread_local char g_last_error[512] = "";

// Records a printf-style message for fp8_wgrad_last_error and returns `code`.
int fail(int code, const char* format, ...) {
  va_list args;
  va_start(args, format);
  std::vsnprintf(g_last_error, sizeof(g_last_error), format, args);
  va_end(args);
  return code;
}

bool aligned(const void* ptr, size_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

typename Gemm::Arguments gemm_arguments(int groups, const WorkspaceLayout& layout, char* workspace,
                                        float* const* outputs, bool accumulate, int sm_count) {
  // With no workspace (the size query) every array pointer stays null.
  auto at = [&](size_t offset) {
    return workspace != nullptr ? static_cast<void*>(workspace + offset) : nullptr;
  };
  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  // Shapes live on the device only (no host copy): can_implement then skips its
  // per-group alignment checks, which fp8_wgrad does on the host instead.
  args.problem_shape = {groups, static_cast<Shape3*>(at(layout.problem_shapes)), nullptr};
  args.mainloop.ptr_A = static_cast<const ElementIn**>(at(layout.ptr_A));
  args.mainloop.dA = static_cast<StrideA*>(at(layout.stride_A));
  args.mainloop.ptr_B = static_cast<const ElementIn**>(at(layout.ptr_B));
  args.mainloop.dB = static_cast<StrideB*>(at(layout.stride_B));
  args.mainloop.ptr_SFA = static_cast<const float**>(at(layout.ptr_SFA));
  args.mainloop.layout_SFA = static_cast<LayoutSFA*>(at(layout.layout_SFA));
  args.mainloop.ptr_SFB = static_cast<const float**>(at(layout.ptr_SFB));
  args.mainloop.layout_SFB = static_cast<LayoutSFB*>(at(layout.layout_SFB));
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = accumulate ? 1.0f : 0.0f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  auto** d_ptrs = const_cast<float**>(outputs);
  args.epilogue.ptr_C = const_cast<const float**>(d_ptrs);  // C is D (in place)
  args.epilogue.dC = static_cast<StrideD*>(at(layout.stride_D));
  args.epilogue.ptr_D = d_ptrs;
  args.epilogue.dD = static_cast<StrideD*>(at(layout.stride_D));
  int device = 0;
  cudaGetDevice(&device);
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
  args.scheduler.max_swizzle_size = 1;
  args.scheduler.raster_order = decltype(args.scheduler.raster_order)::AlongM;
  return args;
}

}  // namespace fp8_spike

extern "C" {

// Message of the last failed call on this thread ("" after a success).
const char* fp8_wgrad_last_error() { return fp8_spike::g_last_error; }

// Bytes of device workspace fp8_wgrad needs for `groups` experts on `sm_count` SMs
// (0 on a bad argument). The workspace must be 256-byte aligned.
size_t fp8_wgrad_workspace_size(int groups, int sm_count) {
  using namespace fp8_spike;
  if (groups <= 0 || sm_count <= 0) {
    fail(1, "fp8_wgrad_workspace_size: groups = %d and sm_count = %d must be positive", groups,
         sm_count);
    return 0;
  }
  const WorkspaceLayout layout(groups);
  const auto args = gemm_arguments(groups, layout, nullptr, nullptr, true, sm_count);
  return layout.cutlass + align_up(Gemm::get_workspace_size(args));
}

// Enqueues dW_e = dy_e^T x_e (+ dW_e when accumulate) for every expert e < E on
// `stream`. Returns 0 on success; otherwise a code (1 argument, 2 setup kernel,
// 3 can_implement, 4 initialize, 5 run) and fp8_wgrad_last_error() says why.
// out_ptrs_dev: device array of E pointers to (N, K) fp32 row-major outputs,
// 16-byte aligned; overwrite (accumulate = 0) never reads them and zeroes the
// outputs of experts with no tokens; accumulate leaves those untouched.
int fp8_wgrad(int E, const int64_t* splits_dev, int64_t T, int64_t Tp, int64_t NB, int N, int K,
              const void* dyq, const float* dys, const void* xq, const float* xs,
              float* const* out_ptrs_dev, int accumulate, void* workspace, size_t workspace_bytes,
              int sm_count, cudaStream_t stream) {
  using namespace fp8_spike;
  g_last_error[0] = '\0';
  if (E <= 0) {
    return E == 0 ? 0 : fail(1, "fp8_wgrad: E = %d, expected >= 0", E);
  }
  if (N <= 0 || K <= 0 || K % 4 != 0) {
    return fail(1, "fp8_wgrad: N = %d and K = %d must be positive, K a multiple of 4", N, K);
  }
  if (T < 0 || Tp < T || Tp % 16 != 0) {
    return fail(1, "fp8_wgrad: Tp = %lld must be a multiple of 16 and >= T = %lld",
                static_cast<long long>(Tp), static_cast<long long>(T));
  }
  if (NB < (T + kScaleBlockTokens - 1) / kScaleBlockTokens) {
    return fail(1, "fp8_wgrad: NB = %lld scale rows, expected >= ceil(T / 128) + E",
                static_cast<long long>(NB));
  }
  const char* null_arg = splits_dev == nullptr     ? "splits_dev"
                         : dyq == nullptr          ? "dyq"
                         : dys == nullptr          ? "dys"
                         : xq == nullptr           ? "xq"
                         : xs == nullptr           ? "xs"
                         : out_ptrs_dev == nullptr ? "out_ptrs_dev"
                                                   : nullptr;
  if (null_arg != nullptr) {
    return fail(1, "fp8_wgrad: %s is null", null_arg);
  }
  if (!aligned(dyq, 16) || !aligned(xq, 16)) {
    return fail(1, "fp8_wgrad: %s = %p is not 16-byte aligned (TMA needs it)",
                aligned(dyq, 16) ? "xq" : "dyq", aligned(dyq, 16) ? xq : dyq);
  }
  if (sm_count <= 0) {
    return fail(1, "fp8_wgrad: sm_count = %d, expected > 0", sm_count);
  }
  const size_t needed = fp8_wgrad_workspace_size(E, sm_count);
  if (workspace == nullptr || !aligned(workspace, kAlign) || workspace_bytes < needed) {
    return fail(1, "fp8_wgrad: workspace %p of %zu bytes, expected %zu bytes, 256-byte aligned",
                workspace, workspace_bytes, needed);
  }

  const WorkspaceLayout layout(E);
  char* base = static_cast<char*>(workspace);
  SetupParams p;
  p.splits = splits_dev;
  p.groups = E;
  p.tokens = T;
  p.padded_tokens = Tp;
  p.scale_rows = NB;
  p.out_features = N;
  p.in_features = K;
  p.dyq = static_cast<const ElementIn*>(dyq);
  p.dys = dys;
  p.xq = static_cast<const ElementIn*>(xq);
  p.xs = xs;
  p.outputs = out_ptrs_dev;
  p.zero_empty_outputs = accumulate == 0;
  p.problem_shapes = reinterpret_cast<Shape3*>(base + layout.problem_shapes);
  p.ptr_A = reinterpret_cast<const ElementIn**>(base + layout.ptr_A);
  p.ptr_B = reinterpret_cast<const ElementIn**>(base + layout.ptr_B);
  p.ptr_SFA = reinterpret_cast<const float**>(base + layout.ptr_SFA);
  p.ptr_SFB = reinterpret_cast<const float**>(base + layout.ptr_SFB);
  p.stride_A = reinterpret_cast<StrideA*>(base + layout.stride_A);
  p.stride_B = reinterpret_cast<StrideB*>(base + layout.stride_B);
  p.stride_D = reinterpret_cast<StrideD*>(base + layout.stride_D);
  p.layout_SFA = reinterpret_cast<LayoutSFA*>(base + layout.layout_SFA);
  p.layout_SFB = reinterpret_cast<LayoutSFB*>(base + layout.layout_SFB);

  // Enough blocks per group that zeroing a large empty output spreads over the
  // GPU, few enough that the early exits of the other groups stay cheap.
  int parts = 1;
  if (p.zero_empty_outputs) {
    parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(N, 4096 / E)));
  }
  fp8_wgrad_setup_kernel<<<dim3(parts, E), kThreads, 0, stream>>>(p);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return fail(2, "fp8_wgrad: setup kernel launch failed: %s", cudaGetErrorString(err));
  }

  const auto args = gemm_arguments(E, layout, base, out_ptrs_dev, accumulate != 0, sm_count);
  if (const auto status = Gemm::can_implement(args); status != cutlass::Status::kSuccess) {
    return fail(3, "fp8_wgrad: CUTLASS can_implement: %s", cutlassGetStatusString(status));
  }
  Gemm gemm;
  if (const auto status = gemm.initialize(args, base + layout.cutlass, stream);
      status != cutlass::Status::kSuccess) {
    return fail(4, "fp8_wgrad: CUTLASS initialize: %s", cutlassGetStatusString(status));
  }
  if (const auto status = gemm.run(stream); status != cutlass::Status::kSuccess) {
    const cudaError_t err = cudaGetLastError();
    return fail(5, "fp8_wgrad: CUTLASS run: %s", err != cudaSuccess ? cudaGetErrorString(err)
                                                                     : cutlassGetStatusString(status));
  }
  return 0;
}

}  // extern "C"
