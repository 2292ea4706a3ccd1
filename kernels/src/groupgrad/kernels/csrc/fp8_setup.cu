// Builds the FP8 grouped GEMMs' per-group arguments on the device from splits
// (see fp8_setup.h): packs the rows form's token scales per group, and zeroes
// the wgrad outputs of empty groups when overwriting. Malformed splits
// (setup_common.cuh) give every group M = 0 and NaN outputs.
#include "fp8_setup.h"
#include "setup_common.cuh"

#include <algorithm>

namespace groupgrad {
namespace {

constexpr int kThreads = kSetupThreads;
constexpr int64_t kScaleBlock = 128;  // channels (rows form) or tokens (segments) per scale

// Where a group starts in each of the operands' token axes.
struct GroupStart {
  int64_t token = 0;      // rows: r_e
  int64_t column = 0;     // segments: c_e (16-aligned)
  int64_t scale_row = 0;  // segments: s_e
};

__device__ int64_t round_up_16(int64_t v) { return (v + 15) / 16 * 16; }
__device__ int64_t scale_blocks(int64_t v) { return (v + kScaleBlock - 1) / kScaleBlock; }

// The three prefix sums of splits[0:group) over the block; every thread gets them.
__device__ GroupStart block_group_start(const int64_t* splits, int group) {
  int64_t sums[3] = {0, 0, 0};  // tokens, columns, scale rows
  for (int i = threadIdx.x; i < group; i += kThreads) {
    const int64_t t = splits[i];
    sums[0] += t;
    sums[1] += round_up_16(t);
    sums[2] += scale_blocks(t);
  }
  block_sums(sums);
  return GroupStart{sums[0], sums[1], sums[2]};
}

__device__ void write_arguments(const Fp8SetupParams& p, int g, int m, int n, int k,
                                const void* a, int64_t ld_a, const void* b, int64_t ld_b,
                                const float* sfa, const float* sfb, void* d, int64_t ld_d) {
  int* shape = p.problem_shapes + 3 * g;
  shape[0] = m;
  shape[1] = n;
  shape[2] = k;
  p.ptr_A[g] = a;
  p.ld_A[g] = ld_a;
  p.ptr_B[g] = b;
  p.ld_B[g] = ld_b;
  p.ptr_SFA[g] = sfa;
  p.ptr_SFB[g] = sfb;
  p.ptr_D[g] = d;
  p.ld_D[g] = ld_d;
}

// Rows form, group g: its arguments (block 0) and its share of the SFA copy
// (every block): the (k/128, T) scales' columns r_e.. become a packed
// (k/128, m_e) matrix at sfa_packed + r_e * k/128. Malformed splits: M = 0,
// and the first launch's blocks fill D with NaN.
__device__ void setup_rows(const Fp8SetupParams& p, int g, bool malformed) {
  const int64_t start = malformed ? 0 : block_group_start(p.splits, g).token;
  const int64_t m = malformed ? 0 : p.splits[g];
  const int64_t k_blocks = p.k / kScaleBlock;
  float* sfa = p.sfa_packed + start * k_blocks;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const int64_t b_matrix = p.n * p.k;  // e4m3: one byte each
    const int64_t b_scale_matrix = (p.n / kScaleBlock) * k_blocks;
    // An empty group gets M = 0: the scheduler gives it no tiles.
    write_arguments(p, g, static_cast<int>(m), static_cast<int>(p.n), static_cast<int>(p.k),
                    p.a + start * p.k, p.k, p.b + g * b_matrix, p.k, sfa,
                    p.b_scales + g * b_scale_matrix, p.d + start * p.n * p.out_bytes, p.n);
  }
  if (malformed && p.group_begin == 0) {
    fill_matrix(p.d, p.tokens, p.n * p.out_bytes, p.n * p.out_bytes, kNanByte,
                blockIdx.y * int64_t{gridDim.x} + blockIdx.x, int64_t{gridDim.x} * gridDim.y);
  }
  const int64_t count = m * k_blocks;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * kThreads) {
    const int64_t block = i / m;
    const int64_t token = i - block * m;
    sfa[i] = p.a_scales[block * p.tokens + start + token];
  }
}

