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
#include <tuple>
#include <type_traits>

#include "ffn_ext.h"
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

// The op below the autograd keys (each Function's forward, and the whole op when there is nothing to record).
template <typename Sig, typename... Ts>
auto call_below(const c10::TypedOperatorHandle<Sig>& handle, const Ts&... ts) {
  at::AutoDispatchBelowADInplaceOrView below;
  return handle.call(ts...);
}

// ---- second derivatives: ATen ops (themselves differentiable), each activation's d2 (ffn_math.h) over tensors
// (the functions d2 may use; step for piecewise functions: 1 where x > 0, else 0, a constant to autograd, whose
// derivative is 0 away from the kink, and where(x > 0, a, b) for a piecewise d2 of two expressions)
struct TensorMath {
  static at::Tensor exp(T x) { return at::exp(x); }
  static at::Tensor sigmoid(T x) { return at::sigmoid(x); }
  static at::Tensor step(T x) { return (x > 0).to(x.scalar_type()); }
  static at::Tensor where_positive(T x, T a, T b) { return at::where(x > 0, a, b); }
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

// ---- second derivatives of the gated ops, by gate: gradients of (dgate, dup) = name_backward(grad, gate, up)
// w.r.t. (grad, gate, up), given gg_gate, gg_up (ATen ops throughout, so they are differentiable themselves).
template <class Gate> struct Second;

// Glu<Act>: (dgate, dup) = (grad up act'(gate), grad act(gate)). act and grad * act' are the activation's own ops
// (differentiable through their Functions below), act'' its d2.
template <class Act>
struct Second<math::Glu<Act>> {
  static variable_list of(const math::NoParams&, T grad, T gate, T up, T gg_gate, T gg_up) {
    const auto& act = ActOps<Act>::fwd();
    const auto& act_bwd = ActOps<Act>::bwd();  // (g, x) -> g * act'(x)
    auto gg_gate_up = gg_gate * up;
    return {act_bwd.call(gg_gate_up, gate) + gg_up * act.call(gate),
            grad * gg_gate_up * grad2<Act>(gate) + act_bwd.call(grad * gg_up, gate),
            act_bwd.call(grad * gg_gate, gate)};
  }
};

// SwigluClamped: with x = clamp(gate, max=L), c = clamp(up, -L, L) + up_offset, h(x) = x sigmoid(alpha x) and the
// masks mg, mu where the clamps pass the gradient (clamp_pass_g, clamp_pass_u): (dgate, dup) = (mg ? grad c h'(x) : 0, mu ? grad h(x) : 0), where
// h'(x) = silu'(alpha x), h''(x) = alpha silu''(alpha x), dx/dgate = mg, dc/dup = mu.
template <>
struct Second<math::SwigluClamped> {
  static variable_list of(const math::ClampParams& p, T grad, T gate, T up, T gg_gate, T gg_up) {
    const auto mg = clamp_pass_g(gate, p);
    const auto mu = clamp_pass_u(up, p);
    const auto x = gate.clamp_max(p.limit);
    const auto c = up.clamp(-p.limit, p.limit) + p.up_offset;
    const auto z = x * p.alpha;
    const auto s = at::sigmoid(z);
    const auto h = x * s;
    const auto dh = s * (z * (1 - s) + 1);
    const auto d2h = math::Silu::d2<TensorMath>(z) * p.alpha;
    return {at::where(mg, gg_gate * c * dh, 0) + at::where(mu, gg_up * h, 0),
            at::where(mg, gg_gate * grad * c * d2h + at::where(mu, gg_up * grad * dh, 0), 0),
            at::where(mg.logical_and(mu), gg_gate * grad * dh, 0)};
  }
};

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

// ---- gated ops: name(gate, up, params...), name_backward, name_packed(gate_up, params..., layout) and its
// backward. A gate's Params (ffn_math.h) travel as the ops' trailing scalar arguments and in ctx->saved_data; the
// Functions take them (and the layout) as non-tensor inputs, whose gradients are undefined.
inline std::tuple<> param_args(const math::NoParams&) { return {}; }
inline std::tuple<double, double, double> param_args(const math::ClampParams& p) {
  return {p.limit, p.alpha, p.up_offset};
}
inline void save_params(AutogradContext*, const math::NoParams&) {}
inline void save_params(AutogradContext* ctx, const math::ClampParams& p) {
  ctx->saved_data["limit"] = p.limit;
  ctx->saved_data["alpha"] = p.alpha;
  ctx->saved_data["up_offset"] = p.up_offset;
}
template <class P> P load_params(AutogradContext* ctx);
template <> math::NoParams load_params(AutogradContext*) { return {}; }
template <> math::ClampParams load_params(AutogradContext* ctx) {
  return {ctx->saved_data["limit"].toDouble(), ctx->saved_data["alpha"].toDouble(),
          ctx->saved_data["up_offset"].toDouble()};
}
Layout load_layout(AutogradContext* ctx, const char* op) {
  return parse_layout(op, ctx->saved_data["layout"].toStringRef());
}

// R(A...) for the argument types of some tuples, concatenated.
template <class R, class Tuple> struct FnOf;
template <class R, class... A> struct FnOf<R, std::tuple<A...>> {
  using type = R(A...);
};
template <class R, class... Tuples>
using Sig = typename FnOf<R, decltype(std::tuple_cat(std::declval<Tuples>()...))>::type;
using Str = c10::string_view;

// The four ops of a gated line (Name "swiglu", its Gate functor), called with a Params.
template <const char* Name, class Gate_>
struct GatedOps {
  using Gate = Gate_;
  using P = typename Gate::Params;
  using PArgs = decltype(param_args(std::declval<P>()));
  static std::string name(const char* suffix) { return std::string("ffn_ext::") + Name + suffix; }
  static at::Tensor fwd(T gate, T up, const P& p) {
    static const auto h = op<Sig<at::Tensor, std::tuple<T, T>, PArgs>>(name("").c_str());
    return std::apply([&](auto... a) { return h.call(gate, up, a...); }, param_args(p));
  }
  static Pair bwd(T grad, T gate, T up, const P& p) {
    static const auto h = op<Sig<Pair, std::tuple<T, T, T>, PArgs>>(name("_backward").c_str());
    return std::apply([&](auto... a) { return h.call(grad, gate, up, a...); }, param_args(p));
  }
  static at::Tensor packed(T gate_up, const P& p, Str layout) {
    static const auto h = op<Sig<at::Tensor, std::tuple<T>, PArgs, std::tuple<Str>>>(name("_packed").c_str());
    return std::apply([&](auto... a) { return h.call(gate_up, a..., layout); }, param_args(p));
  }
  static at::Tensor packed_bwd(T grad, T gate_up, const P& p, Str layout) {
    static const auto h =
        op<Sig<at::Tensor, std::tuple<T, T>, PArgs, std::tuple<Str>>>(name("_packed_backward").c_str());
    return std::apply([&](auto... a) { return h.call(grad, gate_up, a..., layout); }, param_args(p));
  }
};

template <class Ops>
struct GatedFn : torch::autograd::Function<GatedFn<Ops>> {
  using P = typename Ops::P;
  static at::Tensor below(T gate, T up, const P& p) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return Ops::fwd(gate, up, p);
  }
  static at::Tensor forward(AutogradContext* ctx, T gate, T up, const P& p) {
    ctx->save_for_backward({gate, up});
    save_params(ctx, p);
    return below(gate, up, p);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dgate, dup] = Ops::bwd(grads[0], saved[0], saved[1], load_params<P>(ctx));
    return {ctx->needs_input_grad(0) ? dgate : at::Tensor(), ctx->needs_input_grad(1) ? dup : at::Tensor(),
            at::Tensor()};
  }
};
template <class Ops>
struct GatedBackwardFn : torch::autograd::Function<GatedBackwardFn<Ops>> {
  using P = typename Ops::P;
  static Pair below(T grad, T gate, T up, const P& p) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return Ops::bwd(grad, gate, up, p);
  }
  static variable_list forward(AutogradContext* ctx, T grad, T gate, T up, const P& p) {
    ctx->save_for_backward({grad, gate, up});
    save_params(ctx, p);
    auto [dgate, dup] = below(grad, gate, up, p);
    return {dgate, dup};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto d = Second<typename Ops::Gate>::of(load_params<P>(ctx), s[0], s[1], s[2], grads[0], grads[1]);
    d.emplace_back();
    return d;
  }
};
template <class Ops>
struct GatedPackedFn : torch::autograd::Function<GatedPackedFn<Ops>> {
  using P = typename Ops::P;
  static at::Tensor below(T gate_up, const P& p, Str layout) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return Ops::packed(gate_up, p, layout);
  }
  static at::Tensor forward(AutogradContext* ctx, T gate_up, const P& p, Str layout) {
    ctx->save_for_backward({gate_up});
    save_params(ctx, p);
    ctx->saved_data["layout"] = std::string(layout);
    return below(gate_up, p, layout);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& layout = ctx->saved_data["layout"].toStringRef();
    return {Ops::packed_bwd(grads[0], ctx->get_saved_variables()[0], load_params<P>(ctx), layout), at::Tensor(),
            at::Tensor()};
  }
};
template <class Ops>
struct GatedPackedBackwardFn : torch::autograd::Function<GatedPackedBackwardFn<Ops>> {
  using P = typename Ops::P;
  static at::Tensor below(T grad, T gate_up, const P& p, Str layout) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return Ops::packed_bwd(grad, gate_up, p, layout);
  }
  static at::Tensor forward(AutogradContext* ctx, T grad, T gate_up, const P& p, Str layout) {
    ctx->save_for_backward({grad, gate_up});
    save_params(ctx, p);
    ctx->saved_data["layout"] = std::string(layout);
    return below(grad, gate_up, p, layout);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const Layout lay = load_layout(ctx, "ffn_ext: packed double backward");
    const int64_t m = s[0].size(-1);
    const auto [gate, up] = split_packed(s[1], m, lay);
    const auto [gg_gate, gg_up] = split_packed(grads[0], m, lay);
    auto d = Second<typename Ops::Gate>::of(load_params<P>(ctx), s[0], gate, up, gg_gate, gg_up);
    return {d[0], join_packed(d[1], d[2], lay), at::Tensor(), at::Tensor()};
  }
};

