// CPU kernels, built from ATen ops (the table's aten_forward / aten_backward, ops_table.h): the fallback path. In
// a build without CUDA kernels they also serve CUDA tensors (with a one-time warning), so such a build never fails
// on a GPU; it is only slower.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ffn_ext.h"
#include "ops_table.h"

namespace ffn_ext {
namespace aten_impl {

// An activation's ATen composite, by its functor: forward into `out`, backward (grad * act'(x)) into `out`.
template <class Act> struct Aten;
#define FFN_EXT_ATEN_ACT(name, Act, aten_forward, aten_backward)                                     \
  template <> struct Aten<math::Act> {                                                             \
    static void forward(at::Tensor out, const at::Tensor& x) { aten_forward; }                     \
    static void backward(at::Tensor out, const at::Tensor& grad, const at::Tensor& x) { aten_backward; } \
  };
FFN_EXT_ACTIVATIONS(FFN_EXT_ATEN_ACT)
#undef FFN_EXT_ATEN_ACT

template <class Act>
at::Tensor act_of(const at::Tensor& x) {
  auto out = at::empty_like(x);
  Aten<Act>::forward(out, x);
  return out;
}

// h = act(gate) * up into `out`; dgate, dup into the given (possibly strided) views.
template <class Act>
void gated_into(at::Tensor out, const at::Tensor& gate, const at::Tensor& up) {
  at::mul_out(out, act_of<Act>(gate), up);
}
template <class Act>
void gated_backward_into(at::Tensor dgate, at::Tensor dup, const at::Tensor& grad, const at::Tensor& gate,
                         const at::Tensor& up) {
  Aten<Act>::backward(dgate, grad * up, gate);
  at::mul_out(dup, grad, act_of<Act>(gate));
}

template <class Act>
at::Tensor unary(const char* op, const at::Tensor& x) {
  auto out = alloc_unary(op, x);
  Aten<Act>::forward(out, x);
  return out;
}
template <class Act>
at::Tensor unary_backward(const char* op, const at::Tensor& grad, const at::Tensor& x) {
  auto out = alloc_unary_backward(op, grad, x);
  Aten<Act>::backward(out, grad, x);
  return out;
}
template <class Act>
at::Tensor gated(const char* op, const at::Tensor& gate, const at::Tensor& up) {
  auto out = alloc_gated(op, gate, up);
  gated_into<Act>(out, gate, up);
  return out;
}
template <class Act>
std::tuple<at::Tensor, at::Tensor> gated_backward(const char* op, const at::Tensor& grad, const at::Tensor& gate,
                                                  const at::Tensor& up) {
  auto outs = alloc_gated_backward(op, grad, gate, up);
  gated_backward_into<Act>(std::get<0>(outs), std::get<1>(outs), grad, gate, up);
  return outs;
}
template <class Act>
at::Tensor gated_packed(const char* op, const at::Tensor& gate_up) {
  auto out = alloc_gated_packed(op, gate_up);
  const int64_t m = out.size(-1);
  gated_into<Act>(out, gate_up.narrow(-1, 0, m), gate_up.narrow(-1, m, m));
  return out;
}
template <class Act>
at::Tensor gated_packed_backward(const char* op, const at::Tensor& grad, const at::Tensor& gate_up) {
  auto out = alloc_gated_packed_backward(op, grad, gate_up);
  const int64_t m = grad.size(-1);
  gated_backward_into<Act>(out.narrow(-1, 0, m), out.narrow(-1, m, m), grad, gate_up.narrow(-1, 0, m),
                           gate_up.narrow(-1, m, m));
  return out;
}

// One function, so one TORCH_WARN_ONCE for the library (inside the template there would be one per op).
void warn_cpu_only_build() {
  TORCH_WARN_ONCE("ffn_ext was built without CUDA kernels (CPU-only build); CUDA tensors use the ATen composite. ",
                  "Rebuild with a CUDA toolkit and a CUDA build of torch for the fused kernels.");
}

// Registers every op of the table for one dispatch key; with Warn, each kernel first warns (once) that this build
// has no CUDA kernels.
template <bool Warn, class Library>
void impl_all(Library& m) {
  using T = const at::Tensor&;
#define FFN_EXT_WARN if constexpr (Warn) warn_cpu_only_build()
#define FFN_EXT_ATEN_IMPL_ACT(name, Act, ...)                                   \
  m.impl(#name, [](T x) {                                                       \
    FFN_EXT_WARN;                                                               \
    return unary<math::Act>("ffn_ext." #name, x);                               \
  });                                                                           \
  m.impl(#name "_backward", [](T g, T x) {                                      \
    FFN_EXT_WARN;                                                               \
    return unary_backward<math::Act>("ffn_ext." #name "_backward", g, x);       \
  });
#define FFN_EXT_ATEN_IMPL_GATED(name, Act)                                      \
  m.impl(#name, [](T gate, T up) {                                              \
    FFN_EXT_WARN;                                                               \
    return gated<math::Act>("ffn_ext." #name, gate, up);                        \
  });                                                                           \
  m.impl(#name "_backward", [](T g, T gate, T up) {                             \
    FFN_EXT_WARN;                                                               \
    return gated_backward<math::Act>("ffn_ext." #name "_backward", g, gate, up); \
  });                                                                           \
  m.impl(#name "_packed", [](T gu) {                                            \
    FFN_EXT_WARN;                                                               \
    return gated_packed<math::Act>("ffn_ext." #name "_packed", gu);             \
  });                                                                           \
  m.impl(#name "_packed_backward", [](T g, T gu) {                              \
    FFN_EXT_WARN;                                                               \
    return gated_packed_backward<math::Act>("ffn_ext." #name "_packed_backward", g, gu); \
  });
  FFN_EXT_ACTIVATIONS(FFN_EXT_ATEN_IMPL_ACT)
  FFN_EXT_GATED(FFN_EXT_ATEN_IMPL_GATED)
#undef FFN_EXT_ATEN_IMPL_ACT
#undef FFN_EXT_ATEN_IMPL_GATED
#undef FFN_EXT_WARN
}

}  // namespace aten_impl

TORCH_LIBRARY_IMPL(ffn_ext, CPU, m) { aten_impl::impl_all</*Warn=*/false>(m); }

#ifndef FFN_EXT_WITH_CUDA
// No CUDA kernels in this build: CUDA tensors take the ATen composites, after one warning.
TORCH_LIBRARY_IMPL(ffn_ext, CUDA, m) { aten_impl::impl_all</*Warn=*/true>(m); }
#endif

}  // namespace ffn_ext
