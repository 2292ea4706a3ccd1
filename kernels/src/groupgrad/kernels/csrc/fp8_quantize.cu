// The (128, 1) + (1, 128) FP8 quantizer of a 16-bit activation in one read
// (interface and layouts: fp8_quantize.h; the math: _fp8_ops.py, bit for bit).
//
// A CTA of 256 threads owns 128 tokens x 128 channels: block row b of the
// (128, 1) form (128 tokens of one expert's segment, found from the block
// offsets as _fp8_triton._segment does) and one 128-channel block of the
// (1, 128) form for the same tokens. The tile arrives in shared memory by
// cp.async (zeros past the expert's tokens), so the loads hold no registers
// while they fly (80 registers, 3 CTAs per SM). Thread (tg, cg) = (tid / 16,
// tid % 16) works on tokens 8 tg .. 8 tg + 7 x channels 8 cg .. 8 cg + 7:
// * a token's max over its 128 channels is an in-thread max over 8 and a
//   butterfly over the 16 lanes of its half-warp;
// * a channel's max over the 128 tokens is an in-thread max over 8, one
//   shuffle across the half-warps, and 8 warps' maxima through shared memory;
// * each token's 8 channels are 8 adjacent bytes of the (1, 128) data (a
//   half-warp stores 128 contiguous bytes); each channel's 8 tokens go back
//   through shared memory so that the (128, 1) data leaves as whole 128-byte
//   rows (stored as 8-byte pieces straight from registers, the kernel ran at
//   0.61x the copy rate; so, 0.78-0.86x: DEVICE_RUNS 140-141).
// The maxima are taken on the 16-bit |x| bits two at a time (an unsigned max
// ranks NaN above Inf above finite values in bf16 and fp16 alike) and widened
// to fp32 bits only for the scale rule.
//
// CTAs past the last expert's blocks zero their scale row and, between them,
// the data's tail columns. Malformed splits (a running sum that falls or does
// not end at T) give every CTA a stand-in (tokens [128 b, 128 b + 128) at the
// same columns), NaN (128, 1) scales and unspecified (128, 1) data; the
// (1, 128) form stays exact, each token still covered once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "fp8_blocks.cuh"
#include "fp8_quantize.h"

namespace groupgrad {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowVectors = 16;  // 16-byte vectors of a token's 128 channels

using groupgrad::max2;  // the 32-bit one, beside this one

__device__ __forceinline__ uint4 max2(uint4 a, uint4 b) {
  return make_uint4(max2(a.x, b.x), max2(a.y, b.y), max2(a.z, b.z), max2(a.w, b.w));
}

// x / scale, zero in a non-finite block (kChecked: such blocks may occur). No
// clamp is needed before the saturating conversion: in a finite block
// |x| / scale <= 448.
template <bool kChecked>
__device__ __forceinline__ float scaled(float x, const BlockScale& s) {
  return !kChecked || s.finite ? x * s.inverse : 0.0f;
}

// Where a thread's tokens lie: its expert's first row and rows, its first
// token's data column and place in the segment, its first channel and lane.
struct Tile {
  int64_t row_start;
  int64_t rows;
  int64_t column;
  int64_t local;
  int64_t channel;
  int cg;
};

// Quantizes a thread's 8 tokens x 8 channels into both forms, tokens two at a
// time: each token's (1, 128) bytes are stored at once, each channel's (128, 1)
// bytes gathered for the 8 tokens into tq[channel]. kChecked: some block is not
// finite.
template <bool kBf16, bool kRows, bool kChecked>
__device__ __forceinline__ void quantize(const Fp8SegmentsParams& p, const Tile& t,
                                         const uint4* v, const BlockScale (&cs)[8],
                                         const uint32_t (&rmax)[4], uint32_t (&tq)[8][2]) {
  const int64_t C = p.channels;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float f[2][8];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 w = v[(2 * j + h) * kRowVectors];
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 pair = widen<kBf16>(words[k]);
        f[h][2 * k] = pair.x;
        f[h][2 * k + 1] = pair.y;
      }
    }
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      tq[c][j / 2] |= e4m3x2(scaled<kChecked>(f[0][c], cs[c]), scaled<kChecked>(f[1][c], cs[c]))
                      << (16 * (j % 2));
    }
    if constexpr (kRows) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * j + h;
        if (t.local + i < t.rows) {
          const BlockScale rs = scale_rule(fp32_bits<kBf16>((rmax[j] >> (16 * h)) & 0xFFFFu));
          const int64_t row = t.row_start + t.local + i;
          uint32_t q[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            q[k] = e4m3x2(scaled<kChecked>(f[h][2 * k], rs), scaled<kChecked>(f[h][2 * k + 1], rs));
          }
          *reinterpret_cast<uint2*>(p.row_data + row * C + t.channel) =
              make_uint2(q[0] | q[1] << 16, q[2] | q[3] << 16);
          if (t.cg == i) {
            p.row_scales[static_cast<int64_t>(blockIdx.y) * p.segments.tokens + row] = rs.scale;
          }
        }
      }
    }
  }
}

