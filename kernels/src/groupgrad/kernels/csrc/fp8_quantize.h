// The (128, 1) + (1, 128) FP8 quantizer of one 16-bit activation, both forms
// from one read (fp8_quantize.cu). The math and layouts are those of
// groupgrad/kernels/_fp8_ops.py (segments_ref, rows_ref), bit for bit.
//
// Legend: T tokens, C channels (a multiple of 128); the rest: fp8_segments.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "fp8_segments.h"

namespace groupgrad {

struct Fp8SegmentsParams {
  const void* x = nullptr;  // (T, C) bf16 or fp16, contiguous, 16-byte aligned
  bool bf16 = true;         // else fp16
  Fp8SegmentsLayout segments;  // the (128, 1) form's experts, T of them
  int64_t channels = 0;        // C
  uint8_t* data = nullptr;    // (C, Tp) e4m3
  float* scales = nullptr;    // (NB, C)
  // The (1, 128) form, or null for the (128, 1) form alone.
  uint8_t* row_data = nullptr;   // (T, C) e4m3
  float* row_scales = nullptr;   // (C / 128, T)
};

cudaError_t launch_fp8_segments(const Fp8SegmentsParams& params, cudaStream_t stream);

}  // namespace groupgrad
