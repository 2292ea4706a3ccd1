// Spike (not yet run on a GPU): the FP8 SwiGLU backward (_swiglu_fp8.backward_ref's math) in one
// CUDA kernel; README.md says what it does and what is left. Built by run_spike.py.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>

#include "fp8_blocks.cuh"  // kernels/src/groupgrad/kernels/csrc: the scale rule, e4m3x2

#ifndef SWB_MIN_BLOCKS
#define SWB_MIN_BLOCKS 1
#endif
namespace SWB_NS {

struct Params {
  const void* da = nullptr;
  bool bf16 = true;
  const uint8_t* h_data = nullptr;
  const float* h_scales = nullptr;
  const float* probs = nullptr;
  const int64_t* row_offsets = nullptr;
  const int64_t* seg_offsets = nullptr;
  const int64_t* block_offsets = nullptr;
  int64_t T = 0, F = 0, E = 0, NB = 0, Tp = 0;
  uint8_t* dh_data = nullptr;
  float* dh_scales = nullptr;
  uint8_t* dht_data = nullptr;
  float* dht_scales = nullptr;
  uint8_t* at_data = nullptr;
  float* at_scales = nullptr;
  float* partial = nullptr;
};

namespace {

using groupgrad::BlockScale;
using groupgrad::e4m3x2;
using groupgrad::kNanBits;
using groupgrad::scale_rule;

constexpr int kThreads = 256;
constexpr int kWarps = 8;
constexpr int kSmemBytes = 64 * 1024 + 128 * 8 * 4 + kWarps * 3 * 16 * 32;

__device__ __forceinline__ float scaled(float x, float inverse, bool finite) {
  return finite ? x * inverse : 0.0f;
}

__device__ __forceinline__ uint32_t abs_bits(float x) { return __float_as_uint(x) & 0x7FFFFFFFu; }

template <bool kBf16>
__device__ __forceinline__ float round_to(float x) {
  if constexpr (kBf16) {
    return __bfloat162float(__float2bfloat16_rn(x));
  } else {
    return __half2float(__float2half_rn(x));
  }
}

__device__ __forceinline__ void copy_async(void* smem, const void* gmem, int bytes, bool ok) {
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if (bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(gmem),
                 "r"(ok ? 16 : 0) : "memory");
  } else if (bytes == 8) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(address), "l"(gmem),
                 "r"(ok ? 8 : 0) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(address), "l"(gmem),
                 "r"(ok ? 4 : 0) : "memory");
  }
}

// 8 e4m3 bytes -> 8 floats times scale, rounded to the activation dtype.
template <bool kBf16>
__device__ __forceinline__ void dequantize8(uint2 q, float scale, float (&out)[8]) {
  const uint32_t words[2] = {q.x, q.y};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const auto pair = static_cast<__nv_fp8x2_storage_t>(words[k / 2] >> (16 * (k % 2)));
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
    __half2 hh;
    memcpy(&hh, &h, sizeof(hh));
    const float2 f = __half22float2(hh);
    out[2 * k] = round_to<kBf16>(f.x * scale);
    out[2 * k + 1] = round_to<kBf16>(f.y * scale);
  }
}

template <bool kBf16>
__device__ __forceinline__ void widen8(uint4 w, float (&out)[8]) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (kBf16) {
      out[2 * k] = __uint_as_float(words[k] << 16);
      out[2 * k + 1] = __uint_as_float(words[k] & 0xFFFF0000u);
    } else {
      __half2 h;
      memcpy(&h, &words[k], sizeof(h));
      const float2 f = __half22float2(h);
      out[2 * k] = f.x;
      out[2 * k + 1] = f.y;
    }
  }
}

struct Grads {
  float dg[8], du[8], act[8];
};

// One token's 8 channels: dg, du, act rounded to the dtype; part += sum da * act (before probs).
template <bool kBf16, bool kProbs>
__device__ __forceinline__ void grads(const uint8_t* smem, int token, int cg, Grads& r,
                                      float& part) {
  const float* info = reinterpret_cast<const float*>(smem + 64 * 1024);
  float g[8], u[8], da[8];
  dequantize8<kBf16>(*reinterpret_cast<const uint2*>(smem + 32768 + token * 128 + cg * 8),
                     info[token], g);
  dequantize8<kBf16>(*reinterpret_cast<const uint2*>(smem + 49152 + token * 128 + cg * 8),
                     info[128 + token], u);
  widen8<kBf16>(*reinterpret_cast<const uint4*>(smem + token * 256 + cg * 16), da);
  const float p = kProbs ? info[256 + token] : 1.0f;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const float sig = 1.0f / (1.0f + __expf(-g[c]));
    const float silu = g[c] * sig;
    float act = silu * u[c];
    float d = da[c];
    if constexpr (kProbs) {
      part += d * act;
      act = act * p;
      d = d * p;
    }
    r.dg[c] = round_to<kBf16>(d * u[c] * sig * (1.0f + g[c] * (1.0f - sig)));
    r.du[c] = round_to<kBf16>(d * silu);
    r.act[c] = round_to<kBf16>(act);
  }
}

