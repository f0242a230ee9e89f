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
#define FFN_EXT_ATEN_ACT(name, Act, aten_forward, aten_backward) \
  template <> struct Aten<math::Act> { \
    static void forward(at::Tensor out, const at::Tensor& x) { aten_forward; } \
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

// A gate's ATen composite: forward into `out`, (dgate, dup) into the given (possibly strided) views.
template <class Gate> struct AtenGate;
template <class Act> struct AtenGate<math::Glu<Act>> {  // act(gate) * up
  static void forward(at::Tensor out, const at::Tensor& gate, const at::Tensor& up, const math::NoParams&) {
    at::mul_out(out, act_of<Act>(gate), up);
  }
  static void backward(at::Tensor dgate, at::Tensor dup, const at::Tensor& grad, const at::Tensor& gate,
                       const at::Tensor& up, const math::NoParams&) {
    Aten<Act>::backward(dgate, grad * up, gate);
    at::mul_out(dup, grad, act_of<Act>(gate));
  }
};
template <> struct AtenGate<math::SwigluClamped> {  // GPT-OSS's expression (transformers' GptOssExperts), in its order
  static void forward(at::Tensor out, const at::Tensor& gate, const at::Tensor& up, const math::ClampParams& p) {
    const auto g = gate.clamp_max(p.limit);
    at::mul_out(out, up.clamp(-p.limit, p.limit) + p.up_offset, g * at::sigmoid(g * p.alpha));
  }
  // torch.clamp's gradients: passed where the input is within the bounds, else 0 (at the bound: kClampGradAtBound)
  static void backward(at::Tensor dgate, at::Tensor dup, const at::Tensor& grad, const at::Tensor& gate,
                       const at::Tensor& up, const math::ClampParams& p) {
    const auto g = gate.clamp_max(p.limit);
    const auto z = g * p.alpha;
    const auto s = at::sigmoid(z);
    const auto dh = s * (z * (1 - s) + 1);  // d/dg [g sigmoid(alpha g)] = silu'(alpha g)
    dgate.copy_(at::where(clamp_pass_g(gate, p), grad * (up.clamp(-p.limit, p.limit) + p.up_offset) * dh, 0));
    dup.copy_(at::where(clamp_pass_u(up, p), grad * (g * s), 0));
  }
};

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
std::tuple<at::Tensor, at::Tensor> unary_backward_recompute(const char* op, const at::Tensor& grad,
                                                            const at::Tensor& x) {
  auto outs = alloc_unary_backward_recompute(op, grad, x);
  Aten<Act>::backward(std::get<0>(outs), grad, x);
  Aten<Act>::forward(std::get<1>(outs), x);
  return outs;
}
template <class Gate>
at::Tensor gated(const char* op, const typename Gate::Params& prm, const at::Tensor& gate, const at::Tensor& up) {
  check_params(op, prm);
  auto out = alloc_gated(op, gate, up);
  AtenGate<Gate>::forward(out, gate, up, prm);
  return out;
}
template <class Gate>
std::tuple<at::Tensor, at::Tensor> gated_backward(const char* op, const typename Gate::Params& prm,
                                                  const at::Tensor& grad, const at::Tensor& gate,
                                                  const at::Tensor& up) {
  check_params(op, prm);
  auto outs = alloc_gated_backward(op, grad, gate, up);
  AtenGate<Gate>::backward(std::get<0>(outs), std::get<1>(outs), grad, gate, up, prm);
  return outs;
}
template <class Gate>
at::Tensor gated_packed(const char* op, const typename Gate::Params& prm, const at::Tensor& gate_up,
                        c10::string_view layout) {
  check_params(op, prm);
  const Layout lay = parse_layout(op, layout);
  auto out = alloc_gated_packed(op, gate_up);
  const auto [gate, up] = split_packed(gate_up, out.size(-1), lay);
  AtenGate<Gate>::forward(out, gate, up, prm);
  return out;
}
template <class Gate>
at::Tensor gated_packed_backward(const char* op, const typename Gate::Params& prm, const at::Tensor& grad,
                                 const at::Tensor& gate_up, c10::string_view layout) {
  check_params(op, prm);
  const Layout lay = parse_layout(op, layout);
  auto out = alloc_gated_packed_backward(op, grad, gate_up);
  const int64_t m = grad.size(-1);
  const auto [gate, up] = split_packed(gate_up, m, lay);
  const auto [dgate, dup] = split_packed(out, m, lay);
  AtenGate<Gate>::backward(dgate, dup, grad, gate, up, prm);
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
#define FFN_EXT_WARN \
  if constexpr (Warn) warn_cpu_only_build()
#define FFN_EXT_ATEN_IMPL_ACT(name, Act, ...) \
  m.impl(#name, [](T x) { \
    FFN_EXT_WARN; \
    return unary<math::Act>("ffn_ext." #name, x); \
  }); \
  m.impl(#name "_backward", [](T g, T x) { \
    FFN_EXT_WARN; \
    return unary_backward<math::Act>("ffn_ext." #name "_backward", g, x); \
  }); \
  m.impl(#name "_backward_recompute", [](T g, T x) { \
    FFN_EXT_WARN; \
    return unary_backward_recompute<math::Act>("ffn_ext." #name "_backward_recompute", g, x); \
  });
#define FFN_EXT_ATEN_IMPL_GATED(name, Gate, P) \
  m.impl(#name, [](T gate, T up FFN_EXT_P_DECL_##P) { \
    FFN_EXT_WARN; \
    return gated<math::Gate>("ffn_ext." #name, FFN_EXT_P_MAKE_##P, gate, up); \
  }); \
  m.impl(#name "_backward", [](T g, T gate, T up FFN_EXT_P_DECL_##P) { \
    FFN_EXT_WARN; \
    return gated_backward<math::Gate>("ffn_ext." #name "_backward", FFN_EXT_P_MAKE_##P, g, gate, up); \
  }); \
  m.impl(#name "_packed", [](T gu FFN_EXT_P_DECL_##P, c10::string_view layout) { \
    FFN_EXT_WARN; \
    return gated_packed<math::Gate>("ffn_ext." #name "_packed", FFN_EXT_P_MAKE_##P, gu, layout); \
  }); \
  m.impl(#name "_packed_backward", [](T g, T gu FFN_EXT_P_DECL_##P, c10::string_view layout) { \
    FFN_EXT_WARN; \
    return gated_packed_backward<math::Gate>("ffn_ext." #name "_packed_backward", FFN_EXT_P_MAKE_##P, g, gu, layout); \
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