// A block row past the last expert's blocks: a zero scale row and, shared
// with the other such CTAs, zero tail columns of the data.
__device__ void zero_tail(const Fp8SegmentsParams& p, int64_t b, int64_t channel, int tid) {
  if (tid < 16) {
    float4* scales = reinterpret_cast<float4*>(p.scales + b * p.channels + channel);
    scales[0] = make_float4(0.f, 0.f, 0.f, 0.f);
    scales[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const int64_t channel_row = static_cast<int64_t>(blockIdx.y) * 128 + tid / 2;
  zero_tail_row(p.data + channel_row * p.segments.padded_tokens, p.segments, b, tid % 2);
}

template <bool kBf16, bool kRows>
__global__ void __launch_bounds__(kThreads) quantize_segments_kernel(const Fp8SegmentsParams p) {
  __shared__ uint4 warp_max[kWarps][16];
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int cg = tid % 16;  // channels 8 cg .. 8 cg + 7 of the tile
  const int tg = tid / 16;  // tokens 8 tg .. 8 tg + 7 of the block
  const int64_t b = blockIdx.x;
  const int64_t T = p.segments.tokens, C = p.channels;
  const int64_t channel = static_cast<int64_t>(blockIdx.y) * 128 + cg * 8;
  const BlockRow r = find_block_row<kThreads>(p.segments, b);
  if (r.past) {
    zero_tail(p, b, channel, tid);
    return;
  }
  const int64_t row_start = r.row_start, rows = r.rows, column_start = r.column_start;
  const int64_t first_block = r.first_block;
  const bool malformed = r.malformed;
  const int64_t local = (b - first_block) * 128 + tg * 8;  // the thread's first token

  // The tile through shared memory (zeros past the expert's tokens): the
  // loads hold no registers while they fly, so more CTAs fit on an SM.
  __shared__ uint4 tile[128 * kRowVectors];
  uint4* const v = tile + tg * 8 * kRowVectors + cg;  // the thread's 8 tokens, kRowVectors apart
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const bool ok = local + i < rows;
    const int64_t offset = ok ? (row_start + local + i) * C + channel : 0;
    copy_async<16>(v + i * kRowVectors, static_cast<const uint16_t*>(p.x) + offset, ok);
  }
  wait_copies();

  // Channel maxima over the block's tokens: the thread's 8, the other
  // half-warp's, then the 8 warps' through shared memory.
  uint4 cmax = make_uint4(0, 0, 0, 0);
  uint32_t rmax[4] = {0, 0, 0, 0};  // tokens 2j and 2j + 1 in word j's halves
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint4 w = v[i * kRowVectors];
    const uint4 a = make_uint4(abs2(w.x), abs2(w.y), abs2(w.z), abs2(w.w));
    cmax = max2(cmax, a);
    if constexpr (kRows) {
      const uint32_t m = max2(max2(a.x, a.y), max2(a.z, a.w));
      rmax[i / 2] |= max(m & 0xFFFFu, m >> 16) << (16 * (i % 2));
    }
  }
  cmax.x = max2(cmax.x, __shfl_xor_sync(0xFFFFFFFFu, cmax.x, 16));
  cmax.y = max2(cmax.y, __shfl_xor_sync(0xFFFFFFFFu, cmax.y, 16));
  cmax.z = max2(cmax.z, __shfl_xor_sync(0xFFFFFFFFu, cmax.z, 16));
  cmax.w = max2(cmax.w, __shfl_xor_sync(0xFFFFFFFFu, cmax.w, 16));
  if (lane < 16) {
    warp_max[tid / 32][cg] = cmax;
  }

  // Token maxima over the 128 channels: the 16 lanes of the half-warp.
  if constexpr (kRows) {
#pragma unroll
    for (int lanes = 1; lanes < 16; lanes *= 2) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        rmax[j] = max2(rmax[j], __shfl_xor_sync(0xFFFFFFFFu, rmax[j], lanes));
      }
    }
  }
  __syncthreads();
  cmax = warp_max[0][cg];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) {
    cmax = max2(cmax, warp_max[w][cg]);
  }
  const uint32_t cwords[4] = {cmax.x, cmax.y, cmax.z, cmax.w};
  BlockScale cs[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    cs[c] = scale_rule(fp32_bits<kBf16>((cwords[c / 2] >> (16 * (c % 2))) & 0xFFFFu));
  }
  if (tg == 0) {
    float s[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      s[c] = malformed ? __uint_as_float(kNanBits) : cs[c].scale;
    }
    float4* scales = reinterpret_cast<float4*>(p.scales + b * C + channel);
    scales[0] = make_float4(s[0], s[1], s[2], s[3]);
    scales[1] = make_float4(s[4], s[5], s[6], s[7]);
  }

  bool finite = true;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    finite = finite && cs[c].finite;
  }
  if constexpr (kRows) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      finite = finite && fp32_bits<kBf16>((rmax[i / 2] >> (16 * (i % 2))) & 0xFFFFu) < 0x7F800000u;
    }
  }
  const Tile where{row_start, rows, column_start + local, local, channel, cg};
  uint32_t tq[8][2] = {};
  if (finite) {
    quantize<kBf16, kRows, false>(p, where, v, cs, rmax, tq);
  } else {
    quantize<kBf16, kRows, true>(p, where, v, cs, rmax, tq);
  }

  // The (128, 1) bytes leave through shared memory (the tile's, read by now):
  // each channel's 128 tokens as eight 16-byte pieces, the pieces XOR-swizzled
  // by channel group so that a half-warp's 8-byte writes spread over the
  // banks; then whole 128-byte rows of the data.
  __syncthreads();
  auto* bytes = reinterpret_cast<uint8_t*>(tile);
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const int piece = (tg / 2) ^ (cg % 8);
    *reinterpret_cast<uint2*>(bytes + (cg * 8 + c) * 128 + piece * 16 + (tg % 2) * 8) =
        make_uint2(tq[c][0], tq[c][1]);
  }
  __syncthreads();
  // The expert's columns run to its token count rounded up to 16 (zeros past
  // its tokens); a stand-in's may pass Tp. Both bounds are multiples of 16.
  const int64_t padded_rows = (rows + 15) / 16 * 16;
  const int64_t first = (b - first_block) * 128;  // the block's first token in the segment
  const int64_t Tp = p.segments.padded_tokens;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int q = tid + k * kThreads;
    const int row = q / 8, piece = q % 8;
    const int64_t column = column_start + first + piece * 16;
    if (first + piece * 16 < padded_rows && column < Tp) {
      const uint4 value =
          *reinterpret_cast<const uint4*>(bytes + row * 128 + (piece ^ ((row / 8) % 8)) * 16);
      *reinterpret_cast<uint4*>(p.data + (static_cast<int64_t>(blockIdx.y) * 128 + row) * Tp +
                                column) = value;
    }
  }
}

