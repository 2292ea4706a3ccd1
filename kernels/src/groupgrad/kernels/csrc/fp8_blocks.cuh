// The FP8 block math and tile plumbing of the hand-written FP8 kernels
// (fp8_quantize.cu, swiglu_fp8_backward.cu): the scale rule and the e4m3
// conversion, _fp8_ops.py's bit for bit; 16-bit value helpers; cp.async
// staging; where a (128, 1) block row lies; the tail columns' zeroing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "fp8_segments.h"

namespace groupgrad {

constexpr uint32_t kNanBits = 0x7FC00000u;  // torch.nan

struct BlockScale {
  float scale;
  float inverse;
  bool finite;
};

// _fp8_ops.scale_rule of a block whose max |x| has the fp32 bits `amax`.
__device__ __forceinline__ BlockScale scale_rule(uint32_t amax) {
  int exponent = static_cast<int>(amax >> 23) - 8 + ((amax & 0x7FFFFFu) > 0x600000u ? 1 : 0);
  exponent = max(exponent, 1);
  const bool zero = amax == 0;
  BlockScale s;
  s.finite = amax < 0x7F800000u;
  s.scale = !s.finite ? __uint_as_float(kNanBits)
            : zero    ? 1.0f
                      : __uint_as_float(static_cast<uint32_t>(exponent) << 23);
  s.inverse = zero ? 1.0f : __uint_as_float(static_cast<uint32_t>(254 - exponent) << 23);
  return s;
}

// Two e4m3 bytes, `a` in the lower one; round to nearest even, saturating.
__device__ __forceinline__ uint32_t e4m3x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}

// |x| of two 16-bit values at once; their unsigned max ranks NaN above Inf above
// finite values in bf16 and fp16 alike.
__device__ __forceinline__ uint32_t abs2(uint32_t w) { return w & 0x7FFF7FFFu; }

__device__ __forceinline__ uint32_t max2(uint32_t a, uint32_t b) { return __vmaxu2(a, b); }

// The fp32 bits of the non-negative 16-bit value with bits `h`.
template <bool kBf16>
__device__ __forceinline__ uint32_t fp32_bits(uint32_t h) {
  if constexpr (kBf16) {
    return h << 16;
  } else {
    return __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(h))));
  }
}

// The two 16-bit values of `w` (the lower half first) as fp32.
template <bool kBf16>
__device__ __forceinline__ float2 widen(uint32_t w) {
  if constexpr (kBf16) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
  } else {
    __half2 h;
    memcpy(&h, &w, sizeof(h));
    return __half22float2(h);
  }
}

// kBytes (4, 8 or 16) from global to shared memory, asynchronously; zeros if !ok.
template <int kBytes>
__device__ __forceinline__ void copy_async(void* smem, const void* gmem, bool ok) {
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(gmem),
                 "r"(ok ? 16 : 0)
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(address), "l"(gmem),
                 "n"(kBytes), "r"(ok ? kBytes : 0)
                 : "memory");
  }
}

__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Where block row b of a (128, 1) form lies: its expert's first row and rows,
// the expert's first data column and first block row (_fp8_triton._segment's
// rule: the expert is the number of experts whose blocks end at or before b).
// `malformed` (running sums that fall or do not end at T): a stand-in, tokens
// [128 b, 128 b + 128) at the same columns. `past`: b lies past the last
// expert's blocks (then nothing else is set). Every thread of the CTA calls it.
struct BlockRow {
  int64_t row_start;
  int64_t rows;
  int64_t column_start;
  int64_t first_block;
  bool malformed;
  bool past;
};

template <int kThreads>
__device__ __forceinline__ BlockRow find_block_row(const Fp8SegmentsLayout& s, int64_t b) {
  const int64_t* row_offsets = s.row_offsets;
  const int64_t* block_offsets = s.block_offsets;
  const int E = static_cast<int>(s.experts);
  const int64_t T = s.tokens;
  int e = 0;
  int falls = 0;
  for (int first = 0; first < E; first += kThreads) {
    const int k = first + static_cast<int>(threadIdx.x);
    const bool listed = k < E;
    e += __syncthreads_count(listed && block_offsets[k + 1] <= b);
    falls |= __syncthreads_or(listed && row_offsets[k + 1] < row_offsets[k]);
  }
  BlockRow r{b * 128, T - b * 128, b * 128, b, falls || row_offsets[E] != T, false};
  if (!r.malformed) {
    r.past = e >= E;
    if (!r.past) {
      r.row_start = row_offsets[e];
      r.rows = row_offsets[e + 1] - r.row_start;
      r.column_start = s.seg_offsets[e];
      r.first_block = block_offsets[e];
    }
  }
  return r;
}

// A CTA past the last expert's blocks (block row b of NB) zeroes its share of
// the data's tail columns in one (Tp)-long row: 64 columns from `half` (0 or
// 1) on, every (NB - used) * 128 columns, shared with the other such CTAs.
__device__ __forceinline__ void zero_tail_row(uint8_t* row, const Fp8SegmentsLayout& s, int64_t b,
                                              int half) {
  const int E = static_cast<int>(s.experts);
  const int64_t used = s.block_offsets[E];
  const int64_t step = (s.num_blocks - used) * 128;  // >= 128: NB > the used block rows
  const int64_t Tp = s.padded_tokens;
  for (int64_t start = s.seg_offsets[E] + (b - used) * 128 + half * 64; start < Tp; start += step) {
#pragma unroll
    for (int j = 0; j < 64; j += 16) {
      if (start + j < Tp) {
        *reinterpret_cast<uint4*>(row + start + j) = make_uint4(0, 0, 0, 0);
      }
    }
  }
}

}  // namespace groupgrad
