// The FP8 SwiGLU x probs backward in one kernel (swiglu_fp8_backward.cu): the
// math of groupgrad/kernels/_swiglu_fp8.py (backward_ref), its layouts and its
// quantizations (the scale rule of fp8_blocks.cuh), as the Triton kernels of
// _swiglu_fp8_triton.py compute them.
//
// Legend: T tokens, F ffn_hidden_size (a multiple of 128); the rest:
// fp8_segments.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "fp8_segments.h"

namespace groupgrad {

struct Fp8SwigluBackwardParams {
  const void* da = nullptr;  // (T, F) bf16 or fp16, contiguous, 16-byte aligned
  bool bf16 = true;          // else fp16
  const uint8_t* h_data = nullptr;   // (T, 2F) e4m3, h's (1, 128) form, 16-byte aligned
  const float* h_scales = nullptr;   // (2F / 128, T)
  const float* probs = nullptr;      // (T,) fp32, or null
  Fp8SegmentsLayout segments;  // the (128, 1) forms' experts, T of them
  int64_t ffn = 0;             // F
  // The forms asked for; null where not asked.
  uint8_t* dh_data = nullptr;     // (T, 2F) e4m3: dh's (1, 128) form
  float* dh_scales = nullptr;     // (2F / 128, T)
  uint8_t* dht_data = nullptr;    // (2F, Tp) e4m3: dh's (128, 1) form
  float* dht_scales = nullptr;    // (NB, 2F)
  uint8_t* at_data = nullptr;     // (F, Tp) e4m3: a's (128, 1) form
  float* at_scales = nullptr;     // (NB, F)
  float* partial = nullptr;       // (F / 128, T): dprobs' sums per 128 channels (with probs)
};

cudaError_t launch_fp8_swiglu_backward(const Fp8SwigluBackwardParams& params,
                                       cudaStream_t stream);

}  // namespace groupgrad
