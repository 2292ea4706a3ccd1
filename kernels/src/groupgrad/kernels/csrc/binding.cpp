// PyTorch binding of the CUTLASS grouped GEMMs: argument marshalling, device
// setup launch, workspace from the caching allocator, launch on torch's
// current stream. Inputs arrive validated by groupgrad.kernels (Python); the
// TORCH_CHECKs here only guard the invariants the kernels rely on.
//
// Legend: T tokens, E groups, K in_features, N out_features.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <string>
#include <vector>

#include "binding_common.h"
#include "grouped_setup.h"
#include "launch_api.h"

namespace groupgrad {

// Read once per device (a driver query on every call costs host time).
int multiprocessor_count(int device) {
  static std::atomic<int> counts[kMaxDevices] = {};
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached && counts[device].load(std::memory_order_relaxed) > 0) {
    return counts[device].load(std::memory_order_relaxed);
  }
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  if (cached) {
    counts[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

int element_bytes(const at::Tensor& t) { return static_cast<int>(t.element_size()); }

// A group of E (N, K) matrices as the Python side hands it over: packed, one
// (E, N, K) tensor in a one-element list, or listed, E separate matrices.
bool is_packed(const std::vector<at::Tensor>& group) {
  return group.size() == 1 && group[0].dim() == 3;
}

int64_t group_count(const std::vector<at::Tensor>& group) {
  return is_packed(group) ? group[0].size(0) : static_cast<int64_t>(group.size());
}

void check_counts(const at::Tensor& t, const char* name, int64_t elements,
                  const at::Device& device) {
  TORCH_CHECK(t.is_cuda() && t.device() == device, "groupgrad: ", name, " must be on ", device,
              ", got ", t.device());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == elements && t.scalar_type() == at::kLong &&
                  t.is_contiguous(),
              "groupgrad: ", name, " must be a contiguous int64 tensor of ", elements,
              " elements, got ", t.sizes(), " ", t.scalar_type());
}

// Checks a group of (rows, cols) matrices, packed or listed (see is_packed).
void check_group(const std::vector<at::Tensor>& group, const char* name, int64_t rows,
                 int64_t cols, at::ScalarType dtype, const at::Device& device) {
  if (is_packed(group)) {
    const at::Tensor& t = group[0];
    TORCH_CHECK(t.is_cuda() && t.device() == device, "groupgrad: ", name, " must be on ", device,
                ", got ", t.device());
    TORCH_CHECK(t.size(1) == rows && t.size(2) == cols && t.stride(2) == 1, "groupgrad: ", name,
                " must be (E, ", rows, ", ", cols, ") with row-major matrices, got sizes ",
                t.sizes(), " strides ", t.strides());
    TORCH_CHECK(t.scalar_type() == dtype, "groupgrad: ", name, " has dtype ", t.scalar_type(),
                ", expected ", dtype);
    return;
  }
  for (size_t i = 0; i < group.size(); ++i) {
    const at::Tensor& t = group[i];
    const bool ok = t.is_cuda() && t.device() == device && t.dim() == 2 && t.stride(1) == 1 &&
                    t.size(0) == rows && t.size(1) == cols && t.scalar_type() == dtype;
    TORCH_CHECK(ok, "groupgrad: ", name, "[", i, "] must be a row-major (", rows, ", ", cols,
                ") ", dtype, " matrix on ", device, ", got sizes ", t.sizes(), " strides ",
                t.strides(), " ", t.scalar_type(), " on ", t.device());
  }
}

namespace {

std::map<std::string, KernelVariant>& registry() {
  static std::map<std::string, KernelVariant> variants;
  return variants;
}

const KernelVariant& find_variant(const std::string& name) {
  auto it = registry().find(name);
  TORCH_CHECK(it != registry().end(), "groupgrad: kernel variant '", name,
              "' is not compiled into this build");
  return it->second;
}



// Device arrays for CUTLASS's arguments, carved from one caching-allocator block
// that also holds CUTLASS's workspace (first, for the tensor maps' alignment).
struct ArgumentBuffers {
  at::Tensor storage;
  void* workspace = nullptr;
  int* problem_shapes = nullptr;
  const void** ptr_A = nullptr;
  const void** ptr_B = nullptr;
  void** ptr_D = nullptr;
  int64_t* ld_A = nullptr;
  int64_t* ld_B = nullptr;
  int64_t* ld_D = nullptr;
};


ArgumentBuffers allocate_arguments(int groups, size_t workspace_bytes, const at::Device& device) {
  const size_t rounded_groups = round_up(static_cast<size_t>(groups), 2);
  const size_t array_bytes = rounded_groups * sizeof(int64_t);
  const size_t workspace_region = round_up(workspace_bytes, 128);
  const size_t shapes_bytes = round_up(rounded_groups * 3 * sizeof(int), 16);
  const size_t total = workspace_region + 6 * array_bytes + shapes_bytes;
  ArgumentBuffers b;
  b.storage = at::empty({static_cast<int64_t>(total)},
                        at::TensorOptions().dtype(at::kByte).device(device));
  char* base = static_cast<char*>(b.storage.data_ptr());
  b.workspace = workspace_bytes > 0 ? base : nullptr;
  char* cursor = base + workspace_region;
  auto take = [&](size_t bytes) {
    char* p = cursor;
    cursor += bytes;
    return p;
  };
  b.ptr_A = reinterpret_cast<const void**>(take(array_bytes));
  b.ptr_B = reinterpret_cast<const void**>(take(array_bytes));
  b.ptr_D = reinterpret_cast<void**>(take(array_bytes));
  b.ld_A = reinterpret_cast<int64_t*>(take(array_bytes));
  b.ld_B = reinterpret_cast<int64_t*>(take(array_bytes));
  b.ld_D = reinterpret_cast<int64_t*>(take(array_bytes));
  b.problem_shapes = reinterpret_cast<int*>(take(shapes_bytes));
  return b;
}

// Points a GemmLaunch (reads) or SetupParams (writes) at the argument arrays.
template <class Arrays>
void point_at(const ArgumentBuffers& b, Arrays& arrays) {
  arrays.problem_shapes = b.problem_shapes;
  arrays.ptr_A = b.ptr_A;
  arrays.ld_A = b.ld_A;
  arrays.ptr_B = b.ptr_B;
  arrays.ld_B = b.ld_B;
  arrays.ptr_D = b.ptr_D;
  arrays.ld_D = b.ld_D;
}

struct Tuning {
  bool raster_along_n = false;
  int max_swizzle = 1;
};


// Runs setup (chunked) and the CUTLASS kernel. `group` holds the weights
// (fprop, dgrad) or the outputs (wgrad), one (N, K) matrix per group, packed
// or listed (see is_packed).
void run_grouped(const KernelVariant& variant, SetupParams setup,
                 const std::vector<at::Tensor>& group, const at::Tensor& splits,
                 const at::Tensor& anchor, const Tuning& tuning, bool accumulate) {
  TORCH_CHECK(!accumulate || variant.has_source, "groupgrad: variant ", variant.name,
              " has no C operand and cannot accumulate");
  const int64_t group_total = group_count(group);
  TORCH_CHECK(group_total < (int64_t{1} << 31), "groupgrad: too many groups: ", group_total);
  const int groups = static_cast<int>(group_total);
  check_counts(splits, "splits", groups, anchor.device());
  if (groups == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(anchor.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(anchor.device().index()).stream();

  GemmLaunch launch;
  launch.groups = groups;
  launch.device_id = anchor.device().index();
  launch.sm_count = multiprocessor_count(launch.device_id);
  launch.raster_along_n = tuning.raster_along_n;
  launch.max_swizzle = tuning.max_swizzle;
  launch.stream = stream;
  launch.accumulate = accumulate;
  const size_t workspace_bytes = variant.workspace_size(launch);

  ArgumentBuffers buffers = allocate_arguments(groups, workspace_bytes, anchor.device());
  point_at(buffers, launch);  // the GEMM reads the arrays that the setup kernel writes
  point_at(buffers, setup);
  setup.splits = splits.data_ptr<int64_t>();
  setup.num_groups = groups;
  const bool packed = is_packed(group);
  if (packed) {
    const at::Tensor& t = group[0];
    setup.packed_base = static_cast<const char*>(t.data_ptr());
    setup.packed_stride_bytes = t.stride(0) * t.element_size();
    setup.packed_ld = t.stride(1);
  }
  for (int begin = 0; begin < groups; begin += kMaxGroupsPerLaunch) {
    setup.group_begin = begin;
    setup.group_count = std::min(kMaxGroupsPerLaunch, groups - begin);
    for (int i = 0; !packed && i < setup.group_count; ++i) {
      const at::Tensor& t = group[begin + i];
      setup.group_ptr[i] = static_cast<const char*>(t.data_ptr());
      setup.group_ld[i] = t.stride(0);
    }
    const cudaError_t err = launch_grouped_setup(setup, stream);
    TORCH_CHECK(err == cudaSuccess, "groupgrad: grouped setup kernel launch failed: ",
                cudaGetErrorString(err));
  }

  if (setup.tokens == 0) {
    return;  // every group is empty: nothing for the GEMM to do
  }
  const char* error = variant.run(launch, buffers.workspace);
  TORCH_CHECK(error == nullptr, "groupgrad: ", variant.name, ": ", error);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_matrix(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.is_cuda() && t.device() == device, "groupgrad: ", name, " must be on ", device,
              ", got ", t.device());
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, "groupgrad: ", name,
              " must be a 2-D row-major matrix, got sizes ", t.sizes(), " strides ", t.strides());
}


Tuning make_tuning(bool raster_along_n, int64_t max_swizzle) {
  TORCH_CHECK(max_swizzle == 1 || max_swizzle == 2 || max_swizzle == 4 || max_swizzle == 8,
              "groupgrad: max_swizzle must be 1, 2, 4 or 8, got ", max_swizzle);
  return Tuning{raster_along_n, static_cast<int>(max_swizzle)};
}

}  // namespace

bool register_variant(const KernelVariant& variant) {
  registry().emplace(variant.name, variant);
  return true;
}

// fprop: out_TN[rows of e] = a = x_TK[rows of e] @ w[e]^T
// dgrad: out_TK[rows of e] = a = dy_TN[rows of e] @ w[e]
// (a's rows grouped by expert, each times its weight, into the row-grouped out).
void row_gemm(GemmOp op, const at::Tensor& a, const std::vector<at::Tensor>& w,
              const at::Tensor& splits_E, const at::Tensor& out, const std::string& variant_name,
              bool raster_along_n, int64_t max_swizzle) {
  const KernelVariant& variant = find_variant(variant_name);
  const bool fprop = op == GemmOp::kFprop;
  check_matrix(a, fprop ? "x" : "dy", a.device());
  check_matrix(out, "out", a.device());
  const int64_t out_features = fprop ? out.size(1) : a.size(1);  // N
  const int64_t in_features = fprop ? a.size(1) : out.size(1);   // K
  check_group(w, "weights", out_features, in_features, a.scalar_type(), a.device());
  SetupParams setup;
  setup.op = op;
  setup.tokens = a.size(0);
  setup.out_features = out_features;
  setup.in_features = in_features;
  setup.dense_a = static_cast<const char*>(a.data_ptr());
  setup.ld_dense_a = a.stride(0);
  setup.dense_d = static_cast<char*>(out.data_ptr());
  setup.ld_dense_d = out.stride(0);
  setup.in_bytes = element_bytes(a);
  setup.out_bytes = element_bytes(out);
  run_grouped(variant, setup, w, splits_E, a, make_tuning(raster_along_n, max_swizzle),
              /*accumulate=*/false);
}

void fprop(const at::Tensor& x_TK, const std::vector<at::Tensor>& w, const at::Tensor& splits_E,
           const at::Tensor& y_TN, const std::string& variant_name, bool raster_along_n,
           int64_t max_swizzle) {
  row_gemm(GemmOp::kFprop, x_TK, w, splits_E, y_TN, variant_name, raster_along_n, max_swizzle);
}

void dgrad(const at::Tensor& dy_TN, const std::vector<at::Tensor>& w, const at::Tensor& splits_E,
           const at::Tensor& dx_TK, const std::string& variant_name, bool raster_along_n,
           int64_t max_swizzle) {
  row_gemm(GemmOp::kDgrad, dy_TN, w, splits_E, dx_TK, variant_name, raster_along_n, max_swizzle);
}

// out[e] = dy_TN[rows of e]^T @ x_TK[rows of e]  (accumulate: out[e] += ...)
void wgrad(const at::Tensor& dy_TN, const at::Tensor& x_TK, const at::Tensor& splits_E,
           const std::vector<at::Tensor>& out, bool accumulate, const std::string& variant_name,
           bool raster_along_n, int64_t max_swizzle) {
  const KernelVariant& variant = find_variant(variant_name);
  check_matrix(dy_TN, "dy", dy_TN.device());
  check_matrix(x_TK, "x", dy_TN.device());
  TORCH_CHECK(!out.empty(), "groupgrad: wgrad needs at least one output");
  check_group(out, "out", dy_TN.size(1), x_TK.size(1), out[0].scalar_type(), dy_TN.device());
  SetupParams setup;
  setup.op = GemmOp::kWgrad;
  setup.tokens = dy_TN.size(0);
  setup.out_features = dy_TN.size(1);
  setup.in_features = x_TK.size(1);
  setup.dense_a = static_cast<const char*>(dy_TN.data_ptr());
  setup.ld_dense_a = dy_TN.stride(0);
  setup.dense_b = static_cast<const char*>(x_TK.data_ptr());
  setup.ld_dense_b = x_TK.stride(0);
  setup.in_bytes = element_bytes(dy_TN);
  setup.out_bytes = element_bytes(out[0]);
  setup.zero_empty_outputs = !accumulate;
  run_grouped(variant, setup, out, splits_E, dy_TN, make_tuning(raster_along_n, max_swizzle),
              accumulate);
}

// What the Python checks of a listed group read from its members (see
// groupgrad/kernels/_group.py: listed_facts), in one pass: None when a member is not
// exactly a torch.Tensor or nn.Parameter (Python then reads them itself), else
// (alike, requires_grad, starts). alike: every member is dense (strided, not
// nested), contiguous, with storage, and has the first member's sizes, dtype
// and device; requires_grad: some member requires grad; starts: the members'
// data addresses in ascending order (empty unless alike). Must answer exactly
// what the Python reader does.
py::object listed_group_facts(const py::list& members) {
  const Py_ssize_t count = PyList_GET_SIZE(members.ptr());
  for (Py_ssize_t i = 0; i < count; ++i) {
    if (!THPVariable_CheckExact(PyList_GET_ITEM(members.ptr(), i))) {
      return py::none();
    }
  }
  bool alike = count > 0;
  bool requires_grad = false;
  std::vector<int64_t> starts;
  starts.reserve(static_cast<size_t>(count));
  for (Py_ssize_t i = 0; i < count && alike; ++i) {
    const at::Tensor& t = THPVariable_Unpack(PyList_GET_ITEM(members.ptr(), i));
    const at::Tensor& first = THPVariable_Unpack(PyList_GET_ITEM(members.ptr(), 0));
    alike = t.layout() == at::kStrided && !t.is_nested() && t.sizes() == first.sizes() &&
            t.scalar_type() == first.scalar_type() && t.device() == first.device() &&
            t.is_contiguous() && t.has_storage();
    requires_grad = requires_grad || t.requires_grad();
    if (alike) {
      starts.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr())));
    }
  }
  if (!alike) {
    starts.clear();
  }
  std::sort(starts.begin(), starts.end());
  return py::make_tuple(alike, requires_grad, starts);
}

