// The hand-written FP8 elementwise kernels' PyTorch binding: the activations'
// (128, 1) + (1, 128) quantizer and its offsets (fp8_quantize.h), the SwiGLU backward
// (swiglu_fp8_backward.h). Host checks of every tensor, then one launch on
// torch's current stream; the offsets are read on the device only. The caller
// allocates the outputs (a zero-element tensor: a form not asked for).
// Registered into the extension by binding.cpp (add_fp8_elementwise_bindings).
//
// Legend: T tokens, C channels, F ffn_hidden_size, E experts, NB and Tp the
// (128, 1) forms' block rows and padded tokens.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "binding_common.h"
#include "fp8_quantize.h"
#include "swiglu_fp8_backward.h"

namespace groupgrad {
namespace {

// A CUDA bfloat16 or float16 (T, C) tensor, contiguous, 16-byte aligned, C a multiple of 128.
void check_activation(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.is_cuda() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
              "groupgrad: ", name, " must be a CUDA bfloat16 or float16 tensor, got ",
              x.scalar_type(), " on ", x.device());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && aligned_16(x.data_ptr()) &&
                  x.size(1) % 128 == 0,
              "groupgrad: ", name, " must be contiguous (T, C), 16-byte aligned, C a multiple ",
              "of 128, got sizes ", x.sizes(), " strides ", x.strides());
}

// The (128, 1) form's layout: the three (E + 1,) running sums, and room for T tokens.
Fp8SegmentsLayout segments_layout(const at::Tensor& row_offsets, const at::Tensor& seg_offsets,
                                  const at::Tensor& block_offsets, int64_t T, int64_t NB,
                                  int64_t Tp, const at::Device& device) {
  const int64_t E = row_offsets.numel() - 1;
  TORCH_CHECK(E >= 0 && E < (int64_t{1} << 31), "groupgrad: row_offsets must have E + 1 elements");
  check_counts(row_offsets, "row_offsets", E + 1, device);
  check_counts(seg_offsets, "seg_offsets", E + 1, device);
  check_counts(block_offsets, "block_offsets", E + 1, device);
  TORCH_CHECK(NB >= (T + 127) / 128 + E && Tp >= T + 15 * E && Tp % 16 == 0,
              "groupgrad: the (128, 1) form needs at least ceil(T / 128) + E = ",
              (T + 127) / 128 + E, " scale rows and T + 15 E = ", T + 15 * E,
              " padded tokens (a multiple of 16), got ", NB, " and ", Tp);
  Fp8SegmentsLayout layout;
  layout.row_offsets = row_offsets.data_ptr<int64_t>();
  layout.seg_offsets = seg_offsets.data_ptr<int64_t>();
  layout.block_offsets = block_offsets.data_ptr<int64_t>();
  layout.tokens = T;
  layout.experts = E;
  layout.num_blocks = NB;
  layout.padded_tokens = Tp;
  return layout;
}

void fp8_segments(const at::Tensor& x, const at::Tensor& row_offsets,
                  const at::Tensor& seg_offsets, const at::Tensor& block_offsets,
                  const at::Tensor& data, const at::Tensor& scales, const at::Tensor& row_data,
                  const at::Tensor& row_scales) {
  check_activation(x, "x");
  const at::Device device = x.device();
  const int64_t T = x.size(0), C = x.size(1), NB = scales.size(0), Tp = data.size(1);
  Fp8SegmentsParams params;
  params.segments = segments_layout(row_offsets, seg_offsets, block_offsets, T, NB, Tp, device);
  check_fp8_data(data, "data", {C, Tp}, device);
  check_scales(scales, "scales", {NB, C}, false, device);
  params.x = x.data_ptr();
  params.bf16 = x.scalar_type() == at::kBFloat16;
  params.channels = C;
  params.data = static_cast<uint8_t*>(data.data_ptr());
  params.scales = scales.data_ptr<float>();
  if (row_data.numel() > 0) {
    check_fp8_data(row_data, "row_data", {T, C}, device);
    check_scales(row_scales, "row_scales", {C / 128, T}, false, device);
    params.row_data = static_cast<uint8_t*>(row_data.data_ptr());
    params.row_scales = row_scales.data_ptr<float>();
  }
  const c10::cuda::CUDAGuard guard(device);
  C10_CUDA_CHECK(launch_fp8_segments(params, c10::cuda::getCurrentCUDAStream()));
}

// A (128, 1) output pair of `channels` rows, if asked (data has elements).
bool asked_tokens_form(const at::Tensor& data, const at::Tensor& scales, const char* name,
                       int64_t channels, int64_t NB, int64_t Tp, const at::Device& device) {
  if (data.numel() == 0) {
    return false;
  }
  check_fp8_data(data, name, {channels, Tp}, device);
  check_scales(scales, name, {NB, channels}, false, device);
  return true;
}

