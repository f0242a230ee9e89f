// ffn_ext's public C++ API: typed functions that call the torch.ops.ffn_ext.* ops through the dispatcher, so
// autograd (double backward included), the CPU and the CUDA kernels are those of the Python API. They are defined
// in libffn_ext_ops (csrc/ops_api.cpp), so calling one makes the link depend on the library: its static
// registrations run at load, also under the linker's default --as-needed.
//
//   find_package(ffn_ext REQUIRED)                 # README "CMake": the commands, torch's Python included
//   target_link_libraries(app PRIVATE ffn_ext::ops)
//
//   #include <ffn_ext/ops.h>
//   at::Tensor h = ffn_ext::swiglu(gate, up);      // silu(gate) * up; h.sum().backward() reaches gate and up
//
// Shapes: unary ops [...] -> [...]; gated ops gate, up [..., M] -> [..., M]; packed ops [..., 2M] -> [..., M] with
// layout "concat" ([gate | up]) or "interleaved" ([g0, u0, g1, u1, ...], GPT-OSS). Errors are c10::Error
// subclasses with the Python API's messages. tests/test_packaging.py checks that every forward op of the table
// (ffn_ext/table.py) is declared here.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

namespace ffn_ext {

at::Tensor gelu(const at::Tensor& x);       // exact (erf) GELU
at::Tensor gelu_tanh(const at::Tensor& x);  // tanh-approximated GELU
at::Tensor silu(const at::Tensor& x);

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);      // silu(gate) * up
at::Tensor geglu(const at::Tensor& gate, const at::Tensor& up);       // gelu(gate) * up
at::Tensor geglu_tanh(const at::Tensor& gate, const at::Tensor& up);  // gelu_tanh(gate) * up
// GPT-OSS / DeepSeek-V4: g = min(gate, limit), u = clamp(up, -limit, limit); g * sigmoid(alpha * g) * (u + up_offset)
at::Tensor swiglu_clamped(const at::Tensor& gate, const at::Tensor& up, double limit, double alpha = 1.0,
                          double up_offset = 0.0);

at::Tensor swiglu_packed(const at::Tensor& gate_up, c10::string_view layout = "concat");
at::Tensor geglu_packed(const at::Tensor& gate_up, c10::string_view layout = "concat");
at::Tensor geglu_tanh_packed(const at::Tensor& gate_up, c10::string_view layout = "concat");
at::Tensor swiglu_clamped_packed(const at::Tensor& gate_up, double limit, double alpha = 1.0, double up_offset = 0.0,
                                 c10::string_view layout = "concat");

}  // namespace ffn_ext
