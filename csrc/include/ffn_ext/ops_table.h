// The one table of ffn_ext's ops. Everything op by op is generated from these two lists: the schemas and Meta
// kernels (registration.cpp), the CPU kernels (aten_ops.cpp), the CUDA kernels (cuda/kernels_part*.cu), autograd with
// double backward (autograd.cpp), the fast entry points (python_module.cpp), and the public C++ API (<ffn_ext/ops.h>,
// which installs this header next to it: its lines are only macro text there, expanded by the sources above). The
// Python side has its own table, ffn_ext/table.py, with the same names. README "Adding an activation".
//
// FFN_EXT_ACTIVATIONS(X): X(name, Act, aten_forward, aten_backward), one line per activation:
//   ops  name(Tensor x) -> Tensor                       act(x)
//        name_backward(Tensor grad, Tensor x) -> Tensor grad * act'(x)
//   Act  its functor in ffn_math.h (f, df for the kernels, and bwd where act' is unbounded; d2 for double backward)
//   aten_forward, aten_backward  the CPU kernels' ATen composites, expressions in (out, x) and (out, grad, x)
//
// FFN_EXT_GATED(X): X(name, Gate, P), one line per gated op, Gate its functor in ffn_math.h (Glu<Act>: act(gate) * up
// over an activation above; or a gate of its own), P its keyword parameters (FFN_EXT_P_* below: NONE or CLAMP):
//   ops  name(Tensor gate, Tensor up[, *, P]) -> Tensor                       gate(gate, up)
//        name_backward(Tensor grad, Tensor gate, Tensor up[, *, P]) -> (Tensor, Tensor)   (dgate, dup)
//        name_packed(Tensor gate_up, *[, P], str layout="concat") -> Tensor       [..., 2M] -> [..., M]
//        name_packed_backward(Tensor grad, Tensor gate_up, *[, P], str layout="concat") -> Tensor  [..., 2M]
//   layout of gate_up (and of the packed backward's [dgate, dup]): "concat" [gate | up] (gate = gate_up[..., :M]),
//   or "interleaved" [g0, u0, g1, u1, ...] (gate = gate_up[..., ::2], GPT-OSS).
#pragma once

// clang-format off: the tables are read as tables, an entry per line (or two), not as code to reflow
#define FFN_EXT_ACTIVATIONS(X)                                                                  \
  X(gelu, Gelu, at::gelu_out(out, x), at::gelu_backward_out(out, grad, x))                      \
  X(gelu_tanh, GeluTanh, at::gelu_out(out, x, "tanh"), at::gelu_backward_out(out, grad, x, "tanh")) \
  X(silu, Silu, at::silu_out(out, x), at::silu_backward_out(out, grad, x))                     \
  X(relu, Relu, at::clamp_min_out(out, x, 0),                            \
    at::mul_out(out, grad, at::where(x.isnan(), x, (x > 0).to(x.scalar_type()))))             \
  X(relu2, Relu2, [&] { const auto r = at::relu(x); at::mul_out(out, r, r); }(),                \
    at::mul_out(out, grad, at::relu(x)).mul_(2))                                               \
  X(quick_gelu, QuickGelu, at::mul_out(out, x, at::sigmoid(x * 1.702)),                          \
    [&] { const auto s = at::sigmoid(x * 1.702); at::mul_out(out, grad, s * (x * 1.702 * (1 - s) + 1)); }())

#define FFN_EXT_GATED(X)                \
  X(swiglu, Glu<math::Silu>, NONE)      \
  X(geglu, Glu<math::Gelu>, NONE)       \
  X(geglu_tanh, Glu<math::GeluTanh>, NONE)\
  X(reglu, Glu<math::Relu>, NONE)       \
  X(relu2_glu, Glu<math::Relu2>, NONE)  \
  X(geglu_quick, Glu<math::QuickGelu>, NONE) \
  X(swiglu_clamped, SwigluClamped, CLAMP)

// Keyword parameters of a gated op, by the name in its line's P column (pasted: FFN_EXT_P_SCHEMA_##P ...):
//   SCHEMA  the schema's keyword arguments, each preceded by ", "; KWONLY: ", *" and them (or nothing)
//   DECL    the same as C++ parameters of a kernel, each preceded by ", "
//   ARGS    those parameters' names, each preceded by ", " (to pass them on)
//   MAKE    the functor's Params (ffn_math.h) from them
//   DEFAULTS  DECL with the schema's defaults (<ffn_ext/ops.h>'s declarations)
#define FFN_EXT_P_SCHEMA_NONE ""
#define FFN_EXT_P_KWONLY_NONE ""
#define FFN_EXT_P_DECL_NONE
#define FFN_EXT_P_ARGS_NONE
#define FFN_EXT_P_MAKE_NONE math::NoParams{}
#define FFN_EXT_P_DEFAULTS_NONE
#define FFN_EXT_P_SCHEMA_CLAMP ", float limit, float alpha=1.0, float up_offset=0.0"
#define FFN_EXT_P_KWONLY_CLAMP ", *" FFN_EXT_P_SCHEMA_CLAMP
#define FFN_EXT_P_DECL_CLAMP , double limit, double alpha, double up_offset
#define FFN_EXT_P_ARGS_CLAMP , limit, alpha, up_offset
#define FFN_EXT_P_MAKE_CLAMP math::ClampParams{limit, alpha, up_offset}
#define FFN_EXT_P_DEFAULTS_CLAMP , double limit, double alpha = 1.0, double up_offset = 0.0
// clang-format on