void fp8_swiglu_backward(const at::Tensor& da, const at::Tensor& h_data,
                         const at::Tensor& h_scales, const c10::optional<at::Tensor>& probs,
                         const at::Tensor& row_offsets, const at::Tensor& seg_offsets,
                         const at::Tensor& block_offsets, int64_t NB, int64_t Tp,
                         const at::Tensor& dh_data, const at::Tensor& dh_scales,
                         const at::Tensor& dht_data,
                         const at::Tensor& dht_scales, const at::Tensor& at_data,
                         const at::Tensor& at_scales, const at::Tensor& partial) {
  check_activation(da, "da");
  const at::Device device = da.device();
  const int64_t T = da.size(0), F = da.size(1);
  Fp8SwigluBackwardParams params;
  params.segments = segments_layout(row_offsets, seg_offsets, block_offsets, T, NB, Tp, device);
  check_fp8_data(h_data, "h_data", {T, 2 * F}, device);
  check_scales(h_scales, "h_scales", {2 * F / 128, T}, false, device);
  if (probs.has_value()) {
    const at::Tensor& p = *probs;
    TORCH_CHECK(p.is_cuda() && p.device() == device && p.scalar_type() == at::kFloat &&
                    p.dim() == 1 && p.size(0) == T && p.is_contiguous(),
                "groupgrad: probs must be a contiguous float32 (T,) = (", T, ",) tensor on ",
                device, ", got ", p.scalar_type(), " ", p.sizes(), " on ", p.device());
    check_scales(partial, "partial", {F / 128, T}, false, device);
    params.probs = p.data_ptr<float>();
    params.partial = partial.data_ptr<float>();
  }
  if (asked_tokens_form(dht_data, dht_scales, "dh_tokens", 2 * F, NB, Tp, device)) {
    params.dht_data = static_cast<uint8_t*>(dht_data.data_ptr());
    params.dht_scales = dht_scales.data_ptr<float>();
  }
  if (asked_tokens_form(at_data, at_scales, "a_tokens", F, NB, Tp, device)) {
    params.at_data = static_cast<uint8_t*>(at_data.data_ptr());
    params.at_scales = at_scales.data_ptr<float>();
  }
  if (dh_data.numel() > 0) {
    check_fp8_data(dh_data, "dh_data", {T, 2 * F}, device);
    check_scales(dh_scales, "dh_scales", {2 * F / 128, T}, false, device);
    params.dh_data = static_cast<uint8_t*>(dh_data.data_ptr());
    params.dh_scales = dh_scales.data_ptr<float>();
  }
  params.da = da.data_ptr();
  params.bf16 = da.scalar_type() == at::kBFloat16;
  params.h_data = static_cast<const uint8_t*>(h_data.data_ptr());
  params.h_scales = h_scales.data_ptr<float>();
  params.ffn = F;
  const c10::cuda::CUDAGuard guard(device);
  C10_CUDA_CHECK(launch_fp8_swiglu_backward(params, c10::cuda::getCurrentCUDAStream()));
}

// The (128, 1) forms' offsets of the (E,) int32/int64 CUDA token counts `sizes`: (row, seg,
// block), (E + 1,) int64 each on its device (fp8_quantize.h).
std::vector<at::Tensor> fp8_offsets(const at::Tensor& sizes, int64_t align) {
  TORCH_CHECK(sizes.is_cuda() && sizes.dim() == 1 &&
                  (sizes.scalar_type() == at::kInt || sizes.scalar_type() == at::kLong),
              "groupgrad: sizes must be a 1-D int32 or int64 CUDA tensor, got ",
              sizes.scalar_type(), " ", sizes.sizes(), " on ", sizes.device());
  TORCH_CHECK(align > 0, "groupgrad: align is ", align, ", expected > 0");
  const at::Tensor counts = sizes.contiguous();
  const int64_t E = counts.size(0);
  const auto options = counts.options().dtype(at::kLong);
  std::vector<at::Tensor> out{at::empty({E + 1}, options), at::empty({E + 1}, options),
                              at::empty({E + 1}, options)};
  Fp8OffsetsParams params;
  params.sizes = counts.data_ptr();
  params.sizes64 = counts.scalar_type() == at::kLong;
  params.experts = E;
  params.align = align;
  params.row = out[0].data_ptr<int64_t>();
  params.seg = out[1].data_ptr<int64_t>();
  params.block = out[2].data_ptr<int64_t>();
  const c10::cuda::CUDAGuard guard(counts.device());
  C10_CUDA_CHECK(launch_fp8_offsets(params, c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace

void add_fp8_elementwise_bindings(py::module& m) {
  m.def("fp8_offsets", &fp8_offsets,
        "the (128, 1) forms' (row, seg, block) running sums of E token counts",
        py::arg("sizes"), py::arg("align"));
  m.def("fp8_segments", &fp8_segments, "FP8 (128, 1) + (1, 128) quantizer of an activation",
        py::arg("x"), py::arg("row_offsets"), py::arg("seg_offsets"), py::arg("block_offsets"),
        py::arg("data"), py::arg("scales"), py::arg("row_data"), py::arg("row_scales"));
  m.def("fp8_swiglu_backward", &fp8_swiglu_backward,
        "FP8 SwiGLU x probs backward: dh's (1, 128) and (128, 1) forms, a's (128, 1) form, "
        "dprobs' partial sums",
        py::arg("da"), py::arg("h_data"), py::arg("h_scales"), py::arg("probs"),
        py::arg("row_offsets"), py::arg("seg_offsets"), py::arg("block_offsets"),
        py::arg("num_blocks"), py::arg("padded_tokens"), py::arg("dh_data"),
        py::arg("dh_scales"), py::arg("dht_data"), py::arg("dht_scales"),
        py::arg("at_data"), py::arg("at_scales"), py::arg("partial"));
}

}  // namespace groupgrad
