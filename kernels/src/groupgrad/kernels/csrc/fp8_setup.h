// Device-side setup of the FP8 grouped GEMMs (fp8_gemm.cuh) from the token
// counts per expert: CUTLASS's per-group shapes, pointers and strides, the
// per-group scale pointers, and the scale copies the kernels need.
//
// Legend: T tokens, E groups, N out_features, K in_features, m_e = splits[e],
// r_e = sum_{j<e} m_j. All data e4m3, all scales fp32.
//
// Rows form (fprop, dgrad): per group D (m_e, n) = A (m_e, k) x B (n, k)^T
//   fprop: A = x (T, K), B = w_e (N, K), n = N, k = K
//   dgrad: A = dy (T, N), B = w_e^T (K, N) from data_t (E, K, N), n = K, k = N
//   a_scales: the quantizer's (T, k/128) in column-major memory, i.e. (k/128, T)
//     row-major; scale (t, j) covers a[t, 128j:128j+128]. The kernel wants group
//     e's SFA packed M-major, (k/128, m_e) row-major, so the setup copies each
//     group's block to sfa_packed + r_e * k/128 (T * k/128 floats in all).
//   b_scales: the weight scales (E, N/128, K/128), read in place at
//     b_scales + e * N/128 * K/128: [e, i, j] covers rows 128i.. and columns
//     128j.. of w_e (N, K). For fprop (GEMM n-block i, k-block j) that is the
//     packed K-major SFB (i * K/128 + j); for dgrad (GEMM n-block j, k-block i)
//     the packed N-major SFB (j + i * K/128). Hence the per-op SFB majorness
//     in groupgrad/kernels/build.py (_FP8_OPS).
//   d: (T, n) bf16 or fp16 row-major, group e's rows r_e.. (overwritten).
//
// Segments form (wgrad): per group dW_e (N, K) = dy_e^T (N, m_e) x x_e (m_e, K)
//   a = dy (N, Tp), b = x (K, Tp), token-contiguous: group e's tokens are
//   columns [c_e, c_e + m_e), c_e = sum_{j<e} round_up(m_j, 16) (Tp padded);
//   a_scales (NB, N), b_scales (NB, K) row-major: group e's 128-token blocks
//   are rows [s_e, s_e + ceil(m_e / 128)), s_e = sum_{j<e} ceil(m_j / 128).
//   Per group these are the packed M-major SFA (channel + block * N) and
//   N-major SFB of granularity (1, 1, 128): read in place.
//   Outputs: packed (one (E, N, K) tensor addressed by stride) or listed (E
//   matrices whose pointers travel by value in the kernel parameters, up to
//   kMaxGroupsPerLaunch per launch, so nothing waits for the host).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "grouped_setup.h"  // kMaxGroupsPerLaunch

namespace groupgrad {

enum class Fp8Form : int { kRows = 0, kSegments = 1 };

struct Fp8SetupParams {
  Fp8Form form = Fp8Form::kRows;
  const int64_t* splits = nullptr;  // (E,) on the device; never read by the host
  int num_groups = 0;               // E, the length of splits (set by launch_fp8_setup)
  int64_t tokens = 0;               // T
  // Rows form extents (see above).
  int64_t n = 0;
  int64_t k = 0;
  // Segments form extents.
  int64_t out_features = 0;   // N
  int64_t in_features = 0;    // K
  int64_t padded_tokens = 0;  // Tp
  int64_t scale_rows = 0;     // NB
  // Operands (see above for each form).
  const uint8_t* a = nullptr;
  const float* a_scales = nullptr;
  const uint8_t* b = nullptr;
  const float* b_scales = nullptr;
  // Segments form: the operands' own running token counts, (E + 1,) int64 on
  // the device (the quantizer's row offsets); splits must agree with both.
  const int64_t* a_row_offsets = nullptr;
  const int64_t* b_row_offsets = nullptr;
  char* d = nullptr;       // rows form output
  int out_bytes = 2;       // element size of D
  float* sfa_packed = nullptr;  // rows form: T * k/128 floats of workspace
  // Segments form outputs: packed_base (group g at packed_base + g *
  // packed_stride_bytes, rows packed_ld apart) or, when null, this chunk's
  // group_ptr / group_ld (filled by launch_fp8_setup).
  int group_begin = 0;
  int group_count = 0;
  const char* packed_base = nullptr;
  int64_t packed_stride_bytes = 0;
  int64_t packed_ld = 0;
  const char* group_ptr[kMaxGroupsPerLaunch] = {};
  int64_t group_ld[kMaxGroupsPerLaunch] = {};
  // Segments form, overwrite: zero the outputs of groups with no tokens (the
  // GEMM gives them no tiles).
  bool zero_empty_outputs = false;
  // CUTLASS argument arrays (device), indexed by the global group index.
  int* problem_shapes = nullptr;  // (E, 3) int32: M, N, K
  const void** ptr_A = nullptr;
  int64_t* ld_A = nullptr;
  const void** ptr_B = nullptr;
  int64_t* ld_B = nullptr;
  const float** ptr_SFA = nullptr;
  const float** ptr_SFB = nullptr;
  void** ptr_D = nullptr;
  int64_t* ld_D = nullptr;
};

// Enqueues the setup of `groups` groups on `stream`, kMaxGroupsPerLaunch per
// launch. Listed outputs (segments form with packed_base null): host arrays
// of `groups` pointers and row strides, copied by value into the launches.
cudaError_t launch_fp8_setup(Fp8SetupParams params, int groups, const char* const* listed_ptr,
                             const int64_t* listed_ld, cudaStream_t stream);

}  // namespace groupgrad