__device__ void zero_tail(const Params& p, int64_t b, int tid) {
  const int E = static_cast<int>(p.E);
  const int64_t j = blockIdx.y;
  const int cg = tid % 16;
  if (tid < 16) {
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
    if (p.dht_data) {
      float4* s = reinterpret_cast<float4*>(p.dht_scales + b * 2 * p.F + j * 128 + cg * 8);
      s[0] = z; s[1] = z;
      s = reinterpret_cast<float4*>(p.dht_scales + b * 2 * p.F + p.F + j * 128 + cg * 8);
      s[0] = z; s[1] = z;
    }
    if (p.at_data) {
      float4* s = reinterpret_cast<float4*>(p.at_scales + b * p.F + j * 128 + cg * 8);
      s[0] = z; s[1] = z;
    }
  }
  const int64_t used = p.block_offsets[E];
  const int64_t step = (p.NB - used) * 128;
  const int64_t Tp = p.Tp;
  const int64_t channel = j * 128 + tid / 2;
  uint8_t* rows[3] = {p.dht_data ? p.dht_data + channel * Tp : nullptr,
                      p.dht_data ? p.dht_data + (p.F + channel) * Tp : nullptr,
                      p.at_data ? p.at_data + channel * Tp : nullptr};
  for (int64_t start = p.seg_offsets[E] + (b - used) * 128 + (tid % 2) * 64; start < Tp;
       start += step) {
#pragma unroll
    for (int t = 0; t < 3; ++t) {
      if (rows[t] == nullptr) continue;
#pragma unroll
      for (int k = 0; k < 64; k += 16) {
        if (start + k < Tp) *reinterpret_cast<uint4*>(rows[t] + start + k) = make_uint4(0, 0, 0, 0);
      }
    }
  }
}

template <bool kBf16, bool kProbs>
__global__ void __launch_bounds__(kThreads, SWB_MIN_BLOCKS) backward_kernel(const Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  float* info = reinterpret_cast<float*>(smem + 64 * 1024);  // gs[128], us[128], ps[128], row info
  uint32_t* cmax_smem = reinterpret_cast<uint32_t*>(smem + 64 * 1024 + 128 * 8 * 4);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int cg = tid % 16, tg = tid / 16;
  const int64_t b = blockIdx.x, j = blockIdx.y;
  const int64_t T = p.T, F = p.F;
  const int E = static_cast<int>(p.E);

  int e = 0, falls = 0;
  for (int first = 0; first < E; first += kThreads) {
    const int k = first + tid;
    const bool listed = k < E;
    e += __syncthreads_count(listed && p.block_offsets[k + 1] <= b);
    falls |= __syncthreads_or(listed && p.row_offsets[k + 1] < p.row_offsets[k]);
  }
  const bool malformed = falls || p.row_offsets[E] != T;
  if (e >= E && !malformed) {
    if (p.dht_data || p.at_data) zero_tail(p, b, tid);
    return;
  }
  int64_t row_start = b * 128, rows = T - b * 128, column_start = b * 128, first_block = b;
  if (!malformed) {
    row_start = p.row_offsets[e];
    rows = p.row_offsets[e + 1] - row_start;
    column_start = p.seg_offsets[e];
    first_block = p.block_offsets[e];
  }
  const int64_t first = (b - first_block) * 128;  // the block's first token in the segment
  const int64_t local = first + tg * 8;

  const auto* da = static_cast<const uint16_t*>(p.da);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int token = tg * 8 + i;
    const bool ok = local + i < rows;
    const int64_t row = ok ? row_start + local + i : 0;
    copy_async(smem + token * 256 + cg * 16, da + row * F + j * 128 + cg * 8, 16, ok);
    copy_async(smem + 32768 + token * 128 + cg * 8, p.h_data + row * 2 * F + j * 128 + cg * 8, 8, ok);
    copy_async(smem + 49152 + token * 128 + cg * 8, p.h_data + row * 2 * F + F + j * 128 + cg * 8, 8, ok);
  }
  {
    const int token = tid % 128;
    const bool ok = first + token < rows;
    const int64_t row = ok ? row_start + first + token : 0;
    const int64_t block = tid < 128 ? j : F / 128 + j;
    copy_async(info + tid, p.h_scales + block * T + row, 4, ok);
    if (kProbs && tid < 128) copy_async(info + 256 + tid, p.probs + row, 4, ok);
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncthreads();

  // Pass 1: maxima (channels of dg, du, act; tokens of dg, du) and dprobs' partial sums.
  uint32_t cm[3][8] = {};
  uint32_t rm[2][8] = {};
  float part[8] = {};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    Grads r;
    grads<kBf16, kProbs>(smem, tg * 8 + i, cg, r, part[i]);
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const uint32_t a = abs_bits(r.dg[c]), bb = abs_bits(r.du[c]), x = abs_bits(r.act[c]);
      cm[0][c] = max(cm[0][c], a);
      cm[1][c] = max(cm[1][c], bb);
      cm[2][c] = max(cm[2][c], x);
      rm[0][i] = max(rm[0][i], a);
      rm[1][i] = max(rm[1][i], bb);
    }
  }