// Segments form: whether the operands cannot hold these (well-formed)
// splits — their own running counts (quantized with other splits: their
// 128-token blocks straddle these experts) differ, or the counts need more
// padded columns or scale rows than the operands have. Every thread of the
// block gets the answer.
__device__ bool segments_mismatch(const Fp8SetupParams& p) {
  int64_t sums[3] = {0, 0, 0};  // counts that differ, padded columns, scale rows
  for (int i = threadIdx.x; i <= p.num_groups; i += kThreads) {
    const int64_t count = i < p.num_groups ? p.splits[i] : 0;
    const int64_t a_start = p.a_row_offsets[i];
    const int64_t b_start = p.b_row_offsets[i];
    if (i == 0) {
      sums[0] += (a_start != 0) + (b_start != 0);
    }
    if (i < p.num_groups) {
      sums[0] += (p.a_row_offsets[i + 1] - a_start != count) +
                 (p.b_row_offsets[i + 1] - b_start != count);
      sums[1] += round_up_16(count);
      sums[2] += scale_blocks(count);
    }
  }
  block_sums(sums);
  return sums[0] > 0 || sums[1] > p.padded_tokens || sums[2] > p.scale_rows;
}

// Segments form, group g (local index `local` in this launch's chunk).
// Malformed splits, or operands that do not fit them: M = 0 and a NaN output.
__device__ void setup_segments(const Fp8SetupParams& p, int g, int local, bool malformed) {
  // Past the checks every group lies inside the padded columns and the scale rows.
  const GroupStart start = malformed ? GroupStart{} : block_group_start(p.splits, g);
  const int64_t m = malformed ? 0 : p.splits[g];
  const bool packed = p.packed_base != nullptr;
  char* out = const_cast<char*>(packed ? p.packed_base + g * p.packed_stride_bytes
                                       : p.group_ptr[local]);
  const int64_t ld = packed ? p.packed_ld : p.group_ld[local];
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    // A group with no tokens gets M = 0 so the scheduler gives it no tiles:
    // with K = 0 the mainloop would store uninitialised accumulators.
    write_arguments(p, g, m > 0 ? static_cast<int>(p.out_features) : 0,
                    static_cast<int>(p.in_features), static_cast<int>(m), p.a + start.column,
                    p.padded_tokens, p.b + start.column, p.padded_tokens,
                    p.a_scales + start.scale_row * p.out_features,
                    p.b_scales + start.scale_row * p.in_features, out, ld);
  }
  if (malformed || (p.zero_empty_outputs && m == 0)) {
    fill_matrix(out, p.out_features, p.in_features * p.out_bytes, ld * p.out_bytes,
                malformed ? kNanByte : kZeroByte, blockIdx.x, gridDim.x);
  }
}

// grid = (parts, group_count): the blocks of group g = group_begin + blockIdx.y
// share its copy (rows form) or its zeroing (segments form); block 0 writes
// its CUTLASS arguments.
__global__ void __launch_bounds__(kThreads) fp8_setup_kernel(const Fp8SetupParams p) {
  const int local = blockIdx.y;
  const int g = p.group_begin + local;
  const bool malformed = splits_malformed(p.splits, p.num_groups, p.tokens);
  if (p.form == Fp8Form::kRows) {
    setup_rows(p, g, malformed);
  } else {
    setup_segments(p, g, local, malformed || segments_mismatch(p));
  }
}

// Blocks per group: enough that one large group's copy or zeroing spreads over
// the GPU, few enough that the early exits of the other groups stay cheap.
int blocks_per_group(const Fp8SetupParams& p) {
  const int64_t budget = std::max<int64_t>(1, 4096 / p.group_count);
  int64_t work = 1;
  if (p.form == Fp8Form::kRows) {
    const int64_t elements = p.tokens * (p.k / kScaleBlock);
    work = (elements + p.group_count * int64_t{kThreads} * 4 - 1) /
           (p.group_count * int64_t{kThreads} * 4);
  } else if (p.zero_empty_outputs) {
    work = p.out_features;
  }
  return static_cast<int>(std::max<int64_t>(1, std::min(work, budget)));
}

}  // namespace

cudaError_t launch_fp8_setup(Fp8SetupParams params, int groups, const char* const* listed_ptr,
                             const int64_t* listed_ld, cudaStream_t stream) {
  const bool listed = params.form == Fp8Form::kSegments && params.packed_base == nullptr;
  params.num_groups = groups;
  for (int begin = 0; begin < groups; begin += kMaxGroupsPerLaunch) {
    params.group_begin = begin;
    params.group_count = std::min(kMaxGroupsPerLaunch, groups - begin);
    for (int i = 0; listed && i < params.group_count; ++i) {
      params.group_ptr[i] = listed_ptr[begin + i];
      params.group_ld[i] = listed_ld[begin + i];
    }
    const dim3 grid(blocks_per_group(params), params.group_count);
    fp8_setup_kernel<<<grid, kThreads, 0, stream>>>(params);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
      return err;
    }
  }
  return cudaSuccess;
}

}  // namespace groupgrad
