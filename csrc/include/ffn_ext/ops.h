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
// One function per forward op of the table (<ffn_ext/ops_table.h>, installed next to this header; what each op
// computes is there): for each activation `name` (gelu, gelu_tanh, silu, relu, relu2, quick_gelu, ...)
//   at::Tensor name(const at::Tensor& x);
// and for each gated op `name` (swiglu, geglu, geglu_tanh, reglu, ..., swiglu_clamped with its parameters)
//   at::Tensor name(const at::Tensor& gate, const at::Tensor& up[, params]);
//   at::Tensor name_packed(const at::Tensor& gate_up[, params], c10::string_view layout = "concat");
// e.g. swiglu_clamped(gate, up, double limit, double alpha = 1.0, double up_offset = 0.0).
// Shapes: unary ops [...] -> [...]; gated ops gate, up [..., M] -> [..., M]; packed ops [..., 2M] -> [..., M] with
// layout "concat" ([gate | up]) or "interleaved" ([g0, u0, g1, u1, ...], GPT-OSS). Errors are c10::Error
// subclasses with the Python API's messages.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include "ops_table.h"

namespace ffn_ext {

#define FFN_EXT_DECLARE_ACT(name, ...) at::Tensor name(const at::Tensor& x);
#define FFN_EXT_DECLARE_GATED(name, Gate, P) \
  at::Tensor name(const at::Tensor& gate, const at::Tensor& up FFN_EXT_P_DEFAULTS_##P); \
  at::Tensor name##_packed(const at::Tensor& gate_up FFN_EXT_P_DEFAULTS_##P, c10::string_view layout = "concat");
FFN_EXT_ACTIVATIONS(FFN_EXT_DECLARE_ACT)
FFN_EXT_GATED(FFN_EXT_DECLARE_GATED)
#undef FFN_EXT_DECLARE_ACT
#undef FFN_EXT_DECLARE_GATED

}  // namespace ffn_ext
