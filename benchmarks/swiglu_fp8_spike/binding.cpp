// The spike kernel's PyTorch wrapper (run_spike.py builds it with swiglu_backward_spike.cu).
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>
#include <cstdint>
namespace swb {
struct Params {
  const void* da = nullptr; bool bf16 = true;
  const uint8_t* h_data = nullptr; const float* h_scales = nullptr; const float* probs = nullptr;
  const int64_t* row_offsets = nullptr; const int64_t* seg_offsets = nullptr; const int64_t* block_offsets = nullptr;
  int64_t T = 0, F = 0, E = 0, NB = 0, Tp = 0;
  uint8_t* dh_data = nullptr; float* dh_scales = nullptr;
  uint8_t* dht_data = nullptr; float* dht_scales = nullptr;
  uint8_t* at_data = nullptr; float* at_scales = nullptr;
  float* partial = nullptr;
};
cudaError_t launch(const Params& p, cudaStream_t stream);
}
std::vector<at::Tensor> backward(const at::Tensor& da, const at::Tensor& h_data, const at::Tensor& h_scales,
    const c10::optional<at::Tensor>& probs, const at::Tensor& row, const at::Tensor& seg, const at::Tensor& blk,
    int64_t NB, int64_t Tp, bool dh_rows, bool dh_tokens, bool a_tokens) {
  const int64_t T = da.size(0), F = da.size(1), E = row.numel() - 1;
  auto f8 = da.options().dtype(at::kFloat8_e4m3fn); auto f32 = da.options().dtype(at::kFloat);
  auto none8 = at::empty({0}, f8); auto none32 = at::empty({0}, f32);
  at::Tensor dh = dh_rows ? at::empty({T, 2 * F}, f8) : none8, dhs = dh_rows ? at::empty({2 * F / 128, T}, f32) : none32;
  at::Tensor dht = dh_tokens ? at::empty({2 * F, Tp}, f8) : none8, dhts = dh_tokens ? at::empty({NB, 2 * F}, f32) : none32;
  at::Tensor at_ = a_tokens ? at::empty({F, Tp}, f8) : none8, ats = a_tokens ? at::empty({NB, F}, f32) : none32;
  at::Tensor pf, partial;
  if (probs) { pf = probs->to(at::kFloat).contiguous(); partial = at::empty({F / 128, T}, f32); }
  swb::Params p;
  p.da = da.data_ptr(); p.bf16 = da.scalar_type() == at::kBFloat16;
  p.h_data = static_cast<const uint8_t*>(h_data.data_ptr()); p.h_scales = h_scales.data_ptr<float>();
  p.probs = probs ? pf.data_ptr<float>() : nullptr;
  p.row_offsets = row.data_ptr<int64_t>(); p.seg_offsets = seg.data_ptr<int64_t>(); p.block_offsets = blk.data_ptr<int64_t>();
  p.T = T; p.F = F; p.E = E; p.NB = NB; p.Tp = Tp;
  if (dh_rows) { p.dh_data = static_cast<uint8_t*>(dh.data_ptr()); p.dh_scales = dhs.data_ptr<float>(); }
  if (dh_tokens) { p.dht_data = static_cast<uint8_t*>(dht.data_ptr()); p.dht_scales = dhts.data_ptr<float>(); }
  if (a_tokens) { p.at_data = static_cast<uint8_t*>(at_.data_ptr()); p.at_scales = ats.data_ptr<float>(); }
  if (probs) p.partial = partial.data_ptr<float>();
  C10_CUDA_CHECK(swb::launch(p, at::cuda::getCurrentCUDAStream()));
  at::Tensor dprobs = probs ? (T && F ? partial.sum(0).to(probs->scalar_type()) : at::zeros_like(*probs)) : none32;
  return {dh, dhs, dht, dhts, at_, ats, dprobs};
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("backward", &backward); }
