// CPU kernels, built from ATen ops: the fallback path. In a build without CUDA kernels they also serve CUDA
// tensors (with a one-time warning), so such a build never fails on a GPU; it is only slower.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ffn_ext.h"

namespace ffn_ext {
namespace aten_impl {

at::Tensor gelu(const at::Tensor& x) {
  auto out = alloc_unary("ffn_ext.gelu", x);
  return at::gelu_out(out, x);
}
at::Tensor gelu_backward(const at::Tensor& grad, const at::Tensor& x) {
  auto out = alloc_unary_backward("ffn_ext.gelu_backward", grad, x);
  return at::gelu_backward_out(out, grad, x);
}
at::Tensor silu(const at::Tensor& x) {
  auto out = alloc_unary("ffn_ext.silu", x);
  return at::silu_out(out, x);
}
at::Tensor silu_backward(const at::Tensor& grad, const at::Tensor& x) {
  auto out = alloc_unary_backward("ffn_ext.silu_backward", grad, x);
  return at::silu_backward_out(out, grad, x);
}

namespace {
// h = silu(gate) * up into `out`; dgate, dup into the given (possibly strided) views.
void swiglu_into(at::Tensor& out, const at::Tensor& gate, const at::Tensor& up) { at::mul_out(out, at::silu(gate), up); }
void swiglu_backward_into(at::Tensor dgate, at::Tensor dup, const at::Tensor& grad, const at::Tensor& gate,
                          const at::Tensor& up) {
  at::silu_backward_out(dgate, grad * up, gate);
  at::mul_out(dup, grad, at::silu(gate));
}
}  // namespace

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  auto out = alloc_swiglu(gate, up);
  swiglu_into(out, gate, up);
  return out;
}
std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad, const at::Tensor& gate,
                                                   const at::Tensor& up) {
  auto outs = alloc_swiglu_backward(grad, gate, up);
  swiglu_backward_into(std::get<0>(outs), std::get<1>(outs), grad, gate, up);
  return outs;
}
at::Tensor swiglu_packed(const at::Tensor& gate_up) {
  auto out = alloc_swiglu_packed(gate_up);
  const int64_t m = out.size(-1);
  swiglu_into(out, gate_up.narrow(-1, 0, m), gate_up.narrow(-1, m, m));
  return out;
}
at::Tensor swiglu_packed_backward(const at::Tensor& grad, const at::Tensor& gate_up) {
  auto out = alloc_swiglu_packed_backward(grad, gate_up);
  const int64_t m = grad.size(-1);
  swiglu_backward_into(out.narrow(-1, 0, m), out.narrow(-1, m, m), grad, gate_up.narrow(-1, 0, m),
                       gate_up.narrow(-1, m, m));
  return out;
}

}  // namespace aten_impl

TORCH_LIBRARY_IMPL(ffn_ext, CPU, m) {
  m.impl("gelu", &aten_impl::gelu);
  m.impl("gelu_backward", &aten_impl::gelu_backward);
  m.impl("silu", &aten_impl::silu);
  m.impl("silu_backward", &aten_impl::silu_backward);
  m.impl("swiglu", &aten_impl::swiglu);
  m.impl("swiglu_backward", &aten_impl::swiglu_backward);
  m.impl("swiglu_packed", &aten_impl::swiglu_packed);
  m.impl("swiglu_packed_backward", &aten_impl::swiglu_packed_backward);
}

#ifndef FFN_EXT_WITH_CUDA
// No CUDA kernels in this build: CUDA tensors take the ATen composites, after one warning.
namespace {
// One function, so one TORCH_WARN_ONCE for the library (inside the template there would be one per op).
void warn_cpu_only_build() {
  TORCH_WARN_ONCE("ffn_ext was built without CUDA kernels (CPU-only build); CUDA tensors use the ATen composite. ",
                  "Rebuild with a CUDA toolkit and a CUDA build of torch for the fused kernels.");
}
template <auto Fn, typename... Args>
auto warn_then(Args... args) {
  warn_cpu_only_build();
  return Fn(args...);
}
}  // namespace

TORCH_LIBRARY_IMPL(ffn_ext, CUDA, m) {
  using T = const at::Tensor&;
  m.impl("gelu", &warn_then<&aten_impl::gelu, T>);
  m.impl("gelu_backward", &warn_then<&aten_impl::gelu_backward, T, T>);
  m.impl("silu", &warn_then<&aten_impl::silu, T>);
  m.impl("silu_backward", &warn_then<&aten_impl::silu_backward, T, T>);
  m.impl("swiglu", &warn_then<&aten_impl::swiglu, T, T>);
  m.impl("swiglu_backward", &warn_then<&aten_impl::swiglu_backward, T, T, T>);
  m.impl("swiglu_packed", &warn_then<&aten_impl::swiglu_packed, T>);
  m.impl("swiglu_packed_backward", &warn_then<&aten_impl::swiglu_packed_backward, T, T>);
}
#endif

}  // namespace ffn_ext
