// The FP8 block math of the CUDA quantizers (fp8_quantize.cu; the SwiGLU
// backward's spike in benchmarks/swiglu_fp8_spike includes it too): the scale
// rule and the e4m3 conversion, _fp8_ops.py's bit for bit.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

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

}  // namespace groupgrad
