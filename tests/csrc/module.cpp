// The test-only extension ffn_ext_testing: what the tests run on the host in place of the CUDA kernels, from the
// kernels' own headers. tests/native.py builds it (CI's .ci/env before the tests; a test run builds it when it is
// missing or older than its sources); the ffn_ext package and its wheel do not contain it.
//
// Three translation units, in two kinds (testing.h):
// - this one, on the full torch API: the pybind11 module (torch's tensor and STL casters come from
//   torch/csrc/utils/pybind.h, not torch/extension.h, which adds the whole C++ frontend, torch/all.h, to parse),
//   host_math.cpp (the element math, which needs no glue), and the emulations' Python entry points below;
// - emulate_rows.cpp and emulate_quant.cpp (with the library's checks and allocation, csrc/shapes.cpp and
//   csrc/quant_recipe.cpp): the CUDA ops' glue (row_ops.h, quant_ops.h) on torch's stable API at the library's target
//   version, exactly as libffn_ext_cuda.so compiles it, with host launchers. The stable headers' inline code
//   depends on the target version, and c10/ATen refuse it, so those TUs include no full-API header and this one no
//   stable header: at::Tensor becomes an AtenTensorHandle here (the shim's handle is an at::Tensor*), and the
//   stable TUs hand their outputs back as new handles.
// Neither registers an op.
#include <torch/csrc/inductor/aoti_torch/utils.h>  // at::Tensor <-> AtenTensorHandle
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <vector>

#include "host_math.cpp"
#include "testing.h"

namespace ffn_ext {
namespace testing {
namespace {

// Tensors to owned handles (the callee takes them over), after the check every emulation makes: CPU tensors.
Handles to_handles(const char* fn, const std::vector<at::Tensor>& in) {
  for (const auto& t : in) {
    if (!t.device().is_cpu()) usage_error(fn, ": inputs must be CPU tensors");
  }
  Handles h;
  for (const auto& t : in) h.push_back(torch::aot_inductor::new_tensor_handle(at::Tensor(t)));
  return h;
}
std::vector<at::Tensor> from_handles(const Handles& h) {
  std::vector<at::Tensor> out;
  for (AtenTensorHandle p : h) {
    out.push_back(*torch::aot_inductor::tensor_handle_to_tensor_pointer(p));
    aoti_torch_delete_tensor_object(p);
  }
  return out;
}

// A test function's Python face: a bad call of it (UsageError) is a ValueError; what the glue throws is left as it
// is, std::runtime_error -> RuntimeError with the guard's message, what the CUDA kernels raise.
template <class Fn>
auto python_errors(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const UsageError& e) {
    throw pybind11::value_error(e.what());
  }
}

std::vector<at::Tensor> emulate_cuda_py(const std::string& op, const std::vector<at::Tensor>& in, int sms,
                                        const Doubles& params, const std::string& layout) {
  return python_errors(
      [&] { return from_handles(emulate_cuda(op, to_handles("_emulate_cuda", in), sms, params, layout)); });
}

std::vector<at::Tensor> emulate_quant_py(const std::string& op, const std::vector<at::Tensor>& in,
                                         const Doubles& params, const std::string& layout, const std::string& format,
                                         int64_t group_size, bool pow2, bool e8m0, bool column,
                                         const std::string& scaling, std::optional<double> static_scale) {
  return python_errors([&] {
    if (format != "e4m3fn" && format != "e5m2") usage_error("_emulate_quant: format must be e4m3fn or e5m2");
    const auto dtype = format == "e5m2" ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn;
    const auto scale_dtype = e8m0 ? at::kFloat8_e8m0fnu : at::kFloat;
    return from_handles(emulate_quant(op, to_handles("_emulate_quant", in), params, layout, static_cast<int32_t>(dtype),
                                      scaling, group_size, pow2, static_cast<int32_t>(scale_dtype),
                                      column ? "column" : "row", static_scale));
  });
}

std::vector<at::Tensor> emulate_cache_py(const std::string& op, const std::vector<at::Tensor>& in,
                                         const Doubles& params, int64_t group_size) {
  return python_errors(
      [&] { return from_handles(emulate_cache(op, to_handles("_emulate_cache", in), params, group_size)); });
}

}  // namespace
}  // namespace testing
}  // namespace ffn_ext

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using ffn_ext::testing::Doubles;
  m.doc() =
      "ffn_ext's test-only functions (tests/native.py): the kernels' element math and launches run on the host, "
      "on CPU tensors";
  ffn_ext::testing::add_host_math(m);
  m.def("_emulate_cuda", &ffn_ext::testing::emulate_cuda_py, py::arg("op"), py::arg("inputs"), py::arg("sms") = 132,
        py::arg("params") = Doubles{}, py::arg("layout") = "concat",
        "op's CUDA kernel (row_ops.h's checks, outputs and problem, rows.h's launch shape and per-thread code) with "
        "its launch emulated on the host with CPU tensors, for a GPU with `sms` multiprocessors. The op's guards "
        "raise what the CUDA kernel raises (RuntimeError); a bad call of this function raises ValueError.");
  m.def("_emulate_quant", &ffn_ext::testing::emulate_quant_py, py::arg("op"), py::arg("inputs"),
        py::arg("params") = Doubles{}, py::arg("layout") = "concat", py::arg("format") = "e4m3fn",
        py::arg("group_size") = 128, py::arg("pow2") = false, py::arg("e8m0") = false, py::arg("column") = false,
        py::arg("scaling") = "group", py::arg("static_scale") = std::optional<double>{},
        "A quantizing op's CUDA kernel (quant_ops.h) with its launches (quant_kernel.h's per-lane and per-thread "
        "code: the group, row and tensor kernels, block by block and thread by thread) emulated on the host with "
        "CPU tensors. Errors as _emulate_cuda's.");
  m.def("_emulate_cache", &ffn_ext::testing::emulate_cache_py, py::arg("op"), py::arg("inputs"),
        py::arg("params") = Doubles{}, py::arg("group_size") = 128,
        "An FP8 activation cache op's CUDA kernel (cache_ops.h: <gated>_cache with inputs [gate, up], or "
        "<gated>_cached_backward with [grad, q, scale]) with its launch (cache_kernel.h's per-lane code, block by "
        "block and thread by thread) emulated on the host with CPU tensors. Errors as _emulate_cuda's.");
}