std::vector<std::string> variant_names() {
  std::vector<std::string> names;
  for (const auto& entry : registry()) {
    names.push_back(entry.first);
  }
  for (const std::string& name : fp8_variant_names()) {
    names.push_back(name);
  }
  return names;
}

}  // namespace groupgrad

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "groupgrad CUTLASS sm_90a grouped GEMMs (internal; use groupgrad.kernels)";
  m.def("fprop", &groupgrad::fprop, "grouped fprop", py::arg("x"), py::arg("weights"),
        py::arg("splits"), py::arg("out"), py::arg("variant"), py::arg("raster_along_n"),
        py::arg("max_swizzle"));
  m.def("dgrad", &groupgrad::dgrad, "grouped dgrad", py::arg("dy"), py::arg("weights"),
        py::arg("splits"), py::arg("out"), py::arg("variant"), py::arg("raster_along_n"),
        py::arg("max_swizzle"));
  m.def("wgrad", &groupgrad::wgrad, "grouped wgrad", py::arg("dy"), py::arg("x"),
        py::arg("splits"), py::arg("out"), py::arg("accumulate"), py::arg("variant"), py::arg("raster_along_n"),
        py::arg("max_swizzle"));
  groupgrad::add_fp8_bindings(m);
  groupgrad::add_fp8_elementwise_bindings(m);
  m.def("variants", &groupgrad::variant_names, "names of the compiled kernel variants");
  m.def("listed_group_facts", &groupgrad::listed_group_facts,
        "(alike, requires_grad, sorted addresses) of a listed group, or None", py::arg("members"));
}
