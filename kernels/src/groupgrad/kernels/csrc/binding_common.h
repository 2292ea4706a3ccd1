// Helpers the bindings share (binding.cpp, fp8_binding.cpp, fp8_elementwise_binding.cpp).
#pragma once

#include <torch/extension.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace groupgrad {

// Multiprocessors of `device`, read once per device.
int multiprocessor_count(int device);

int element_bytes(const at::Tensor& t);

inline size_t round_up(size_t value, size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// A group of E (N, K) matrices as the Python side hands it over: packed, one
// (E, N, K) tensor in a one-element list, or listed, E separate matrices.
bool is_packed(const std::vector<at::Tensor>& group);
int64_t group_count(const std::vector<at::Tensor>& group);

// (elements,) contiguous int64 token counts on `device` (splits, running counts).
void check_counts(const at::Tensor& t, const char* name, int64_t elements,
                  const at::Device& device);

// Checks a group of (rows, cols) matrices of `dtype` on `device`, packed or listed.
void check_group(const std::vector<at::Tensor>& group, const char* name, int64_t rows,
                 int64_t cols, at::ScalarType dtype, const at::Device& device);

bool aligned_16(const void* ptr);

// A contiguous, 16-byte aligned e4m3 tensor of `sizes` on `device` (fp8_binding.cpp).
void check_fp8_data(const at::Tensor& t, const char* name, at::IntArrayRef sizes,
                    const at::Device& device);

// fp32 scales of `sizes` on `device`; `transposed`: contiguous as sizes reversed
// (the rows form's (T, C/128) with strides (1, T)), else contiguous.
void check_scales(const at::Tensor& t, const char* name, at::IntArrayRef sizes, bool transposed,
                  const at::Device& device);

// The FP8 binding (fp8_binding.cpp): its compiled variants and its Python entry points.
std::vector<std::string> fp8_variant_names();
void add_fp8_bindings(py::module& m);

// The hand-written FP8 elementwise kernels' entry points (fp8_elementwise_binding.cpp).
void add_fp8_elementwise_bindings(py::module& m);

}  // namespace groupgrad
