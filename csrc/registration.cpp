// The one TORCH_LIBRARY(ffn_ext): every schema, the Meta kernels, and build information.
// Kernels: CPU in aten_ops.cpp, CUDA in cuda/kernels.cu, Autograd in autograd.cpp. Python API: ffn_ext/ops.py.
#include <torch/library.h>
#include <torch/version.h>

#include "ffn_ext.h"

namespace ffn_ext {

std::vector<std::pair<std::string, std::string>> build_info() {
  std::vector<std::pair<std::string, std::string>> info;
  info.emplace_back("torch_version_built_against", TORCH_VERSION);
#ifdef FFN_EXT_WITH_CUDA
  info.emplace_back("cuda_kernels", "yes");
  info.emplace_back("cuda_version", cuda::compiled_cuda_version());
  info.emplace_back("cuda_archs", cuda::compiled_arch_list());
#else
  info.emplace_back("cuda_kernels", "no");
  info.emplace_back("cuda_version", "");
  info.emplace_back("cuda_archs", "");
#endif
  return info;
}

TORCH_LIBRARY(ffn_ext, m) {
  m.def("gelu(Tensor x) -> Tensor");
  m.def("gelu_backward(Tensor grad, Tensor x) -> Tensor");
  m.def("silu(Tensor x) -> Tensor");
  m.def("silu_backward(Tensor grad, Tensor x) -> Tensor");
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  m.def("swiglu_packed(Tensor gate_up) -> Tensor");
  m.def("swiglu_packed_backward(Tensor grad, Tensor gate_up) -> Tensor");
}

// Meta kernels: the checks and output allocation every real kernel also runs (shapes.cpp).
TORCH_LIBRARY_IMPL(ffn_ext, Meta, m) {
  m.impl("gelu", [](const at::Tensor& x) { return alloc_unary("ffn_ext.gelu", x); });
  m.impl("gelu_backward",
         [](const at::Tensor& g, const at::Tensor& x) { return alloc_unary_backward("ffn_ext.gelu_backward", g, x); });
  m.impl("silu", [](const at::Tensor& x) { return alloc_unary("ffn_ext.silu", x); });
  m.impl("silu_backward",
         [](const at::Tensor& g, const at::Tensor& x) { return alloc_unary_backward("ffn_ext.silu_backward", g, x); });
  m.impl("swiglu", &alloc_swiglu);
  m.impl("swiglu_backward", &alloc_swiglu_backward);
  m.impl("swiglu_packed", &alloc_swiglu_packed);
  m.impl("swiglu_packed_backward", &alloc_swiglu_packed_backward);
}

}  // namespace ffn_ext