template <bool kBf16>
auto* kernel_for(bool rows) {
  return rows ? quantize_segments_kernel<kBf16, true> : quantize_segments_kernel<kBf16, false>;
}

}  // namespace

cudaError_t launch_fp8_segments(const Fp8SegmentsParams& params, cudaStream_t stream) {
  if (params.segments.num_blocks == 0 || params.channels == 0) {
    return cudaSuccess;
  }
  const bool rows = params.row_data != nullptr;
  auto* kernel = params.bf16 ? kernel_for<true>(rows) : kernel_for<false>(rows);
  const dim3 grid(static_cast<unsigned>(params.segments.num_blocks),
                  static_cast<unsigned>(params.channels / 128));
  kernel<<<grid, kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

namespace {

constexpr int kOffsetsThreads = 1024;

__device__ __forceinline__ int64_t floor_div(int64_t a, int64_t b) {  // b > 0, as Python's //
  return a / b - (a % b != 0 && a < 0);
}

// Expert e's steps of the three sums: its tokens, rounded up to `align`, its 128-token blocks.
__device__ __forceinline__ void steps_at(const Fp8OffsetsParams& p, int64_t e,
                                         long long (&step)[3]) {
  const int64_t n = p.sizes64 ? static_cast<const int64_t*>(p.sizes)[e]
                              : static_cast<int64_t>(static_cast<const int32_t*>(p.sizes)[e]);
  step[0] = n;
  step[1] = floor_div(n + p.align - 1, p.align) * p.align;
  step[2] = floor_div(n + 127, 128);
}

// Thread t sums its own run of experts, one block-wide exclusive scan per sum gives the
// run's first offsets, and the thread writes its run's running sums.
__global__ void __launch_bounds__(kOffsetsThreads) fp8_offsets_kernel(const Fp8OffsetsParams p) {
  using Scan = cub::BlockScan<long long, kOffsetsThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int64_t E = p.experts;
  const int64_t per = (E + kOffsetsThreads - 1) / kOffsetsThreads;
  const int64_t begin = min(E, static_cast<int64_t>(threadIdx.x) * per);
  const int64_t end = min(E, begin + per);
  long long sums[3] = {0, 0, 0};
  long long step[3];
  for (int64_t e = begin; e < end; ++e) {
    steps_at(p, e, step);
    for (int k = 0; k < 3; ++k) {
      sums[k] += step[k];
    }
  }
  long long running[3];
  for (int k = 0; k < 3; ++k) {
    Scan(temp).ExclusiveSum(sums[k], running[k]);
    __syncthreads();  // the temp storage is used again
  }
  if (threadIdx.x == 0) {
    p.row[0] = p.seg[0] = p.block[0] = 0;
  }
  int64_t* const outs[3] = {p.row, p.seg, p.block};
  for (int64_t e = begin; e < end; ++e) {
    steps_at(p, e, step);
    for (int k = 0; k < 3; ++k) {
      outs[k][e + 1] = running[k] += step[k];
    }
  }
}

}  // namespace

cudaError_t launch_fp8_offsets(const Fp8OffsetsParams& params, cudaStream_t stream) {
  fp8_offsets_kernel<<<1, kOffsetsThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace groupgrad
