// Autograd for every ffn_ext op, as C++ Autograd-key kernels (no Python on the call path; C++ users of the plain
// libtorch library get it too). Each forward op's backward calls the matching *_backward op through the
// dispatcher, and each *_backward op has autograd of its own (second derivatives in ATen ops), so double backward
// and gradgradcheck work.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>

namespace ffn_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using T = const at::Tensor&;

// Typed handles to the ops, resolved once.
template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}
using Pair = std::tuple<at::Tensor, at::Tensor>;

// With no gradient to record (grad mode off, or no input requires grad) and no forward-mode tangent, the op
// goes straight to its kernel below the autograd keys: Function::apply's bookkeeping is skipped on the inference
// path. Otherwise Function::apply runs as before (and raises for forward-mode AD, which these ops do not support).
template <typename... Ts>
bool records_grad(const Ts&... ts) {
  const bool grad = at::GradMode::is_enabled() && (ts.requires_grad() || ...);
  return grad || (ts._fw_grad(/*level=*/0).defined() || ...);
}
// The op below the autograd keys (each Function's forward, and the whole op when there is nothing to record).
template <typename Sig, typename... Ts>
auto call_below(const c10::TypedOperatorHandle<Sig>& handle, const Ts&... ts) {
  at::AutoDispatchBelowADInplaceOrView below;
  return handle.call(ts...);
}

// ---- second derivatives (ATen ops, themselves differentiable) ----
at::Tensor gelu_grad2(T x) {  // phi(x) * (2 - x^2)
  const double inv_sqrt_2pi = 0.3989422804014327;
  auto x2 = x * x;
  return at::exp(x2 * -0.5) * inv_sqrt_2pi * (2.0 - x2);
}
struct SiluDerivs {
  at::Tensor f, d1, d2;  // silu(x), silu'(x), silu''(x)
};
SiluDerivs silu_derivs(T x) {
  auto s = at::sigmoid(x);
  auto one_minus_s = 1.0 - s;
  return {x * s, s * (1.0 + x * one_minus_s), s * one_minus_s * (2.0 + x * (1.0 - 2.0 * s))};
}
// Gradients of (dgate, dup) = swiglu_backward(grad, gate, up) w.r.t. (grad, gate, up), given gg_gate, gg_up.
variable_list swiglu_second(T grad, T gate, T up, T gg_gate, T gg_up) {
  const auto d = silu_derivs(gate);
  auto gg_gate_up = gg_gate * up;
  return {gg_gate_up * d.d1 + gg_up * d.f, grad * (gg_gate_up * d.d2 + gg_up * d.d1), grad * gg_gate * d.d1};
}

