// Device helpers shared by the setup kernels (grouped_setup.cu, fp8_setup.cu):
// the check of device splits, which no host reads, and the fills of an output.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace groupgrad {

constexpr int kSetupThreads = 128;  // threads of a setup block

__device__ inline int64_t warp_sum(int64_t v) {
  for (int offset = 16; offset > 0; offset /= 2) {
    v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  return v;
}

// Sums each of `values` over the block; every thread gets the totals. The
// block waits until every thread has read the partial sums before it
// returns, so the next call may write them again. Every thread of the block
// must call it.
template <int N>
__device__ inline void block_sums(int64_t (&values)[N]) {
  __shared__ int64_t partial[N][kSetupThreads / 32];
  for (int j = 0; j < N; ++j) {
    values[j] = warp_sum(values[j]);
    if (threadIdx.x % 32 == 0) {
      partial[j][threadIdx.x / 32] = values[j];
    }
  }
  __syncthreads();
  for (int j = 0; j < N; ++j) {
    values[j] = 0;
    for (int w = 0; w < kSetupThreads / 32; ++w) {
      values[j] += partial[j][w];
    }
  }
  __syncthreads();
}

// Whether device splits break their contract (every count in [0, tokens],
// the counts summing to tokens). Such splits could address memory outside
// the operands, and no host sees them: the setup kernels then give the GEMM
// no tiles and fill its outputs with NaN. Every thread of the block gets the
// answer.
__device__ inline bool splits_malformed(const int64_t* splits, int groups, int64_t tokens) {
  int64_t sums[2] = {0, 0};  // the counts in [0, tokens], the counts outside it
  for (int i = threadIdx.x; i < groups; i += kSetupThreads) {
    const int64_t count = splits[i];
    const bool ok = count >= 0 && count <= tokens;
    sums[0] += ok ? count : 0;  // at most groups * tokens: no overflow
    sums[1] += ok ? 0 : 1;
  }
  block_sums(sums);
  return sums[1] > 0 || sums[0] != tokens;
}

// Sets every byte of a rows x row_bytes matrix (rows ld_bytes apart) to
// `byte`; this block writes rows part, part + parts, ... Row bytes are even
// (2- or 4-byte elements); 16-byte stores where the layout allows them.
// Bytes 0xff make every element NaN (bf16, fp16 and fp32 alike).
__device__ inline void fill_matrix(char* base, int64_t rows, int64_t row_bytes, int64_t ld_bytes,
                                   unsigned char byte, int64_t part, int64_t parts) {
  const bool wide =
      (reinterpret_cast<uintptr_t>(base) % 16 == 0) && row_bytes % 16 == 0 && ld_bytes % 16 == 0;
  const unsigned word = byte * 0x01010101u;
  for (int64_t r = part; r < rows; r += parts) {
    char* row = base + r * ld_bytes;
    if (wide) {
      const int4 value = make_int4(word, word, word, word);
      for (int64_t v = threadIdx.x; v < row_bytes / 16; v += kSetupThreads) {
        reinterpret_cast<int4*>(row)[v] = value;
      }
    } else {
      const auto value = static_cast<uint16_t>(word);
      for (int64_t v = threadIdx.x; v < row_bytes / 2; v += kSetupThreads) {
        reinterpret_cast<uint16_t*>(row)[v] = value;
      }
    }
  }
}

constexpr unsigned char kZeroByte = 0x00;
constexpr unsigned char kNanByte = 0xff;

}  // namespace groupgrad
