// The FP8 grouped GEMMs' PyTorch binding: host checks, setup kernel(s) from
// splits, the CUTLASS kernel; all on torch's current stream, no host sync.
// Registered into the extension by binding.cpp (add_fp8_bindings).
//
// Legend: T tokens, E groups, K in_features, N out_features.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "binding_common.h"
#include "fp8_setup.h"
#include "launch_api.h"

namespace groupgrad {

//
// e4m3 operands with fp32 block scales (layouts: fp8_setup.h). Same flow as
// above: host checks, setup kernel(s) from splits, CUTLASS kernel, all on the
// current stream, no host sync.

bool aligned_16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

void check_fp8_data(const at::Tensor& t, const char* name, at::IntArrayRef sizes,
                    const at::Device& device) {
  TORCH_CHECK(t.is_cuda() && t.device() == device, "groupgrad: ", name, " must be on ", device,
              ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat8_e4m3fn, "groupgrad: ", name, " has dtype ",
              t.scalar_type(), ", expected Float8_e4m3fn");
  TORCH_CHECK(t.sizes() == sizes && t.is_contiguous(), "groupgrad: ", name,
              " must be contiguous of sizes ", sizes, ", got sizes ", t.sizes(), " strides ",
              t.strides());
  TORCH_CHECK(aligned_16(t.data_ptr()), "groupgrad: ", name, " must be 16-byte aligned");
}

void check_scales(const at::Tensor& t, const char* name, at::IntArrayRef sizes, bool transposed,
                  const at::Device& device) {
  TORCH_CHECK(t.is_cuda() && t.device() == device, "groupgrad: ", name, " must be on ", device,
              ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, "groupgrad: ", name, " has dtype ", t.scalar_type(),
              ", expected Float");
  const bool layout_ok = transposed ? (t.dim() == 2 && t.t().is_contiguous()) : t.is_contiguous();
  TORCH_CHECK(t.sizes() == sizes && layout_ok, "groupgrad: ", name, " must be of sizes ", sizes,
              transposed ? " with strides (1, rows)" : ", contiguous", ", got sizes ", t.sizes(),
              " strides ", t.strides());
  TORCH_CHECK(aligned_16(t.data_ptr()), "groupgrad: ", name, " must be 16-byte aligned");
}

namespace {

std::map<std::string, Fp8KernelVariant>& fp8_registry() {
  static std::map<std::string, Fp8KernelVariant> variants;
  return variants;
}

const Fp8KernelVariant& find_fp8_variant(const std::string& name) {
  auto it = fp8_registry().find(name);
  TORCH_CHECK(it != fp8_registry().end(), "groupgrad: FP8 kernel variant '", name,
              "' is not compiled into this build");
  return it->second;
}

// The variant must address the scales as the op's operands lay them out
// (fp8_setup.h) and write the output's element size.
void check_fp8_variant(const Fp8KernelVariant& variant, int scale_n, bool sfb_mn_major,
                       const at::Tensor& out) {
  TORCH_CHECK(variant.scale_n == scale_n && variant.sfb_mn_major == sfb_mn_major,
              "groupgrad: variant ", variant.name, " is not compiled for this FP8 op");
  TORCH_CHECK(variant.out_bytes == out.element_size(), "groupgrad: variant ", variant.name,
              " writes ", variant.out_bytes, "-byte elements but out has dtype ",
              out.scalar_type());
}

void check_multiple_of_128(int64_t value, const char* name) {
  TORCH_CHECK(value > 0 && value % 128 == 0, "groupgrad: ", name, " = ", value,
              " must be a positive multiple of 128 (the scale block)");
}

// The persistent scheduler's tile order (GemmLaunch.max_swizzle, .raster_along_n).
struct Fp8Raster {
  int max_swizzle = 1;
  bool along_n = false;
};

// The Python side checks the swizzle (Plan: 1, 2, 4 or 8).
Fp8Raster as_raster(int64_t max_swizzle, bool along_n) {
  return Fp8Raster{static_cast<int>(max_swizzle), along_n};
}

// Runs the setup and the CUTLASS kernel of one FP8 grouped GEMM. `sfa_floats`:
// the rows form's packed SFA copy; listed_*: listed wgrad outputs (else empty).
void run_fp8(const Fp8KernelVariant& variant, Fp8SetupParams setup, int groups,
             const std::vector<const char*>& listed_ptr, const std::vector<int64_t>& listed_ld,
             const at::Tensor& splits, const at::Tensor& anchor, bool accumulate,
             int64_t sfa_floats, const Fp8Raster& raster) {
  TORCH_CHECK(!accumulate || variant.has_source || variant.adds_to_d, "groupgrad: variant ",
              variant.name, " has no C operand and cannot accumulate");
  TORCH_CHECK(accumulate || !variant.adds_to_d, "groupgrad: variant ", variant.name,
              " adds to its output and cannot overwrite it");
  check_counts(splits, "splits", groups, anchor.device());
  // Overwriting wgrad zeroes empty groups even when no token is left.
  const bool zeroing = setup.form == Fp8Form::kSegments && !accumulate;
  if (groups == 0 || (setup.tokens == 0 && !zeroing)) {
    return;
  }
  const c10::cuda::CUDAGuard guard(anchor.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(anchor.device().index()).stream();

  Fp8GemmLaunch launch;
  GemmLaunch& gemm = launch.gemm;
  gemm.groups = groups;
  gemm.device_id = anchor.device().index();
  gemm.sm_count = multiprocessor_count(gemm.device_id);
  gemm.stream = stream;
  gemm.accumulate = accumulate;
  gemm.max_swizzle = raster.max_swizzle;
  gemm.raster_along_n = raster.along_n;
  const size_t workspace_bytes = variant.workspace_size(launch);

  // One caching-allocator block: CUTLASS's workspace, then the SFA copy, then
  // the per-group arrays (8 pointer-sized, then the shapes).
  const size_t array_bytes = round_up(static_cast<size_t>(groups), 2) * sizeof(int64_t);
  const size_t workspace_region = round_up(workspace_bytes, 128);
  const size_t sfa_region = round_up(static_cast<size_t>(sfa_floats) * sizeof(float), 128);
  const size_t shapes_bytes = round_up(static_cast<size_t>(groups) * 3 * sizeof(int), 16);
  const at::Tensor storage = at::empty(
      {static_cast<int64_t>(workspace_region + sfa_region + 8 * array_bytes + shapes_bytes)},
      at::TensorOptions().dtype(at::kByte).device(anchor.device()));
  char* cursor = static_cast<char*>(storage.data_ptr());
  auto take = [&](size_t bytes) {
    char* p = cursor;
    cursor += bytes;
    return p;
  };
  void* workspace = take(workspace_region);
  setup.sfa_packed = reinterpret_cast<float*>(take(sfa_region));
  setup.ptr_A = reinterpret_cast<const void**>(take(array_bytes));
  setup.ptr_B = reinterpret_cast<const void**>(take(array_bytes));
  setup.ptr_SFA = reinterpret_cast<const float**>(take(array_bytes));
  setup.ptr_SFB = reinterpret_cast<const float**>(take(array_bytes));
  setup.ptr_D = reinterpret_cast<void**>(take(array_bytes));
  setup.ld_A = reinterpret_cast<int64_t*>(take(array_bytes));
  setup.ld_B = reinterpret_cast<int64_t*>(take(array_bytes));
  setup.ld_D = reinterpret_cast<int64_t*>(take(array_bytes));
  setup.problem_shapes = reinterpret_cast<int*>(take(shapes_bytes));
  setup.splits = splits.data_ptr<int64_t>();
  // The GEMM reads the arrays that the setup kernel writes.
  gemm.problem_shapes = setup.problem_shapes;
  gemm.ptr_A = setup.ptr_A;
  gemm.ld_A = setup.ld_A;
  gemm.ptr_B = setup.ptr_B;
  gemm.ld_B = setup.ld_B;
  gemm.ptr_D = setup.ptr_D;
  gemm.ld_D = setup.ld_D;
  launch.ptr_SFA = setup.ptr_SFA;
  launch.ptr_SFB = setup.ptr_SFB;

  const cudaError_t err =
      launch_fp8_setup(setup, groups, listed_ptr.data(), listed_ld.data(), stream);
  TORCH_CHECK(err == cudaSuccess, "groupgrad: FP8 setup kernel launch failed: ",
              cudaGetErrorString(err));
  if (setup.tokens == 0) {
    return;  // every group is empty: nothing for the GEMM to do
  }
  const char* error = variant.run(launch, workspace);
  TORCH_CHECK(error == nullptr, "groupgrad: ", variant.name, ": ", error);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// fprop: out_TN[rows of e] = a_TK[rows of e] @ b[e]^T with b (E, N, K) weights;
// dgrad: out_TK[rows of e] = a_TN[rows of e] @ w[e] with b (E, K, N) = w^T.
// Per group: out (m_e, n) = a (m_e, k) @ b_e (n, k)^T (fp8_setup.h, rows form).
void fp8_rows(bool fprop, const at::Tensor& a, const at::Tensor& a_scales, const at::Tensor& b,
              const at::Tensor& w_scales, const at::Tensor& splits_E, const at::Tensor& out,
              const std::string& variant_name, const Fp8Raster& raster) {
  const Fp8KernelVariant& variant = find_fp8_variant(variant_name);
  const char* a_name = fprop ? "x_data" : "dy_data";
  TORCH_CHECK(a.dim() == 2 && b.dim() == 3 && out.dim() == 2, "groupgrad: ", a_name,
              " and out must be 2-D and ", fprop ? "w_data" : "wt_data", " 3-D, got ", a.sizes(),
              ", ", out.sizes(), " and ", b.sizes());
  const at::Device device = a.device();
  const int64_t T = a.size(0), k = a.size(1), E = b.size(0), n = out.size(1);
  check_multiple_of_128(k, fprop ? "K (x_data's columns)" : "N (dy_data's columns)");
  check_multiple_of_128(n, fprop ? "N (out's columns)" : "K (out's columns)");
  TORCH_CHECK(T < (int64_t{1} << 31) && n < (int64_t{1} << 31) && k < (int64_t{1} << 31),
              "groupgrad: FP8 extents must fit int32, got T = ", T);
  check_fp8_data(a, a_name, {T, k}, device);
  check_scales(a_scales, fprop ? "x_scales" : "dy_scales", {T, k / 128}, true, device);
  check_fp8_data(b, fprop ? "w_data" : "wt_data", {E, n, k}, device);
  // w_scales is (E, N/128, K/128): dgrad's GEMM n is K and its k is N.
  check_scales(w_scales, "w_scales",
               fprop ? at::IntArrayRef{E, n / 128, k / 128} : at::IntArrayRef{E, k / 128, n / 128},
               false, device);
  const bool out_ok = out.is_cuda() && out.device() == device && out.size(0) == T &&
                      out.is_contiguous() && aligned_16(out.data_ptr());
  TORCH_CHECK(out_ok,
              "groupgrad: out must be a contiguous, 16-byte aligned (", T, ", ", n,
              ") tensor on ", device, ", got sizes ", out.sizes(), " strides ", out.strides(),
              " on ", out.device());
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf,
              "groupgrad: out has dtype ", out.scalar_type(), ", expected BFloat16 or Half");
  check_fp8_variant(variant, 128, !fprop, out);
  Fp8SetupParams setup;
  setup.form = Fp8Form::kRows;
  setup.tokens = T;
  setup.n = n;
  setup.k = k;
  setup.a = static_cast<const uint8_t*>(a.data_ptr());
  setup.a_scales = a_scales.data_ptr<float>();
  setup.b = static_cast<const uint8_t*>(b.data_ptr());
  setup.b_scales = w_scales.data_ptr<float>();
  setup.d = static_cast<char*>(out.data_ptr());
  setup.out_bytes = element_bytes(out);
  run_fp8(variant, setup, static_cast<int>(E), {}, {}, splits_E, a, /*accumulate=*/false,
          T * (k / 128), raster);
}

}  // namespace

bool register_fp8_variant(const Fp8KernelVariant& variant) {
  fp8_registry().emplace(variant.name, variant);
  return true;
}

void fp8_fprop(const at::Tensor& x_data, const at::Tensor& x_scales, const at::Tensor& w_data,
               const at::Tensor& w_scales, const at::Tensor& splits_E, const at::Tensor& out,
               const std::string& variant_name, int64_t max_swizzle, bool raster_along_n) {
  fp8_rows(true, x_data, x_scales, w_data, w_scales, splits_E, out, variant_name,
           as_raster(max_swizzle, raster_along_n));
}

void fp8_dgrad(const at::Tensor& dy_data, const at::Tensor& dy_scales, const at::Tensor& wt_data,
               const at::Tensor& w_scales, const at::Tensor& splits_E, const at::Tensor& out,
               const std::string& variant_name, int64_t max_swizzle, bool raster_along_n) {
  fp8_rows(false, dy_data, dy_scales, wt_data, w_scales, splits_E, out, variant_name,
           as_raster(max_swizzle, raster_along_n));
}

// out[e] = dy_e^T @ x_e from the segments forms (accumulate: out[e] += ...);
// overwriting zeroes the outputs of experts without tokens.
void fp8_wgrad(const at::Tensor& dy_data, const at::Tensor& dy_scales,
               const at::Tensor& dy_row_offsets, const at::Tensor& x_data,
               const at::Tensor& x_scales, const at::Tensor& x_row_offsets,
               const at::Tensor& splits_E, int64_t tokens,
               const std::vector<at::Tensor>& out, bool accumulate,
               const std::string& variant_name, int64_t max_swizzle, bool raster_along_n) {
  const Fp8Raster raster = as_raster(max_swizzle, raster_along_n);
  const Fp8KernelVariant& variant = find_fp8_variant(variant_name);
  TORCH_CHECK(!out.empty(), "groupgrad: fp8_wgrad needs at least one output");
  TORCH_CHECK(dy_data.dim() == 2 && x_data.dim() == 2 && dy_scales.dim() == 2,
              "groupgrad: dy_data, x_data and dy_scales must be 2-D, got ", dy_data.sizes(), ", ",
              x_data.sizes(), " and ", dy_scales.sizes());
  const at::Device device = dy_data.device();
  const int64_t N = dy_data.size(0), K = x_data.size(0), Tp = dy_data.size(1);
  const int64_t NB = dy_scales.size(0);
  check_multiple_of_128(N, "N (dy_data's rows)");
  check_multiple_of_128(K, "K (x_data's rows)");
  TORCH_CHECK(tokens >= 0 && Tp >= tokens && Tp % 16 == 0, "groupgrad: dy_data has ", Tp,
              " token columns, expected a multiple of 16 of at least tokens = ", tokens);
  TORCH_CHECK(NB >= (tokens + 127) / 128, "groupgrad: dy_scales has ", NB,
              " rows, expected at least ceil(tokens / 128) = ", (tokens + 127) / 128);
  TORCH_CHECK(N < (int64_t{1} << 31) && K < (int64_t{1} << 31) && Tp < (int64_t{1} << 31),
              "groupgrad: FP8 extents must fit int32");
  check_fp8_data(dy_data, "dy_data", {N, Tp}, device);
  check_fp8_data(x_data, "x_data", {K, Tp}, device);
  check_scales(dy_scales, "dy_scales", {NB, N}, false, device);
  check_scales(x_scales, "x_scales", {NB, K}, false, device);
  const at::ScalarType out_dtype = out[0].scalar_type();
  check_group(out, "out", N, K, out_dtype, device);
  check_fp8_variant(variant, 1, true, out[0]);
  const int64_t elem = out[0].element_size();
  Fp8SetupParams setup;
  std::vector<const char*> listed_ptr;
  std::vector<int64_t> listed_ld;
  if (is_packed(out)) {
    const at::Tensor& t = out[0];
    TORCH_CHECK(aligned_16(t.data_ptr()) && (t.stride(0) * elem) % 16 == 0 &&
                    (t.stride(1) * elem) % 16 == 0,
                "groupgrad: out must be 16-byte aligned with 16-byte multiple strides, got "
                "strides ", t.strides());
    setup.packed_base = static_cast<const char*>(t.data_ptr());
    setup.packed_stride_bytes = t.stride(0) * elem;
    setup.packed_ld = t.stride(1);
  } else {
    for (size_t i = 0; i < out.size(); ++i) {
      TORCH_CHECK(aligned_16(out[i].data_ptr()) && (out[i].stride(0) * elem) % 16 == 0,
                  "groupgrad: out[", i, "] must be 16-byte aligned with a 16-byte multiple "
                  "row stride, got strides ", out[i].strides());
      listed_ptr.push_back(static_cast<const char*>(out[i].data_ptr()));
      listed_ld.push_back(out[i].stride(0));
    }
  }
  const int64_t E = group_count(out);
  TORCH_CHECK(E < (int64_t{1} << 31), "groupgrad: too many groups: ", E);
  check_counts(dy_row_offsets, "dy_row_offsets", E + 1, device);
  check_counts(x_row_offsets, "x_row_offsets", E + 1, device);
  setup.form = Fp8Form::kSegments;
  setup.a_row_offsets = dy_row_offsets.data_ptr<int64_t>();
  setup.b_row_offsets = x_row_offsets.data_ptr<int64_t>();
  setup.tokens = tokens;
  setup.out_features = N;
  setup.in_features = K;
  setup.padded_tokens = Tp;
  setup.scale_rows = NB;
  setup.a = static_cast<const uint8_t*>(dy_data.data_ptr());
  setup.a_scales = dy_scales.data_ptr<float>();
  setup.b = static_cast<const uint8_t*>(x_data.data_ptr());
  setup.b_scales = x_scales.data_ptr<float>();
  setup.out_bytes = static_cast<int>(elem);
  setup.zero_empty_outputs = !accumulate;
  run_fp8(variant, setup, static_cast<int>(E), listed_ptr, listed_ld, splits_E, dy_data,
          accumulate, 0, raster);
}

// The (128, 1) form of `x` (T, C) into data (C, Tp) and scales (NB, C) and,
// when row_data has elements, the (1, 128) form into row_data (T, C) and
// row_scales (C / 128, T); the offsets are (E + 1,) int64 running sums
// (_fp8_ops.offsets_ref). Every output is written (fp8_quantize.cu).
std::vector<std::string> fp8_variant_names() {
  std::vector<std::string> names;
  for (const auto& entry : fp8_registry()) {
    names.push_back(entry.first);
  }
  return names;
}

void add_fp8_bindings(py::module& m) {
  m.def("fp8_fprop", &fp8_fprop, "grouped FP8 fprop", py::arg("x_data"),
        py::arg("x_scales"), py::arg("w_data"), py::arg("w_scales"), py::arg("splits"),
        py::arg("out"), py::arg("variant"), py::arg("max_swizzle") = 1,
        py::arg("raster_along_n") = false);
  m.def("fp8_dgrad", &fp8_dgrad, "grouped FP8 dgrad", py::arg("dy_data"),
        py::arg("dy_scales"), py::arg("wt_data"), py::arg("w_scales"), py::arg("splits"),
        py::arg("out"), py::arg("variant"), py::arg("max_swizzle") = 1,
        py::arg("raster_along_n") = false);
  m.def("fp8_wgrad", &fp8_wgrad, "grouped FP8 wgrad", py::arg("dy_data"),
        py::arg("dy_scales"), py::arg("dy_row_offsets"), py::arg("x_data"), py::arg("x_scales"),
        py::arg("x_row_offsets"), py::arg("splits"),
        py::arg("tokens"), py::arg("out"), py::arg("accumulate"), py::arg("variant"),
        py::arg("max_swizzle") = 1, py::arg("raster_along_n") = false);
}

}  // namespace groupgrad
