// Torch-free interface between the CUTLASS kernel instantiations and the
// PyTorch binding. Everything here is plain C++/CUDA runtime so that each
// instantiation translation unit compiles without PyTorch headers.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace groupgrad {

// Devices whose per-device state (SM count, kernel attributes set) is cached; a
// device beyond them is served uncached.
constexpr int kMaxDevices = 64;

// Device-side arrays describing one grouped GEMM D_g = A_g B_g (+ C_g), g < groups.
// Every "ld" array holds the one non-unit stride of that operand, in elements:
//   A row-major (M,K): row stride;  A column-major (M,K): column stride;
//   B "K-major" (N,K): stride between rows of N;  B "N-major" (N,K): stride between K;
//   D row-major (M,N): row stride.  C shares D's pointers and strides (in place).
// problem_shapes holds groups × {M, N, K} int32.
struct GemmLaunch {
  int groups = 0;
  int* problem_shapes = nullptr;
  const void* const* ptr_A = nullptr;
  const int64_t* ld_A = nullptr;
  const void* const* ptr_B = nullptr;
  const int64_t* ld_B = nullptr;
  void* const* ptr_D = nullptr;
  const int64_t* ld_D = nullptr;
  bool accumulate = false;       // D += A B (beta = 1); needs a variant with a C operand
  int sm_count = 0;
  int device_id = 0;
  bool raster_along_n = false;  // tile raster order of the persistent scheduler
  int max_swizzle = 1;          // 1, 2, 4 or 8
  cudaStream_t stream = nullptr;
};

// One compiled kernel instantiation. Its epilogue either has a C operand that
// aliases D (beta = 1 when accumulating, beta = 0 and C never loaded when
// overwriting) or no C operand at all (overwrite only; D is never read).
struct KernelVariant {
  const char* name;
  bool has_source;
  size_t (*workspace_size)(const GemmLaunch&);
  // Returns nullptr on success, else a static message.
  const char* (*run)(const GemmLaunch&, void* workspace);
};

// Defined in binding.cpp; instantiation TUs call it from a static initializer.
bool register_variant(const KernelVariant& variant);

// An FP8 (e4m3) grouped GEMM with blockwise scales: the arrays of a GemmLaunch
// (A and B K-major, D row-major) plus one fp32 scale pointer per group and
// operand. The scale tensors' layouts follow from each group's problem shape
// (see fp8_gemm.cuh and fp8_setup.h).
struct Fp8GemmLaunch {
  GemmLaunch gemm;
  const float* const* ptr_SFA = nullptr;
  const float* const* ptr_SFB = nullptr;
};

// One compiled FP8 kernel instantiation (registered apart from the bf16 ones:
// its launch carries the scales).
struct Fp8KernelVariant {
  const char* name;
  bool has_source;
  bool adds_to_d;     // D += result by TMA reduce-add (accumulates only, no C operand)
  int out_bytes;      // element size of D
  int scale_n;        // SFB granularity along GEMM N: 128 (weights) or 1 (channels)
  bool sfb_mn_major;  // SFB N-block-major (else K-block-major)
  size_t (*workspace_size)(const Fp8GemmLaunch&);
  // Returns nullptr on success, else a static message.
  const char* (*run)(const Fp8GemmLaunch&, void* workspace);
};

// Defined in binding.cpp, called like register_variant.
bool register_fp8_variant(const Fp8KernelVariant& variant);

}  // namespace groupgrad
