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

// The (128, 1) forms' three running sums of E token counts, _fp8_ops.offsets_ref's bit for
// bit: rows, the counts rounded up to `align` (seg) and their 128-token blocks, each (E + 1,)
// int64 starting at 0, Python's floor division included (a malformed, negative count gives
// the reference's sums). One CTA, whatever E.

struct Fp8OffsetsParams {
  const void* sizes = nullptr;  // (E,) int32 or int64
  bool sizes64 = true;
  int64_t experts = 0;
  int64_t align = 16;
  int64_t* row = nullptr;  // (E + 1,) each
  int64_t* seg = nullptr;
  int64_t* block = nullptr;
};

cudaError_t launch_fp8_offsets(const Fp8OffsetsParams& params, cudaStream_t stream);

}  // namespace groupgrad
