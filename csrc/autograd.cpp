// Autograd for every ffn_ext op, as C++ Autograd-key kernels (no Python on the call path; C++ users of the plain
// libtorch library get it too). Each forward op's backward calls the matching *_backward op through the
// dispatcher, and each *_backward op has autograd of its own (second derivatives in ATen ops), so double backward
// and gradgradcheck work.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <type_traits>

#include "ops_table.h"

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

// ---- second derivatives: ATen ops (themselves differentiable), each activation's d2 (ffn_math.h) over tensors
struct TensorMath {
  static at::Tensor exp(T x) { return at::exp(x); }
  static at::Tensor sigmoid(T x) { return at::sigmoid(x); }
};
template <class Act>
at::Tensor grad2(T x) {
  return Act::template d2<TensorMath>(x);
}

// The ops of an activation Act (its table line): name, name_backward.
template <class Act>
struct ActOps {
  static std::string name(const char* suffix = "") { return std::string("ffn_ext::") + ActName<Act>::value + suffix; }
  static const c10::TypedOperatorHandle<at::Tensor(T)>& fwd() {
    static const auto h = op<at::Tensor(T)>(name().c_str());
    return h;
  }
  static const c10::TypedOperatorHandle<at::Tensor(T, T)>& bwd() {
    static const auto h = op<at::Tensor(T, T)>(name("_backward").c_str());
    return h;
  }
};

// Gradients of (dgate, dup) = gated_backward(grad, gate, up) = (grad up act'(gate), grad act(gate)) w.r.t.
// (grad, gate, up), given gg_gate, gg_up. act and grad * act' are the activation's own ops (differentiable through
// their Functions below), act'' its d2.
template <class Act>
variable_list gated_second(T grad, T gate, T up, T gg_gate, T gg_up) {
  const auto& act = ActOps<Act>::fwd();
  const auto& act_bwd = ActOps<Act>::bwd();  // (g, x) -> g * act'(x)
  auto gg_gate_up = gg_gate * up;
  return {act_bwd.call(gg_gate_up, gate) + gg_up * act.call(gate),
          grad * gg_gate_up * grad2<Act>(gate) + act_bwd.call(grad * gg_up, gate), act_bwd.call(grad * gg_gate, gate)};
}

