// Builds CUTLASS's per-group problem shapes, pointers and strides on the
// device from splits (see grouped_setup.h), and zeroes the wgrad outputs of
// empty groups when overwriting.
#include "grouped_setup.h"

namespace groupgrad {
namespace {

constexpr int kThreads = 128;

// Sum of splits[0:count) over the block; every thread gets the result.
__device__ int64_t block_prefix(const int64_t* splits, int count) {
  __shared__ int64_t warp_sums[kThreads / 32];
  int64_t sum = 0;
  for (int i = threadIdx.x; i < count; i += kThreads) {
    sum += max(splits[i], int64_t{0});
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    sum += __shfl_down_sync(0xffffffffu, sum, offset);
  }
  if (threadIdx.x % 32 == 0) {
    warp_sums[threadIdx.x / 32] = sum;
  }
  __syncthreads();
  int64_t total = 0;
  for (int w = 0; w < kThreads / 32; ++w) {
    total += warp_sums[w];
  }
  return total;
}

// Zeroes a rows x cols row-major matrix with leading dimension ld (bytes are
// 16-byte aligned: cols * elem_bytes and ld * elem_bytes are multiples of 16).
__device__ void zero_matrix(char* base, int64_t rows, int64_t row_bytes, int64_t ld_bytes,
                            int64_t part, int64_t parts) {
  const int64_t vecs_per_row = row_bytes / 16;
  const int4 zero = make_int4(0, 0, 0, 0);
  for (int64_t r = part; r < rows; r += parts) {
    int4* row = reinterpret_cast<int4*>(base + r * ld_bytes);
    for (int64_t v = threadIdx.x; v < vecs_per_row; v += kThreads) {
      row[v] = zero;
    }
  }
}

// How many groups of each kind there are, and before group g: heavy (at least
// light_below tokens), light (fewer, but some) and empty. Every thread gets the result.
struct GroupKinds {
  int heavy = 0, light = 0, heavy_before = 0, light_before = 0, empty_before = 0;
};

__device__ GroupKinds count_kinds(const SetupParams& p, int g) {
  __shared__ int warp_sums[5][kThreads / 32];
  int counts[5] = {0, 0, 0, 0, 0};
  for (int e = threadIdx.x; e < p.experts; e += kThreads) {
    const int64_t t = max(p.splits[e], int64_t{0});
    const bool heavy = t > 0 && t >= p.light_below;
    const bool light = t > 0 && !heavy;
    counts[0] += heavy;
    counts[1] += light;
    counts[2] += heavy && e < g;
    counts[3] += light && e < g;
    counts[4] += t == 0 && e < g;
  }
  for (int c = 0; c < 5; ++c) {
    for (int offset = 16; offset > 0; offset /= 2) {
      counts[c] += __shfl_down_sync(0xffffffffu, counts[c], offset);
    }
    if (threadIdx.x % 32 == 0) {
      warp_sums[c][threadIdx.x / 32] = counts[c];
    }
  }
  __syncthreads();
  int total[5] = {0, 0, 0, 0, 0};
  for (int c = 0; c < 5; ++c) {
    for (int w = 0; w < kThreads / 32; ++w) {
      total[c] += warp_sums[c][w];
    }
  }
  return GroupKinds{total[0], total[1], total[2], total[3], total[4]};
}

// Where chunk j of group g goes in the problem arrays. The heavy groups'
// problems (nH of them, in group order) and the light groups' (nL) are merged
// as if the i-th heavy problem sat at (2i + 1) / (2 nH) of the list and the k-th
// light one at (2k + 1) / (2 nL), heavy first on a tie: each kind spread evenly
// through the other, so that the persistent scheduler hands every SM a mix of
// FLOP-bound tiles and tiles that mostly read and write their output. Empty
// groups' problems (no tiles) come last.
__device__ int64_t problem_slot(const GroupKinds& kinds, int64_t tokens, bool heavy, int chunks,
                                int j) {
  const int64_t nH = int64_t{kinds.heavy} * chunks;
  const int64_t nL = int64_t{kinds.light} * chunks;
  if (tokens == 0) {
    return nH + nL + int64_t{kinds.empty_before} * chunks + j;
  }
  if (heavy) {
    const int64_t i = int64_t{kinds.heavy_before} * chunks + j;
    const int64_t num = (2 * i + 1) * nL - nH;  // light k before it: (2k + 1) nH < (2i + 1) nL
    return i + (num <= 0 ? 0 : min(nL, (num + 2 * nH - 1) / (2 * nH)));
  }
  const int64_t k = int64_t{kinds.light_before} * chunks + j;
  const int64_t num = (2 * k + 1) * nH - nL;  // heavy i before it: (2i + 1) nL <= (2k + 1) nH
  return k + (num < 0 ? 0 : min(nH, num / (2 * nL) + 1));
}

// wgrad with chunks or light groups: writes group g's problems at their slots.
__device__ void write_wgrad_problems(const SetupParams& p, int g, int64_t start, int64_t m,
                                     const char* matrix, int64_t ld) {
  const GroupKinds kinds = count_kinds(p, g);
  const int64_t tokens = max(p.splits[g], int64_t{0});
  const bool heavy = tokens > 0 && tokens >= p.light_below;
  const int64_t chunk_rows = p.chunks > 1 ? p.chunk_rows : p.out_features;
  for (int j = threadIdx.x; j < p.chunks; j += kThreads) {
    const int64_t slot = problem_slot(kinds, tokens, heavy, p.chunks, j);
    const int64_t first_row = j * chunk_rows;
    const int64_t rows = min(chunk_rows, p.out_features - first_row);
    int* shape = p.problem_shapes + 3 * slot;
    shape[0] = m > 0 ? static_cast<int>(rows) : 0;  // no tokens: no tiles (see below)
    shape[1] = static_cast<int>(p.in_features);
    shape[2] = static_cast<int>(m);
    // A is dy's rows of this group, read column-major: its first_row-th row is
    // dy's first_row-th column.
    p.ptr_A[slot] = p.dense_a + (start * p.ld_dense_a + first_row) * p.in_bytes;
    p.ld_A[slot] = p.ld_dense_a;
    p.ptr_B[slot] = p.dense_b + start * p.ld_dense_b * p.in_bytes;
    p.ld_B[slot] = p.ld_dense_b;
    p.ptr_D[slot] = const_cast<char*>(matrix) + first_row * ld * p.out_bytes;
    p.ld_D[slot] = ld;
  }
}

__device__ const char* group_matrix(const SetupParams& p, int g, int local) {
  return p.packed_base != nullptr ? p.packed_base + g * p.packed_stride_bytes : p.group_ptr[local];
}

__device__ int64_t group_leading_dim(const SetupParams& p, int local) {
  return p.packed_base != nullptr ? p.packed_ld : p.group_ld[local];
}

// grid = (parts, group_count): block (0, g) writes group g's CUTLASS arguments;
// when zeroing, every block of a group with no tokens zeroes a share of its rows.
__global__ void __launch_bounds__(kThreads) grouped_setup_kernel(const SetupParams p) {
  const int local = blockIdx.y;
  const int g = p.group_begin + local;
  // Clamp so that malformed device splits (negative, or summing past T) can
  // never address memory outside the dense operands.
  const int64_t rows = max(p.splits[g], int64_t{0});
  const char* matrix = group_matrix(p, g, local);
  const int64_t ld = group_leading_dim(p, local);

  if (blockIdx.x == 0) {
    const int64_t start = min(block_prefix(p.splits, g), p.tokens);
    const int64_t m = min(rows, p.tokens - start);
    if (p.op == GemmOp::kWgrad && (p.chunks > 1 || p.light_below > 0)) {
      write_wgrad_problems(p, g, start, m, matrix, ld);
    } else if (threadIdx.x == 0) {
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

  if (p.zero_empty_outputs && rows == 0) {
    zero_matrix(const_cast<char*>(matrix), p.out_features, p.in_features * p.out_bytes,
                ld * p.out_bytes, blockIdx.x, gridDim.x);
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
