// Builds CUTLASS's per-group problem shapes, pointers and strides on the
// device from splits (see grouped_setup.h), and zeroes the wgrad outputs of
// empty groups when overwriting. Malformed splits (setup_common.cuh) give
// every group M = 0 and NaN outputs.
#include "grouped_setup.h"
#include "setup_common.cuh"

namespace groupgrad {
namespace {

constexpr int kThreads = kSetupThreads;

// Sum of splits[0:count) over the block; every thread gets the result.
__device__ int64_t block_prefix(const int64_t* splits, int count) {
  int64_t sum[1] = {0};
  for (int i = threadIdx.x; i < count; i += kThreads) {
    sum[0] += splits[i];
  }
  block_sums(sum);
  return sum[0];
}

__device__ const char* group_matrix(const SetupParams& p, int g, int local) {
  return p.packed_base != nullptr ? p.packed_base + g * p.packed_stride_bytes : p.group_ptr[local];
}

__device__ int64_t group_leading_dim(const SetupParams& p, int local) {
  return p.packed_base != nullptr ? p.packed_ld : p.group_ld[local];
}

// Malformed splits: NaN in every output. fprop and dgrad write one dense D
// (T rows), filled by the blocks of the first launch; wgrad a matrix per group.
__device__ void poison_outputs(const SetupParams& p, char* matrix, int64_t ld) {
  if (p.op == GemmOp::kWgrad) {
    fill_matrix(matrix, p.out_features, p.in_features * p.out_bytes, ld * p.out_bytes, kNanByte,
                blockIdx.x, gridDim.x);
  } else if (p.group_begin == 0) {
    const int64_t cols = p.op == GemmOp::kFprop ? p.out_features : p.in_features;
    fill_matrix(p.dense_d, p.tokens, cols * p.out_bytes, p.ld_dense_d * p.out_bytes, kNanByte,
                blockIdx.y * int64_t{gridDim.x} + blockIdx.x, int64_t{gridDim.x} * gridDim.y);
  }
}

// grid = (parts, group_count): block (0, g) writes group g's CUTLASS arguments;
// when zeroing, every block of a group with no tokens zeroes a share of its rows.
__global__ void __launch_bounds__(kThreads) grouped_setup_kernel(const SetupParams p) {
  const int local = blockIdx.y;
  const int g = p.group_begin + local;
  const bool malformed = splits_malformed(p.splits, p.num_groups, p.tokens);
  // Well-formed splits keep every group inside the dense operands.
  const int64_t m = malformed ? 0 : p.splits[g];
  const char* matrix = group_matrix(p, g, local);
  const int64_t ld = group_leading_dim(p, local);

  if (blockIdx.x == 0) {
    const int64_t start = malformed ? 0 : block_prefix(p.splits, g);
    if (threadIdx.x == 0) {
      int* shape = p.problem_shapes + 3 * g;
      switch (p.op) {
        case GemmOp::kFprop:  // (m, N) = (m, K) x (N, K)^T
        case GemmOp::kDgrad:  // (m, K) = (m, N) x (N, K)
          shape[0] = static_cast<int>(m);
          shape[1] = static_cast<int>(p.op == GemmOp::kFprop ? p.out_features : p.in_features);
          shape[2] = static_cast<int>(p.op == GemmOp::kFprop ? p.in_features : p.out_features);
          p.ptr_A[g] = p.dense_a + start * p.ld_dense_a * p.in_bytes;
          p.ld_A[g] = p.ld_dense_a;
          p.ptr_B[g] = matrix;
          p.ld_B[g] = ld;
          p.ptr_D[g] = p.dense_d + start * p.ld_dense_d * p.out_bytes;
          p.ld_D[g] = p.ld_dense_d;
          break;
        case GemmOp::kWgrad:
          // A group with no tokens gets an empty M so that the scheduler gives
          // it no tiles: CUTLASS's mainloop would otherwise store
          // uninitialised accumulators for K = 0.
          shape[0] = m > 0 ? static_cast<int>(p.out_features) : 0;
          shape[1] = static_cast<int>(p.in_features);
          shape[2] = static_cast<int>(m);
          p.ptr_A[g] = p.dense_a + start * p.ld_dense_a * p.in_bytes;
          p.ld_A[g] = p.ld_dense_a;
          p.ptr_B[g] = p.dense_b + start * p.ld_dense_b * p.in_bytes;
          p.ld_B[g] = p.ld_dense_b;
          p.ptr_D[g] = const_cast<char*>(matrix);
          p.ld_D[g] = ld;
          break;
      }
    }
  }

  if (malformed) {
    poison_outputs(p, const_cast<char*>(matrix), ld);
  } else if (p.zero_empty_outputs && m == 0) {
    fill_matrix(const_cast<char*>(matrix), p.out_features, p.in_features * p.out_bytes,
                ld * p.out_bytes, kZeroByte, blockIdx.x, gridDim.x);
  }
}

}  // namespace

cudaError_t launch_grouped_setup(const SetupParams& params, cudaStream_t stream) {
  if (params.group_count <= 0) {
    return cudaSuccess;
  }
  // Enough blocks per group that zeroing one large empty group spreads over
  // the GPU, few enough that the early exits of non-empty groups stay cheap.
  int parts = 1;
  if (params.zero_empty_outputs) {
    const int64_t rows = params.out_features;
    const int64_t budget = 4096 / params.group_count;
    parts = static_cast<int>(max(int64_t{1}, min(rows, budget)));
  }
  dim3 grid(parts, params.group_count);
  grouped_setup_kernel<<<grid, kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace groupgrad
