// The FP8 SwiGLU x probs backward in one kernel (interface and layouts:
// swiglu_fp8_backward.h). It reads da and h's (1, 128) form once and writes
// every asked form: dh's (1, 128) form (fc1's dgrad), dh's and a's (128, 1)
// forms (the wgrads of fc1 and fc2) and dprobs' partial sums. Triton's two
// kernels each recompute the SwiGLU; this one is 1.50-1.61x as fast on the
// H200 (DEVICE_RUNS 145-146; kernels/NOTES.md, session 18, says how).
//
// A CTA of 512 threads owns 128 tokens x 128 channels of `a`: block row b of
// the (128, 1) forms (128 tokens of one expert, found as the quantizer finds
// them: fp8_blocks.cuh) and channel block j. The inputs arrive in shared
// memory by cp.async. Thread (tg, cg) = (tid / 16, tid % 16) computes tokens
// 4 tg .. 4 tg + 3 x channels 8 cg .. 8 cg + 7 once, keeps the rounded dg, du
// and a packed two to a register (48 registers), and takes their maxima on
// the 16-bit |x| bits (as the quantizer does):
// * a token's max over its 128 channels: in-thread, then the 16 lanes of its
//   half-warp;
// * a channel's max over the 128 tokens: in-thread, the other half-warp, then
//   one thread per (form, channel) over the 16 warps' maxima in shared memory.
// Then it quantizes from the registers: each token's 8 channels of dh as 8
// adjacent bytes of the (1, 128) form; each channel's 4 tokens gathered into
// a word by byte permutes, turned round through (XOR-swizzled) shared memory
// and stored as whole 128-byte rows of the (128, 1) forms.
//
// CTAs past the last expert's blocks zero their scale rows and, between them,
// the data's tail columns. Malformed splits: the quantizer's stand-in (NaN
// (128, 1) scales, unspecified (128, 1) data; dh's (1, 128) form and dprobs
// exact, each token still covered once).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "fp8_blocks.cuh"
#include "swiglu_fp8_backward.h"

namespace groupgrad {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kTokens = 4;  // per thread
// Shared memory: da [128][256 B] at 0, g [128][128 B] at kG, u at kU (the
// three turned-round (128, 1) tiles reuse [0, 48 KB) once pass 1 is over);
// then g's, u's scales and probs [128] each, the rows' inverses [128][2], the
// channel maxima [warp][form][cg][4 words] and the channels' inverses [form][128].
constexpr int kG = 32768;
constexpr int kU = 49152;
constexpr int kInfo = 65536;
constexpr int kChannelMax = kInfo + (3 * 128 + 256) * 4;
constexpr int kChannelInverse = kChannelMax + kWarps * 3 * 16 * 4 * 4;
constexpr int kSmemBytes = kChannelInverse + 3 * 128 * 4;

// inverse < 0 marks a block that is not finite: its bytes are zero (and its scale NaN).
__device__ __forceinline__ float scaled(float x, float inverse) {
  return inverse > 0.0f ? x * inverse : 0.0f;
}

__device__ __forceinline__ float marked(const BlockScale& s) {
  return s.finite ? s.inverse : -1.0f;
}

// Two floats rounded to the dtype, packed (the first in the lower half).
template <bool kBf16>
__device__ __forceinline__ uint32_t pack(float a, float b) {
  uint32_t w;
  if constexpr (kBf16) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    memcpy(&w, &h, sizeof(w));
  } else {
    const __half2 h = __floats2half2_rn(a, b);
    memcpy(&w, &h, sizeof(w));
  }
  return w;
}

__device__ __forceinline__ uint32_t max_half(uint32_t w) { return max(w & 0xFFFFu, w >> 16); }

// 8 e4m3 bytes times `scale`, rounded to the dtype (the reference's dequantized h).
template <bool kBf16>
__device__ __forceinline__ void dequantize8(uint2 q, float scale, float (&out)[8]) {
  const uint32_t words[2] = {q.x, q.y};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const auto pair = static_cast<__nv_fp8x2_storage_t>(words[k / 2] >> (16 * (k % 2)));
    const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
    __half2 h;
    memcpy(&h, &raw, sizeof(h));
    const float2 f = __half22float2(h);
    const float2 r = widen<kBf16>(pack<kBf16>(f.x * scale, f.y * scale));
    out[2 * k] = r.x;
    out[2 * k + 1] = r.y;
  }
}

