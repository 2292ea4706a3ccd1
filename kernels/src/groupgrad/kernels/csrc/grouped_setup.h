// Device-side setup of a grouped GEMM from the token counts per expert.
//
// One launch covers a chunk of up to kMaxGroupsPerLaunch groups (the per-group
// base pointers travel by value in the kernel parameters, so nothing waits for
// the host and a CUDA graph captures them); more groups take more launches.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace groupgrad {

constexpr int kMaxGroupsPerLaunch = 128;

enum class GemmOp : int { kFprop = 0, kDgrad = 1, kWgrad = 2 };

// Legend: T tokens, K in_features, N out_features, splits_E tokens per group.
//   fprop: y_e(M=m_e, N) = x_e(m_e, K) @ w_e(N, K)^T   A = x row-major, B = w K-major
//   dgrad: dx_e(m_e, K) = dy_e(m_e, N) @ w_e(N, K)      A = dy row-major, B = w N-major
//   wgrad: dw_e(N, K) = dy_e(m_e, N)^T @ x_e(m_e, K)    A = dy column-major, B = x N-major
struct SetupParams {
  const int64_t* splits = nullptr;  // (E,) on the device; never read by the host
  int num_groups = 0;               // E, the length of splits
  int64_t tokens = 0;               // T, the rows of the dense operands
  int64_t out_features = 0;         // N
  int64_t in_features = 0;          // K
  GemmOp op = GemmOp::kFprop;
  // Dense operands (rows are tokens).
  const char* dense_a = nullptr;    // fprop: x; dgrad and wgrad: dy
  int64_t ld_dense_a = 0;
  const char* dense_b = nullptr;    // wgrad: x
  int64_t ld_dense_b = 0;
  char* dense_d = nullptr;          // fprop: y; dgrad: dx
  int64_t ld_dense_d = 0;
  int in_bytes = 2;                 // element size of A and B
  int out_bytes = 2;                // element size of D
  // Per-group operands of this chunk: weights (fprop, dgrad) or outputs (wgrad).
  // Either packed — one (E, N, K) tensor: group g's matrix starts at
  // packed_base + g * packed_stride_bytes, rows packed_ld apart — or listed
  // per group in group_ptr / group_ld (packed_base is then null).
  int group_begin = 0;
  int group_count = 0;
  const char* packed_base = nullptr;
  int64_t packed_stride_bytes = 0;
  int64_t packed_ld = 0;
  const char* group_ptr[kMaxGroupsPerLaunch] = {};
  int64_t group_ld[kMaxGroupsPerLaunch] = {};
  // wgrad, overwrite: zero the output of every group with no tokens
  // (the GEMM skips such groups).
  bool zero_empty_outputs = false;
  // CUTLASS argument arrays (device), indexed by the global group index.
  int* problem_shapes = nullptr;    // (E, 3) int32: M, N, K
  const void** ptr_A = nullptr;
  int64_t* ld_A = nullptr;
  const void** ptr_B = nullptr;
  int64_t* ld_B = nullptr;
  void** ptr_D = nullptr;
  int64_t* ld_D = nullptr;
};

// Enqueues the setup of groups [group_begin, group_begin + group_count) on `stream`.
cudaError_t launch_grouped_setup(const SetupParams& params, cudaStream_t stream);

}  // namespace groupgrad