#pragma unroll
  for (int lanes = 1; lanes < 16; lanes *= 2) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      rm[0][i] = max(rm[0][i], __shfl_xor_sync(0xFFFFFFFFu, rm[0][i], lanes));
      rm[1][i] = max(rm[1][i], __shfl_xor_sync(0xFFFFFFFFu, rm[1][i], lanes));
      if constexpr (kProbs) part[i] += __shfl_xor_sync(0xFFFFFFFFu, part[i], lanes);
    }
  }
#pragma unroll
  for (int t = 0; t < 3; ++t) {
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      cm[t][c] = max(cm[t][c], __shfl_xor_sync(0xFFFFFFFFu, cm[t][c], 16));
    }
  }
  if (lane < 16) {
#pragma unroll
    for (int t = 0; t < 3; ++t) {
      uint4* dst = reinterpret_cast<uint4*>(cmax_smem + ((warp * 3 + t) * 16 + cg) * 8);
      dst[0] = make_uint4(cm[t][0], cm[t][1], cm[t][2], cm[t][3]);
      dst[1] = make_uint4(cm[t][4], cm[t][5], cm[t][6], cm[t][7]);
    }
  }
  // row info: rows' scales and partial sums, written by lane cg == i
  float* row_info = info + 384;  // [128 tokens][2]: dg inverse (NaN bits if not finite), du inverse
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (cg == i) {
      const int64_t row = row_start + local + i;
      const bool ok = local + i < rows;
      const BlockScale sg = scale_rule(rm[0][i]), su = scale_rule(rm[1][i]);
      row_info[(tg * 8 + i) * 2] = sg.finite ? sg.inverse : -1.0f;  // < 0: not finite
      row_info[(tg * 8 + i) * 2 + 1] = su.finite ? su.inverse : -1.0f;
      if (ok && p.dh_data) {
        p.dh_scales[j * T + row] = sg.scale;
        p.dh_scales[(F / 128 + j) * T + row] = su.scale;
      }
      if (ok && kProbs) p.partial[j * T + row] = part[i];
    }
  }
  __syncthreads();
  float inv[3][8];
  uint32_t finite_mask = 0;