// ---- unary: act(x), act_backward(grad, x)
template <class Act>
struct UnaryFn : torch::autograd::Function<UnaryFn<Act>> {
  static at::Tensor below(T x) { return call_below(ActOps<Act>::fwd(), x); }
  static at::Tensor forward(AutogradContext* ctx, T x) {
    ctx->save_for_backward({x});
    return below(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto x = ctx->get_saved_variables()[0];
    return {ActOps<Act>::bwd().call(grads[0], x)};
  }
};
template <class Act>
struct UnaryBackwardFn : torch::autograd::Function<UnaryBackwardFn<Act>> {
  static at::Tensor below(T grad, T x) { return call_below(ActOps<Act>::bwd(), grad, x); }
  static at::Tensor forward(AutogradContext* ctx, T grad, T x) {
    ctx->save_for_backward({grad, x});
    return below(grad, x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &grad = saved[0], &x = saved[1], &gg = grads[0];
    at::Tensor d_grad, d_x;
    if (ctx->needs_input_grad(0)) d_grad = ActOps<Act>::bwd().call(gg, x);
    if (ctx->needs_input_grad(1)) d_x = gg * grad * grad2<Act>(x);
    return {d_grad, d_x};
  }
};

// ---- gated: act(gate) * up, separate and packed. Names: the table's gated op name ("ffn_ext::swiglu").
template <const char* Name>
struct GatedOps {
  static std::string name(const char* suffix) { return std::string("ffn_ext::") + Name + suffix; }
  static const c10::TypedOperatorHandle<at::Tensor(T, T)>& fwd() {
    static const auto h = op<at::Tensor(T, T)>(name("").c_str());
    return h;
  }
  static const c10::TypedOperatorHandle<Pair(T, T, T)>& bwd() {
    static const auto h = op<Pair(T, T, T)>(name("_backward").c_str());
    return h;
  }
  static const c10::TypedOperatorHandle<at::Tensor(T)>& packed() {
    static const auto h = op<at::Tensor(T)>(name("_packed").c_str());
    return h;
  }
  static const c10::TypedOperatorHandle<at::Tensor(T, T)>& packed_bwd() {
    static const auto h = op<at::Tensor(T, T)>(name("_packed_backward").c_str());
    return h;
  }
};

template <class Ops>
struct GatedFn : torch::autograd::Function<GatedFn<Ops>> {
  static at::Tensor below(T gate, T up) { return call_below(Ops::fwd(), gate, up); }
  static at::Tensor forward(AutogradContext* ctx, T gate, T up) {
    ctx->save_for_backward({gate, up});
    return below(gate, up);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dgate, dup] = Ops::bwd().call(grads[0], saved[0], saved[1]);
    return {ctx->needs_input_grad(0) ? dgate : at::Tensor(), ctx->needs_input_grad(1) ? dup : at::Tensor()};
  }
};
template <class Ops, class Act>
struct GatedBackwardFn : torch::autograd::Function<GatedBackwardFn<Ops, Act>> {
  static Pair below(T grad, T gate, T up) { return call_below(Ops::bwd(), grad, gate, up); }
  static variable_list forward(AutogradContext* ctx, T grad, T gate, T up) {
    ctx->save_for_backward({grad, gate, up});
    auto [dgate, dup] = below(grad, gate, up);
    return {dgate, dup};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    return gated_second<Act>(s[0], s[1], s[2], grads[0], grads[1]);
  }
};
template <class Ops>
struct GatedPackedFn : torch::autograd::Function<GatedPackedFn<Ops>> {
  static at::Tensor below(T gate_up) { return call_below(Ops::packed(), gate_up); }
  static at::Tensor forward(AutogradContext* ctx, T gate_up) {
    ctx->save_for_backward({gate_up});
    return below(gate_up);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {Ops::packed_bwd().call(grads[0], ctx->get_saved_variables()[0])};
  }
};
template <class Ops, class Act>
struct GatedPackedBackwardFn : torch::autograd::Function<GatedPackedBackwardFn<Ops, Act>> {
  static at::Tensor below(T grad, T gate_up) { return call_below(Ops::packed_bwd(), grad, gate_up); }
  static at::Tensor forward(AutogradContext* ctx, T grad, T gate_up) {
    ctx->save_for_backward({grad, gate_up});
    return below(grad, gate_up);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto halves = s[1].chunk(2, -1);
    const auto gg = grads[0].chunk(2, -1);
    auto d = gated_second<Act>(s[0], halves[0], halves[1], gg[0], gg[1]);
    return {d[0], at::cat({d[1], d[2]}, -1)};
  }
};

// The Autograd kernel of an op: its Function when there is a gradient to record, else straight to the kernel
// below autograd.
template <class Fn, typename... Ts>
auto run(const Ts&... ts) {
  if (!records_grad(ts...)) return Fn::below(ts...);
  if constexpr (std::is_same_v<decltype(Fn::below(ts...)), Pair>) {
    auto r = Fn::apply(ts...);
    return std::make_tuple(r[0], r[1]);
  } else {
    return Fn::apply(ts...);
  }
}

}  // namespace

// Every op of the table (ops_table.h).
#define FFN_EXT_GATED_NAME(name, Act) constexpr char k_##name[] = #name;
FFN_EXT_GATED(FFN_EXT_GATED_NAME)
#undef FFN_EXT_GATED_NAME

TORCH_LIBRARY_IMPL(ffn_ext, Autograd, m) {
#define FFN_EXT_AUTOGRAD_ACT(name, Act, ...)                                        \
  m.impl(#name, [](T x) { return run<UnaryFn<math::Act>>(x); });                   \
  m.impl(#name "_backward", [](T g, T x) { return run<UnaryBackwardFn<math::Act>>(g, x); });
#define FFN_EXT_AUTOGRAD_GATED(name, Act)                                                                    \
  {                                                                                                          \
    using Ops = GatedOps<k_##name>;                                                               \
    m.impl(#name, [](T gate, T up) { return run<GatedFn<Ops>>(gate, up); });                                 \
    m.impl(#name "_backward", [](T g, T gate, T up) { return run<GatedBackwardFn<Ops, math::Act>>(g, gate, up); }); \
    m.impl(#name "_packed", [](T gu) { return run<GatedPackedFn<Ops>>(gu); });                               \
    m.impl(#name "_packed_backward", [](T g, T gu) { return run<GatedPackedBackwardFn<Ops, math::Act>>(g, gu); }); \
  }
  FFN_EXT_ACTIVATIONS(FFN_EXT_AUTOGRAD_ACT)
  FFN_EXT_GATED(FFN_EXT_AUTOGRAD_GATED)
#undef FFN_EXT_AUTOGRAD_ACT
#undef FFN_EXT_AUTOGRAD_GATED
}

}  // namespace ffn_ext
