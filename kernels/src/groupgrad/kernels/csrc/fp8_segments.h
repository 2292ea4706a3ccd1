// Where the experts of a (128, 1) FP8 form lie, as the hand-written kernels
// that write such forms read it (fp8_quantize.h, swiglu_fp8_backward.h; the
// layout: groupgrad/kernels/_fp8_ops.py, offsets_ref).
//
// Legend: T tokens, E experts, NB the form's block rows (>= ceil(T / 128) + E),
// Tp its padded tokens (a multiple of 16).
#pragma once

#include <cstdint>

namespace groupgrad {

struct Fp8SegmentsLayout {
  // (E + 1,) int64 running sums: tokens, tokens rounded up to 16, 128-token
  // blocks. Read on the device only.
  const int64_t* row_offsets = nullptr;
  const int64_t* seg_offsets = nullptr;
  const int64_t* block_offsets = nullptr;
  int64_t tokens = 0;         // T
  int64_t experts = 0;        // E
  int64_t num_blocks = 0;     // NB
  int64_t padded_tokens = 0;  // Tp
};

}  // namespace groupgrad
