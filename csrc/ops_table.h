// The one table of ffn_ext's ops. Everything op by op is generated from these two lists: the schemas and Meta
// kernels (registration.cpp), the CPU kernels (aten_ops.cpp), the CUDA kernels (cuda/kernels.cu), autograd with
// double backward (autograd.cpp), the fast entry points and the test paths (python_module.cpp, test_paths.cpp).
// The Python side has its own table, ffn_ext/table.py, with the same names. README "Adding an activation".
//
// FFN_EXT_ACTIVATIONS(X): X(name, Act, aten_forward, aten_backward), one line per activation:
//   ops  name(Tensor x) -> Tensor                       act(x)
//        name_backward(Tensor grad, Tensor x) -> Tensor grad * act'(x)
//   Act  its functor in ffn_math.h (f, df for the kernels; d2 for double backward)
//   aten_forward, aten_backward  the CPU kernels' ATen composites, expressions in (out, x) and (out, grad, x)
//
// FFN_EXT_GATED(X): X(name, Act), one line per gated activation act(gate) * up over an activation above:
//   ops  name(Tensor gate, Tensor up) -> Tensor                          act(gate) * up
//        name_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)     (dgate, dup)
//        name_packed(Tensor gate_up) -> Tensor                           [..., 2M] -> [..., M], gate first
//        name_packed_backward(Tensor grad, Tensor gate_up) -> Tensor     [..., M], [..., 2M] -> [dgate | dup]
#pragma once

#define FFN_EXT_ACTIVATIONS(X)                                                                  \
  X(gelu, Gelu, at::gelu_out(out, x), at::gelu_backward_out(out, grad, x))                      \
  X(gelu_tanh, GeluTanh, at::gelu_out(out, x, "tanh"), at::gelu_backward_out(out, grad, x, "tanh")) \
  X(silu, Silu, at::silu_out(out, x), at::silu_backward_out(out, grad, x))

#define FFN_EXT_GATED(X) \
  X(swiglu, Silu)        \
  X(geglu, Gelu)         \
  X(geglu_tanh, GeluTanh)

#include "ffn_math.h"

namespace ffn_ext {
// The name of an activation's unary op, by its functor: ActName<math::Silu>::value == "silu".
template <class Act> struct ActName;
#define FFN_EXT_ACT_NAME(name, Act, ...) \
  template <> struct ActName<math::Act> { static constexpr const char* value = #name; };
FFN_EXT_ACTIVATIONS(FFN_EXT_ACT_NAME)
#undef FFN_EXT_ACT_NAME
}  // namespace ffn_ext