// One token's 8 channels: dg, du and a rounded to the dtype, packed into r[0],
// r[1], r[2] (_swiglu_fp8_triton._swiglu_grads' expressions); returns the sum
// of da * a before probs (dprobs' share).
template <bool kBf16, bool kProbs>
__device__ __forceinline__ float grads(const uint8_t* smem, int token, int cg,
                                       uint32_t (&r)[3][4]) {
  const float* info = reinterpret_cast<const float*>(smem + kInfo);
  float g[8], u[8];
  dequantize8<kBf16>(*reinterpret_cast<const uint2*>(smem + kG + token * 128 + cg * 8),
                     info[token], g);
  dequantize8<kBf16>(*reinterpret_cast<const uint2*>(smem + kU + token * 128 + cg * 8),
                     info[128 + token], u);
  const uint4 w = *reinterpret_cast<const uint4*>(smem + token * 256 + cg * 16);
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  const float p = kProbs ? info[256 + token] : 1.0f;
  float part = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 da = widen<kBf16>(words[k]);
    float dg[2], du[2], act[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = 2 * k + h;
      const float sig = __fdividef(1.0f, 1.0f + __expf(-g[c]));  // Triton's sigmoid
      const float silu = g[c] * sig;
      act[h] = silu * u[c];
      float d = h ? da.y : da.x;
      if constexpr (kProbs) {
        part += d * act[h];
        act[h] = act[h] * p;
        d = d * p;
      }
      dg[h] = d * u[c] * sig * (1.0f + g[c] * (1.0f - sig));
      du[h] = d * silu;
    }
    r[0][k] = pack<kBf16>(dg[0], dg[1]);
    r[1][k] = pack<kBf16>(du[0], du[1]);
    r[2][k] = pack<kBf16>(act[0], act[1]);
  }
  return part;
}

