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

}  // namespace groupgrad