// ---- unary: gelu, silu ----
template <typename Names>
struct UnaryFn : torch::autograd::Function<UnaryFn<Names>> {
  static at::Tensor below(T x) {
    static const auto fwd = op<at::Tensor(T)>(Names::fwd);
    return call_below(fwd, x);
  }
  static at::Tensor forward(AutogradContext* ctx, T x) {
    ctx->save_for_backward({x});
    return below(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd = op<at::Tensor(T, T)>(Names::bwd);
    const auto x = ctx->get_saved_variables()[0];
    return {bwd.call(grads[0], x)};
  }
};
template <typename Names>
struct UnaryBackwardFn : torch::autograd::Function<UnaryBackwardFn<Names>> {
  static at::Tensor below(T grad, T x) {
    static const auto bwd = op<at::Tensor(T, T)>(Names::bwd);
    return call_below(bwd, grad, x);
  }
  static at::Tensor forward(AutogradContext* ctx, T grad, T x) {
    ctx->save_for_backward({grad, x});
    return below(grad, x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd = op<at::Tensor(T, T)>(Names::bwd);
    const auto saved = ctx->get_saved_variables();
    const auto &grad = saved[0], &x = saved[1], &gg = grads[0];
    at::Tensor d_grad, d_x;
    if (ctx->needs_input_grad(0)) d_grad = bwd.call(gg, x);
    if (ctx->needs_input_grad(1)) d_x = gg * grad * Names::grad2(x);
    return {d_grad, d_x};
  }
};
struct GeluNames {
  static constexpr const char* fwd = "ffn_ext::gelu";
  static constexpr const char* bwd = "ffn_ext::gelu_backward";
  static at::Tensor grad2(T x) { return gelu_grad2(x); }
};
struct SiluNames {
  static constexpr const char* fwd = "ffn_ext::silu";
  static constexpr const char* bwd = "ffn_ext::silu_backward";
  static at::Tensor grad2(T x) { return silu_derivs(x).d2; }
};

// ---- swiglu ----
struct SwigluFn : torch::autograd::Function<SwigluFn> {
  static at::Tensor below(T gate, T up) {
    static const auto fwd = op<at::Tensor(T, T)>("ffn_ext::swiglu");
    return call_below(fwd, gate, up);
  }
  static at::Tensor forward(AutogradContext* ctx, T gate, T up) {
    ctx->save_for_backward({gate, up});
    return below(gate, up);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd = op<Pair(T, T, T)>("ffn_ext::swiglu_backward");
    const auto saved = ctx->get_saved_variables();
    auto [dgate, dup] = bwd.call(grads[0], saved[0], saved[1]);
    return {ctx->needs_input_grad(0) ? dgate : at::Tensor(), ctx->needs_input_grad(1) ? dup : at::Tensor()};
  }
};
struct SwigluBackwardFn : torch::autograd::Function<SwigluBackwardFn> {
  static Pair below(T grad, T gate, T up) {
    static const auto bwd = op<Pair(T, T, T)>("ffn_ext::swiglu_backward");
    return call_below(bwd, grad, gate, up);
  }
  static variable_list forward(AutogradContext* ctx, T grad, T gate, T up) {
    ctx->save_for_backward({grad, gate, up});
    auto [dgate, dup] = below(grad, gate, up);
    return {dgate, dup};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    return swiglu_second(s[0], s[1], s[2], grads[0], grads[1]);
  }
};

// ---- swiglu_packed ----
struct SwigluPackedFn : torch::autograd::Function<SwigluPackedFn> {
  static at::Tensor below(T gate_up) {
    static const auto fwd = op<at::Tensor(T)>("ffn_ext::swiglu_packed");
    return call_below(fwd, gate_up);
  }
  static at::Tensor forward(AutogradContext* ctx, T gate_up) {
    ctx->save_for_backward({gate_up});
    return below(gate_up);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd = op<at::Tensor(T, T)>("ffn_ext::swiglu_packed_backward");
    return {bwd.call(grads[0], ctx->get_saved_variables()[0])};
  }
};
struct SwigluPackedBackwardFn : torch::autograd::Function<SwigluPackedBackwardFn> {
  static at::Tensor below(T grad, T gate_up) {
    static const auto bwd = op<at::Tensor(T, T)>("ffn_ext::swiglu_packed_backward");
    return call_below(bwd, grad, gate_up);
  }
  static at::Tensor forward(AutogradContext* ctx, T grad, T gate_up) {
    ctx->save_for_backward({grad, gate_up});
    return below(grad, gate_up);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto halves = s[1].chunk(2, -1);
    const auto gg = grads[0].chunk(2, -1);
    auto d = swiglu_second(s[0], halves[0], halves[1], gg[0], gg[1]);
    return {d[0], at::cat({d[1], d[2]}, -1)};
  }
};

}  // namespace

// Each op: its Function when there is a gradient to record, else straight to the kernel below autograd.
TORCH_LIBRARY_IMPL(ffn_ext, Autograd, m) {
  using Gelu = UnaryFn<GeluNames>;
  using GeluBackward = UnaryBackwardFn<GeluNames>;
  using Silu = UnaryFn<SiluNames>;
  using SiluBackward = UnaryBackwardFn<SiluNames>;
  m.impl("gelu", [](T x) { return records_grad(x) ? Gelu::apply(x) : Gelu::below(x); });
  m.impl("gelu_backward", [](T g, T x) {
    return records_grad(g, x) ? GeluBackward::apply(g, x) : GeluBackward::below(g, x);
  });
  m.impl("silu", [](T x) { return records_grad(x) ? Silu::apply(x) : Silu::below(x); });
  m.impl("silu_backward", [](T g, T x) {
    return records_grad(g, x) ? SiluBackward::apply(g, x) : SiluBackward::below(g, x);
  });
  m.impl("swiglu", [](T gate, T up) {
    return records_grad(gate, up) ? SwigluFn::apply(gate, up) : SwigluFn::below(gate, up);
  });
  m.impl("swiglu_backward", [](T g, T gate, T up) {
    if (!records_grad(g, gate, up)) return SwigluBackwardFn::below(g, gate, up);
    auto r = SwigluBackwardFn::apply(g, gate, up);
    return std::make_tuple(r[0], r[1]);
  });
  m.impl("swiglu_packed", [](T gate_up) {
    return records_grad(gate_up) ? SwigluPackedFn::apply(gate_up) : SwigluPackedFn::below(gate_up);
  });
  m.impl("swiglu_packed_backward", [](T g, T gate_up) {
    using Fn = SwigluPackedBackwardFn;
    return records_grad(g, gate_up) ? Fn::apply(g, gate_up) : Fn::below(g, gate_up);
  });
}

}  // namespace ffn_ext