// A block row past the last expert's blocks: zero (128, 1) scales and its
// share of the (128, 1) data's tail columns.
__device__ void zero_tail(const Fp8SwigluBackwardParams& p, int64_t b, int tid) {
  const int64_t j = blockIdx.y, F = p.ffn;
  if (tid < 48) {  // 3 forms x 16 x 8 scales
    const int form = tid / 16, cg = tid % 16;
    float* scales = form < 2 ? p.dht_scales : p.at_scales;
    if (scales != nullptr) {
      const int64_t width = form < 2 ? 2 * F : F;
      const int64_t column = (form == 1 ? F : 0) + j * 128 + cg * 8;
      float4* s = reinterpret_cast<float4*>(scales + b * width + column);
      s[0] = make_float4(0.f, 0.f, 0.f, 0.f);
      s[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  // threads 0-255: dh's rows of g then a's; threads 256-511: dh's rows of u; 2 threads a row
  const int64_t channel = j * 128 + (tid % 256) / 2;
  const int64_t Tp = p.segments.padded_tokens;
  if (p.dht_data != nullptr) {
    zero_tail_row(p.dht_data + ((tid < 256 ? 0 : F) + channel) * Tp, p.segments, b, tid % 2);
  }
  if (p.at_data != nullptr && tid < 256) {
    zero_tail_row(p.at_data + channel * Tp, p.segments, b, tid % 2);
  }
}

template <bool kBf16, bool kProbs>
__global__ void __launch_bounds__(kThreads, 1) swiglu_fp8_backward_kernel(
    const Fp8SwigluBackwardParams p) {
  extern __shared__ __align__(16) uint8_t smem[];
  float* info = reinterpret_cast<float*>(smem + kInfo);
  float* row_inverse = info + 384;  // [token][dg, du]
  uint32_t* channel_max = reinterpret_cast<uint32_t*>(smem + kChannelMax);
  float* channel_inverse = reinterpret_cast<float*>(smem + kChannelInverse);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int cg = tid % 16, tg = tid / 16;
  const int64_t b = blockIdx.x, j = blockIdx.y;
  const int64_t T = p.segments.tokens, F = p.ffn;

  const BlockRow r = find_block_row<kThreads>(p.segments, b);
  if (r.past) {
    if (p.dht_data != nullptr || p.at_data != nullptr) zero_tail(p, b, tid);
    return;
  }
  const int64_t first = (b - r.first_block) * 128;  // the block's first token in the segment
  const int64_t local = first + tg * kTokens;        // the thread's first token

  const auto* da = static_cast<const uint16_t*>(p.da);
#pragma unroll
  for (int i = 0; i < kTokens; ++i) {
    const int token = tg * kTokens + i;
    const bool ok = local + i < r.rows;
    const int64_t row = ok ? r.row_start + local + i : 0;
    const uint8_t* h = p.h_data + row * 2 * F + j * 128 + cg * 8;
    copy_async<16>(smem + token * 256 + cg * 16, da + row * F + j * 128 + cg * 8, ok);
    copy_async<8>(smem + kG + token * 128 + cg * 8, h, ok);
    copy_async<8>(smem + kU + token * 128 + cg * 8, h + F, ok);
  }
  if (tid < (kProbs ? 384 : 256)) {  // g's scales, u's scales, probs
    const int token = tid % 128;
    const bool ok = first + token < r.rows;
    const int64_t row = ok ? r.row_start + first + token : 0;
    const float* source = tid < 128 ? p.h_scales + j * T
                          : tid < 256 ? p.h_scales + (F / 128 + j) * T
                                      : p.probs;
    copy_async<4>(info + tid, source + row, ok);
  }
  wait_copies();
  __syncthreads();

  // Pass 1: the three values of 4 tokens x 8 channels, kept packed, and their maxima.
  uint32_t v[kTokens][3][4];
  uint32_t cmax[3][4] = {};
  uint32_t rmax[2][kTokens];
  float part[kTokens];
#pragma unroll
  for (int i = 0; i < kTokens; ++i) {
    part[i] = grads<kBf16, kProbs>(smem, tg * kTokens + i, cg, v[i]);
    uint32_t m[2] = {0, 0};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
      for (int t = 0; t < 3; ++t) cmax[t][k] = max2(cmax[t][k], abs2(v[i][t][k]));
      m[0] = max2(m[0], abs2(v[i][0][k]));
      m[1] = max2(m[1], abs2(v[i][1][k]));
    }
    rmax[0][i] = max_half(m[0]);
    rmax[1][i] = max_half(m[1]);
  }
#pragma unroll
  for (int lanes = 1; lanes < 16; lanes *= 2) {
#pragma unroll
    for (int i = 0; i < kTokens; ++i) {
      rmax[0][i] = max(rmax[0][i], __shfl_xor_sync(0xFFFFFFFFu, rmax[0][i], lanes));
      rmax[1][i] = max(rmax[1][i], __shfl_xor_sync(0xFFFFFFFFu, rmax[1][i], lanes));
      if constexpr (kProbs) part[i] += __shfl_xor_sync(0xFFFFFFFFu, part[i], lanes);
    }
  }
#pragma unroll
  for (int t = 0; t < 3; ++t) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      cmax[t][k] = max2(cmax[t][k], __shfl_xor_sync(0xFFFFFFFFu, cmax[t][k], 16));
    }
  }
  if (lane < 16) {
#pragma unroll
    for (int t = 0; t < 3; ++t) {
      *reinterpret_cast<uint4*>(channel_max + ((warp * 3 + t) * 16 + cg) * 4) =
          make_uint4(cmax[t][0], cmax[t][1], cmax[t][2], cmax[t][3]);
    }
  }
  // Each token's dh scales and dprobs share, from lane cg == i of its half-warp.
#pragma unroll
  for (int i = 0; i < kTokens; ++i) {
    if (cg == i) {
      const int token = tg * kTokens + i;
      const BlockScale sg = scale_rule(fp32_bits<kBf16>(rmax[0][i]));
      const BlockScale su = scale_rule(fp32_bits<kBf16>(rmax[1][i]));
      row_inverse[token * 2] = marked(sg);
      row_inverse[token * 2 + 1] = marked(su);
      if (local + i < r.rows) {
        const int64_t row = r.row_start + local + i;
        if (p.dh_data != nullptr) {
          p.dh_scales[j * T + row] = sg.scale;
          p.dh_scales[(F / 128 + j) * T + row] = su.scale;
        }
        if constexpr (kProbs) p.partial[j * T + row] = part[i];
      }
    }
  }
  __syncthreads();
  // Each channel's (128, 1) scale: one thread per (form, channel) over the 16 warps' maxima.
  if (tid < 384) {
    const int t = tid / 128, channel = tid % 128;
    const int word = (channel % 8) / 2, shift = 16 * (channel % 2);
    uint32_t m = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      m = max(m, (channel_max[((w * 3 + t) * 16 + channel / 8) * 4 + word] >> shift) & 0xFFFFu);
    }
    const BlockScale s = scale_rule(fp32_bits<kBf16>(m));
    channel_inverse[t * 128 + channel] = marked(s);
    float* scales = t < 2 ? p.dht_scales : p.at_scales;
    if (scales != nullptr) {
      const int64_t width = t < 2 ? 2 * F : F;
      scales[b * width + (t == 1 ? F : 0) + j * 128 + channel] =
          r.malformed ? __uint_as_float(kNanBits) : s.scale;
    }
  }
  __syncthreads();

  // Pass 2: dh's (1, 128) bytes per token, straight to global memory.
  if (p.dh_data != nullptr) {
#pragma unroll
    for (int i = 0; i < kTokens; ++i) {
      if (local + i < r.rows) {
        const int token = tg * kTokens + i;
        const float ig = row_inverse[token * 2], iu = row_inverse[token * 2 + 1];
        uint32_t q[4], w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float2 a = widen<kBf16>(v[i][0][k]), c = widen<kBf16>(v[i][1][k]);
          q[k] = e4m3x2(scaled(a.x, ig), scaled(a.y, ig));
          w[k] = e4m3x2(scaled(c.x, iu), scaled(c.y, iu));
        }
        uint8_t* out = p.dh_data + (r.row_start + local + i) * 2 * F + j * 128 + cg * 8;
        *reinterpret_cast<uint2*>(out) = make_uint2(q[0] | q[1] << 16, q[2] | q[3] << 16);
        *reinterpret_cast<uint2*>(out + F) = make_uint2(w[0] | w[1] << 16, w[2] | w[3] << 16);
      }
    }
  }
  if (p.dht_data == nullptr && p.at_data == nullptr) return;
  // The (128, 1) bytes: channels 2k, 2k + 1 of the 4 tokens, byte-permuted into
  // a word of 4 tokens per channel, then through shared memory (pieces of 16
  // tokens XOR-swizzled by channel group) out as whole 128-byte rows.
