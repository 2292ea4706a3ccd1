// The (128, 1) + (1, 128) FP8 quantizer of one 16-bit activation, both forms
// from one read (fp8_quantize.cu). The math and layouts are those of
// groupgrad/kernels/_fp8_ops.py (segments_ref, rows_ref), bit for bit.
//
// Legend: T tokens, C channels (a multiple of 128), E experts, NB the (128, 1)
// form's block rows (>= ceil(T / 128) + E), Tp its padded tokens (a multiple
// of 16).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace groupgrad {

struct Fp8SegmentsParams {
  const void* x = nullptr;  // (T, C) bf16 or fp16, contiguous, 16-byte aligned
  bool bf16 = true;         // else fp16
  // (E + 1,) int64 running sums (_fp8_ops.offsets_ref): tokens, tokens rounded
  // up to 16, 128-token blocks. Read on the device only.
  const int64_t* row_offsets = nullptr;
  const int64_t* seg_offsets = nullptr;
  const int64_t* block_offsets = nullptr;
  int64_t tokens = 0;         // T
  int64_t channels = 0;       // C
  int64_t experts = 0;        // E
  int64_t num_blocks = 0;     // NB
  int64_t padded_tokens = 0;  // Tp
  uint8_t* data = nullptr;    // (C, Tp) e4m3
  float* scales = nullptr;    // (NB, C)
  // The (1, 128) form, or null for the (128, 1) form alone.
  uint8_t* row_data = nullptr;   // (T, C) e4m3
  float* row_scales = nullptr;   // (C / 128, T)
};

cudaError_t launch_fp8_segments(const Fp8SegmentsParams& params, cudaStream_t stream);

}  // namespace groupgrad