#pragma unroll
  for (int t = 0; t < 3; ++t) {
    uint32_t m[8] = {};
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const uint4* src = reinterpret_cast<const uint4*>(cmax_smem + ((w * 3 + t) * 16 + cg) * 8);
      const uint4 a = src[0], bb = src[1];
      m[0] = max(m[0], a.x); m[1] = max(m[1], a.y); m[2] = max(m[2], a.z); m[3] = max(m[3], a.w);
      m[4] = max(m[4], bb.x); m[5] = max(m[5], bb.y); m[6] = max(m[6], bb.z); m[7] = max(m[7], bb.w);
    }
    float s[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const BlockScale bs = scale_rule(m[c]);
      inv[t][c] = bs.inverse;
      finite_mask |= (bs.finite ? 1u : 0u) << (t * 8 + c);
      s[c] = malformed ? __uint_as_float(kNanBits) : bs.scale;
    }
    if (tg == 0) {
      float* dst = nullptr;
      if (t < 2 && p.dht_data) dst = p.dht_scales + b * 2 * F + t * F + j * 128 + cg * 8;
      if (t == 2 && p.at_data) dst = p.at_scales + b * F + j * 128 + cg * 8;
      if (dst) {
        reinterpret_cast<float4*>(dst)[0] = make_float4(s[0], s[1], s[2], s[3]);
        reinterpret_cast<float4*>(dst)[1] = make_float4(s[4], s[5], s[6], s[7]);
      }
    }
  }

  // Pass 2: quantize. Rows form per token; token forms gathered per channel.
  uint32_t tq[3][8][2] = {};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    Grads r;
    float unused = 0.0f;
    grads<kBf16, kProbs>(smem, tg * 8 + i, cg, r, unused);  // its partial sum unused here
    const bool ok = local + i < rows;
    if (p.dh_data && ok) {
      const float ig = row_info[(tg * 8 + i) * 2], iu = row_info[(tg * 8 + i) * 2 + 1];
      const int64_t row = row_start + local + i;
      uint32_t q[4], v[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        q[k] = e4m3x2(scaled(r.dg[2 * k], ig, ig > 0), scaled(r.dg[2 * k + 1], ig, ig > 0));
        v[k] = e4m3x2(scaled(r.du[2 * k], iu, iu > 0), scaled(r.du[2 * k + 1], iu, iu > 0));
      }
      *reinterpret_cast<uint2*>(p.dh_data + row * 2 * F + j * 128 + cg * 8) =
          make_uint2(q[0] | q[1] << 16, q[2] | q[3] << 16);
      *reinterpret_cast<uint2*>(p.dh_data + row * 2 * F + F + j * 128 + cg * 8) =
          make_uint2(v[0] | v[1] << 16, v[2] | v[3] << 16);
    }
    const float* vals[3] = {r.dg, r.du, r.act};
#pragma unroll
    for (int t = 0; t < 3; ++t) {
#pragma unroll
      for (int c = 0; c < 8; c += 2) {
        const bool f0 = (finite_mask >> (t * 8 + c)) & 1u, f1 = (finite_mask >> (t * 8 + c + 1)) & 1u;
        const uint32_t w = e4m3x2(scaled(vals[t][c], inv[t][c], f0), scaled(vals[t][c + 1], inv[t][c + 1], f1));
        tq[t][c][i / 4] |= (w & 0xFFu) << (8 * (i % 4));
        tq[t][c + 1][i / 4] |= ((w >> 8) & 0xFFu) << (8 * (i % 4));
      }
    }
  }
  // Token forms out through shared memory as whole 128-byte rows.
  __syncthreads();
#pragma unroll
  for (int t = 0; t < 3; ++t) {
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const int piece = (tg / 2) ^ (cg % 8);
      *reinterpret_cast<uint2*>(smem + t * 16384 + (cg * 8 + c) * 128 + piece * 16 + (tg % 2) * 8) =
          make_uint2(tq[t][c][0], tq[t][c][1]);
    }
  }
  __syncthreads();
  const int64_t padded_rows = (rows + 15) / 16 * 16;
  const int64_t Tp = p.Tp;
#pragma unroll
  for (int t = 0; t < 3; ++t) {
    uint8_t* base = t < 2 ? p.dht_data : p.at_data;
    if (base == nullptr) continue;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int q = tid + k * kThreads;
      const int row = q / 8, piece = q % 8;
      const int64_t column = column_start + first + piece * 16;
      if (first + piece * 16 < padded_rows && column < Tp) {
        const uint4 value = *reinterpret_cast<const uint4*>(
            smem + t * 16384 + row * 128 + (piece ^ ((row / 8) % 8)) * 16);
        const int64_t channel = (t == 1 ? F : 0) + j * 128 + row;
        *reinterpret_cast<uint4*>(base + channel * Tp + column) = value;
      }
    }
  }
}

}  // namespace

cudaError_t launch(const Params& p, cudaStream_t stream) {
  if (p.NB == 0 || p.F == 0) return cudaSuccess;
  auto* kernel = p.bf16 ? (p.probs ? backward_kernel<true, true> : backward_kernel<true, false>)
                        : (p.probs ? backward_kernel<false, true> : backward_kernel<false, false>);
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  const dim3 grid(static_cast<unsigned>(p.NB), static_cast<unsigned>(p.F / 128));
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace SWB_NS