#pragma unroll
  for (int t = 0; t < 3; ++t) {
    float inverse[8];
    const float4* src = reinterpret_cast<const float4*>(channel_inverse + t * 128 + cg * 8);
    const float4 lo = src[0], hi = src[1];
    inverse[0] = lo.x; inverse[1] = lo.y; inverse[2] = lo.z; inverse[3] = lo.w;
    inverse[4] = hi.x; inverse[5] = hi.y; inverse[6] = hi.z; inverse[7] = hi.w;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint32_t q[kTokens];
#pragma unroll
      for (int i = 0; i < kTokens; ++i) {
        const float2 a = widen<kBf16>(v[i][t][k]);
        q[i] = e4m3x2(scaled(a.x, inverse[2 * k]), scaled(a.y, inverse[2 * k + 1]));
      }
      const uint32_t low = __byte_perm(q[0], q[1], 0x5140), high = __byte_perm(q[2], q[3], 0x5140);
      const int piece = (tg / 4) ^ (cg % 8);
      uint8_t* tile = smem + t * 16384 + piece * 16 + (tg % 4) * 4;
      uint8_t* channel = tile + (cg * 8 + 2 * k) * 128;
      *reinterpret_cast<uint32_t*>(channel) = __byte_perm(low, high, 0x5410);
      *reinterpret_cast<uint32_t*>(channel + 128) = __byte_perm(low, high, 0x7632);
    }
  }
  __syncthreads();
  // The expert's columns run to its token count rounded up to 16 (zeros past
  // its tokens); a stand-in's may pass Tp. Both bounds are multiples of 16.
  const int64_t padded_rows = (r.rows + 15) / 16 * 16;
  const int64_t Tp = p.segments.padded_tokens;
#pragma unroll
  for (int t = 0; t < 3; ++t) {
    uint8_t* data = t < 2 ? p.dht_data : p.at_data;
    if (data == nullptr) continue;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int q = tid + k * kThreads;
      const int row = q / 8, piece = q % 8;
      const int64_t column = r.column_start + first + piece * 16;
      if (first + piece * 16 < padded_rows && column < Tp) {
        const uint4 value = *reinterpret_cast<const uint4*>(
            smem + t * 16384 + row * 128 + (piece ^ ((row / 8) % 8)) * 16);
        const int64_t channel = (t == 1 ? F : 0) + j * 128 + row;
        *reinterpret_cast<uint4*>(data + channel * Tp + column) = value;
      }
    }
  }
}

template <bool kBf16>
auto* kernel_for(bool probs) {
  return probs ? swiglu_fp8_backward_kernel<kBf16, true> : swiglu_fp8_backward_kernel<kBf16, false>;
}

}  // namespace

cudaError_t launch_fp8_swiglu_backward(const Fp8SwigluBackwardParams& params,
                                       cudaStream_t stream) {
  if (params.segments.num_blocks == 0 || params.ffn == 0) {
    return cudaSuccess;
  }
  auto* kernel = params.bf16 ? kernel_for<true>(params.probs != nullptr)
                             : kernel_for<false>(params.probs != nullptr);
  const cudaError_t set =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (set != cudaSuccess) {
    return set;
  }
  const dim3 grid(static_cast<unsigned>(params.segments.num_blocks),
                  static_cast<unsigned>(params.ffn / 128));
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace groupgrad