// Whether an argument needs the op's Function: a tensor that requires grad or carries a forward-mode tangent.
inline bool requires_grad_(const at::Tensor& t) { return t.requires_grad(); }
inline bool has_tangent_(const at::Tensor& t) { return t._fw_grad(/*level=*/0).defined(); }
template <class X> bool requires_grad_(const X&) { return false; }
template <class X> bool has_tangent_(const X&) { return false; }

// The Autograd kernel of an op: its Function when there is a gradient to record, else straight to the kernel
// below autograd. With no gradient to record (grad mode off, or no input requires grad) and no forward-mode
// tangent, Function::apply's bookkeeping is skipped on the inference path; otherwise Function::apply runs (and
// raises for forward-mode AD, which these ops do not support).
template <class Fn, typename... Ts>
auto run(const Ts&... ts) {
  const bool grad = at::GradMode::is_enabled() && (requires_grad_(ts) || ...);
  if (!grad && !(has_tangent_(ts) || ...)) return Fn::below(ts...);
  if constexpr (std::is_same_v<decltype(Fn::below(ts...)), Pair>) {
    auto r = Fn::apply(ts...);
    return std::make_tuple(r[0], r[1]);
  } else {
    return Fn::apply(ts...);
  }
}

// name_backward_recompute(grad, x) -> (grad * act'(x), act(x)): the classic FFN's lean backward calls it where
// nothing records a gradient (inside an autograd.Function's backward), so it has no derivative of its own; where one
// would be recorded it raises instead of returning results that autograd silently treats as constants.
template <class Act>
Pair recompute_no_autograd(T grad, T x) {
  static const auto h = op<Pair(T, T)>(ActOps<Act>::name("_backward_recompute").c_str());
  const bool grad_mode = at::GradMode::is_enabled() && (grad.requires_grad() || x.requires_grad());
  TORCH_CHECK(!grad_mode && !has_tangent_(grad) && !has_tangent_(x), ActOps<Act>::name("_backward_recompute"),
              " has no autograd formula (it serves a backward pass); call it under torch.no_grad() or with inputs "
              "that do not require grad, or differentiate ",
              ActOps<Act>::name("_backward"), " instead");
  return call_below(h, grad, x);
}

}  // namespace

// Every op of the table (ops_table.h).
#define FFN_EXT_GATED_NAME(name, ...) constexpr char k_##name[] = #name;
FFN_EXT_GATED(FFN_EXT_GATED_NAME)
#undef FFN_EXT_GATED_NAME

TORCH_LIBRARY_IMPL(ffn_ext, Autograd, m) {
#define FFN_EXT_AUTOGRAD_ACT(name, Act, ...) \
  m.impl(#name, [](T x) { return run<UnaryFn<math::Act>>(x); }); \
  m.impl(#name "_backward", [](T g, T x) { return run<UnaryBackwardFn<math::Act>>(g, x); }); \
  m.impl(#name "_backward_recompute", [](T g, T x) { return recompute_no_autograd<math::Act>(g, x); });
#define FFN_EXT_AUTOGRAD_GATED(name, Gate, P) \
  { \
    using Ops = GatedOps<k_##name, math::Gate>; \
    m.impl(#name, [](T gate, T up FFN_EXT_P_DECL_##P) { return run<GatedFn<Ops>>(gate, up, FFN_EXT_P_MAKE_##P); }); \
    m.impl(#name "_backward", [](T g, T gate, T up FFN_EXT_P_DECL_##P) { \
      return run<GatedBackwardFn<Ops>>(g, gate, up, FFN_EXT_P_MAKE_##P); \
    }); \
    m.impl(#name "_packed", [](T gu FFN_EXT_P_DECL_##P, Str layout) { \
      return run<GatedPackedFn<Ops>>(gu, FFN_EXT_P_MAKE_##P, layout); \
    }); \
    m.impl(#name "_packed_backward", [](T g, T gu FFN_EXT_P_DECL_##P, Str layout) { \
      return run<GatedPackedBackwardFn<Ops>>(g, gu, FFN_EXT_P_MAKE_##P, layout); \
    }); \
  }
  FFN_EXT_ACTIVATIONS(FFN_EXT_AUTOGRAD_ACT)
  FFN_EXT_GATED(FFN_EXT_AUTOGRAD_GATED)
#undef FFN_EXT_AUTOGRAD_ACT
#undef FFN_EXT_AUTOGRAD_GATED
}

}  // namespace ffn_ext
