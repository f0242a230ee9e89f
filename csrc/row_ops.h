// The ffn_ext ops (every line of ops_table.h) as launcher problems: outputs are fresh and contiguous; inputs are used in place when they
// can be seen as rows with a contiguous last dimension (contiguous tensors, chunk/narrow views, expanded rows),
// otherwise made contiguous first. Written once, for a Launcher: cuda/ops.cpp instantiates Ops<CudaLauncher>
// (launching the CUDA kernels of cuda/kernels_part*.cu), the tests' Ops<HostEmulation> (tests/csrc/emulate_rows.cpp:
// the same problems run by rows.h on the CPU).
// On torch's stable API (torch::stable::Tensor). A Launcher has a `Guard` constructed from the output's device
// index and `template <typename T> static void
// run(const F& f, const RowProblem<NI, NO>& p)`.
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <array>
#include <string>
#include <tuple>

#include "ffn_ext.h"
#include "ffn_math.h"
#include "ops_table.h"
#include "rows.h"

namespace ffn_ext {
namespace rows {

// Row stride (elements) of t seen as [numel / size(-1), size(-1)] with unit stride along the last dimension, or
// -1 if its layout cannot be seen that way.
inline int64_t row_stride(const Tensor& t) {
  const int64_t nd = t.dim();
  if (nd == 0) return 1;
  const int64_t cols = t.size(-1);
  if (cols != 1 && t.stride(-1) != 1) return -1;
  int64_t rs = -1, rows = 1;
  for (int64_t d = nd - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (rs < 0) {
      rs = t.stride(d);
    } else if (t.stride(d) != rs * rows) {
      return -1;
    }
    rows *= t.size(d);
  }
  return rs < 0 ? cols : rs;
}

struct Rows {
  Tensor t;        // keeps a contiguous copy alive when one was needed
  int64_t stride;  // row stride in elements
};
inline Rows as_rows(const Tensor& t) {
  const int64_t rs = row_stride(t);
  if (rs >= 0) return {t, rs};
  Tensor c = torch::stable::contiguous(t);  // a dispatcher call: only when needed
  return {c, c.dim() ? c.size(-1) : 1};
}

// The four float dtypes as kernel storage types (c10::Half is torch's header-only Half): AT_DISPATCH has no
// stable form.
template <class Fn>
void dispatch_float(ScalarType dtype, const char* what, Fn&& fn) {
  switch (dtype) {
    case ScalarType::Double: return fn(double{});
    case ScalarType::Float: return fn(float{});
    case ScalarType::Half: return fn(torch::headeronly::Half{});
    case ScalarType::BFloat16: return fn(torch::headeronly::BFloat16{});
    default: detail::fail(what, ": unsupported dtype ", dtype_name(dtype));
  }
}

template <class Launcher, typename F>
void launch(const F& f, ScalarType dtype, const RowProblem<F::NI, F::NO>& p) {
  dispatch_float(dtype, "ffn_ext_rows_kernel", [&](auto tag) { Launcher::template run<decltype(tag)>(f, p); });
}

// Pointer to element `offset` of t's storage view.
inline void* at_offset(const Tensor& t, int64_t offset) {
  return static_cast<char*>(t.data_ptr()) + offset * static_cast<int64_t>(t.element_size());
}

// Ops whose inputs and outputs all have one shape (unary and gated ops and their backwards).
template <class Launcher, typename F, size_t NO = F::NO>
void run_same_shape(const F& f, std::array<Tensor, F::NI> ins, const std::array<Tensor, NO>& outs) {
  const Tensor& out0 = outs[0];
  if (out0.numel() == 0) return;
  const typename Launcher::Guard guard(out0.get_device_index());
  RowProblem<F::NI, F::NO> p;
  if (!out0.is_contiguous()) {
    // A channels_last / channels_last_3d output (shapes.cpp same_shape_format: the inputs are dense in it): every
    // operand in out0's strides, so the same storage position holds the same element in each, and one long row
    // over the storage computes the op at full speed (an input with other strides, e.g. a size-1 dim's, is copied
    // into them first; the outputs share out0's).
    for (int i = 0; i < F::NI; ++i) {
      if (!ins[i].strides().equals(out0.strides())) {
        Tensor c = empty_strided(out0, vec(out0.sizes()), vec(out0.strides()), dtype_of(out0));
        torch::stable::copy_(c, ins[i]);
        ins[i] = c;
      }
      p.in[i] = ins[i].data_ptr();
      p.in_stride[i] = out0.numel();
    }
    for (size_t o = 0; o < NO; ++o) {
      FFN_EXT_CHECK(outs[o].strides().equals(out0.strides()), "ffn_ext: outputs of different strides");
      p.out[o] = outs[o].data_ptr();
      p.out_stride[o] = out0.numel();
    }
    p.cols = out0.numel();
    p.rows = 1;
    launch<Launcher>(f, dtype_of(out0), p);
    return;
  }
  p.cols = out0.dim() ? out0.size(-1) : 1;
  p.rows = out0.numel() / p.cols;
  bool all_contiguous = true;
  for (int i = 0; i < F::NI; ++i) {
    auto r = as_rows(ins[i]);
    ins[i] = r.t;
    p.in[i] = ins[i].data_ptr();
    p.in_stride[i] = r.stride;
    all_contiguous = all_contiguous && ins[i].is_contiguous();
  }
  for (size_t o = 0; o < NO; ++o) {
    p.out[o] = outs[o].data_ptr();
    p.out_stride[o] = p.cols;
  }
  if (all_contiguous) {  // one long row: no per-row head/tail
    p.cols = out0.numel();
    p.rows = 1;
  }
  launch<Launcher>(f, dtype_of(out0), p);
}

// Every op shape over an activation Act or a gate (ffn_math.h); `op` names the op in error messages
// ("ffn_ext.swiglu").
template <class Launcher>
struct Ops {
  template <class Act>
  static Tensor unary(const char* op, const Tensor& x) {
    auto out = alloc_unary(op, x);
    run_same_shape<Launcher>(math::UnaryFwd<Act>{}, {x}, std::array<Tensor, 1>{out});
    return out;
  }
  template <class Act>
  static Tensor unary_backward(const char* op, const Tensor& grad, const Tensor& x) {
    auto out = alloc_unary_backward(op, grad, x);
    run_same_shape<Launcher>(math::UnaryBwd<Act>{}, {grad, x}, std::array<Tensor, 1>{out});
    return out;
  }
  template <class Act>
  static std::tuple<Tensor, Tensor> unary_backward_recompute(const char* op, const Tensor& grad, const Tensor& x) {
    auto outs = alloc_unary_backward_recompute(op, grad, x);
    run_same_shape<Launcher>(math::UnaryBwdRecompute<Act>{}, {grad, x},
                             std::array<Tensor, 2>{std::get<0>(outs), std::get<1>(outs)});
    return outs;
  }
  template <class Gate>
  static Tensor gated(const char* op, const typename Gate::Params& prm, const Tensor& gate, const Tensor& up) {
    check_params(op, prm);
    auto out = alloc_gated(op, gate, up);
    run_same_shape<Launcher>(math::GatedFwd<Gate>(Gate(for_dtype(prm, dtype_of(gate)))), {gate, up},
                             std::array<Tensor, 1>{out});
    return out;
  }
  template <class Gate>
  static std::tuple<Tensor, Tensor> gated_backward(const char* op, const typename Gate::Params& prm, const Tensor& grad,
                                                   const Tensor& gate, const Tensor& up) {
    check_params(op, prm);
    auto outs = alloc_gated_backward(op, grad, gate, up);
    run_same_shape<Launcher>(math::GatedBwd<Gate>(Gate(for_dtype(prm, dtype_of(gate)))), {grad, gate, up},
                             std::array<Tensor, 2>{std::get<0>(outs), std::get<1>(outs)});
    return outs;
  }
  template <class Gate>
  static std::tuple<Tensor, Tensor, Tensor> gated_backward_recompute(const char* op, const typename Gate::Params& prm,
                                                                     const Tensor& grad, const Tensor& gate,
                                                                     const Tensor& up) {
    check_params(op, prm);
    auto outs = alloc_gated_backward_recompute(op, grad, gate, up);
    run_same_shape<Launcher>(math::GatedBwdRecompute<Gate>(Gate(for_dtype(prm, dtype_of(gate)))), {grad, gate, up},
                             std::array<Tensor, 3>{std::get<0>(outs), std::get<1>(outs), std::get<2>(outs)});
    return outs;
  }

  // Packed: gate and up are read in place from each row of gate_up (row stride of gate_up): its two halves
  // ("concat"), or its even and odd elements ("interleaved": one operand of pairs, rows.h; a contiguous gate_up is
  // then one long row).
  template <class Gate>
  static Tensor gated_packed(const char* op, const typename Gate::Params& prm, const Tensor& gate_up,
                             std::string_view layout) {
    check_params(op, prm);
    const Layout lay = parse_layout(op, layout);
    auto out = alloc_gated_packed(op, gate_up);
    if (out.numel() == 0) return out;
    const typename Launcher::Guard guard(out.get_device_index());
    const int64_t m = out.size(-1);
    const auto gu = as_rows(gate_up);
    const ScalarType dtype = dtype_of(out);
    RowProblem<2, 1> p;
    p.rows = out.numel() / m;
    p.cols = m;
    p.in[0] = gu.t.data_ptr();
    p.in_stride[0] = p.in_stride[1] = gu.stride;
    p.out[0] = out.data_ptr();
    p.out_stride[0] = m;
    const math::GatedFwd<Gate> f(Gate{for_dtype(prm, dtype)});
    if (lay == Layout::kConcat) {
      p.in[1] = at_offset(gu.t, m);
      launch<Launcher>(f, dtype, p);
    } else {
      p.in[1] = at_offset(gu.t, 1);
      if (gu.stride == 2 * m) {
        p.cols = out.numel();
        p.rows = 1;
      }
      launch<Launcher>(math::Interleaved<math::GatedFwd<Gate>, 0, -1>(f), dtype, p);
    }
    return out;
  }

  // Packed backward: dgate and dup land in one [..., 2M] tensor, in gate_up's layout, in one kernel.
  template <class Gate>
  static Tensor gated_packed_backward(const char* op, const typename Gate::Params& prm, const Tensor& grad,
                                      const Tensor& gate_up, std::string_view layout) {
    check_params(op, prm);
    const Layout lay = parse_layout(op, layout);
    auto out = alloc_gated_packed_backward(op, grad, gate_up);
    if (out.numel() == 0) return out;
    const typename Launcher::Guard guard(out.get_device_index());
    const int64_t m = grad.size(-1);
    const auto g = as_rows(grad);
    const auto gu = as_rows(gate_up);
    const ScalarType dtype = dtype_of(out);
    RowProblem<3, 2> p;
    p.rows = grad.numel() / m;
    p.cols = m;
    p.in[0] = g.t.data_ptr();
    p.in[1] = gu.t.data_ptr();
    p.in_stride[0] = g.stride;
    p.in_stride[1] = p.in_stride[2] = gu.stride;
    p.out[0] = out.data_ptr();
    p.out_stride[0] = p.out_stride[1] = 2 * m;
    const math::GatedBwd<Gate> f(Gate{for_dtype(prm, dtype)});
    if (lay == Layout::kConcat) {
      p.in[2] = at_offset(gu.t, m);
      p.out[1] = at_offset(out, m);
      launch<Launcher>(f, dtype, p);
    } else {
      p.in[2] = at_offset(gu.t, 1);
      p.out[1] = at_offset(out, 1);
      if (g.stride == m && gu.stride == 2 * m) {
        p.cols = grad.numel();
        p.rows = 1;
      }
      launch<Launcher>(math::Interleaved<math::GatedBwd<Gate>, 1, 0>(f), dtype, p);
    }
    return out;
  }
};

// The ops of the table as free functions of one Launcher, stamped per table line: TORCH_BOX boxes a function
// pointer, not a lambda. Parameters are the schema's, with `str` as std::string.
template <class Launcher>
struct Kernels {
  using O = Ops<Launcher>;
  using T = const Tensor&;
  using Pair = std::tuple<Tensor, Tensor>;
  using Triple = std::tuple<Tensor, Tensor, Tensor>;
#define FFN_EXT_KERNELS_ACT(name, Act, ...) \
  static Tensor name(T x) { return O::template unary<math::Act>("ffn_ext." #name, x); } \
  static Tensor name##_backward(T g, T x) { \
    return O::template unary_backward<math::Act>("ffn_ext." #name "_backward", g, x); \
  } \
  static Pair name##_backward_recompute(T g, T x) { \
    return O::template unary_backward_recompute<math::Act>("ffn_ext." #name "_backward_recompute", g, x); \
  }
#define FFN_EXT_KERNELS_GATED(name, Gate, P) \
  static Tensor name(T gate, T up FFN_EXT_P_DECL_##P) { \
    return O::template gated<math::Gate>("ffn_ext." #name, FFN_EXT_P_MAKE_##P, gate, up); \
  } \
  static Pair name##_backward(T g, T gate, T up FFN_EXT_P_DECL_##P) { \
    return O::template gated_backward<math::Gate>("ffn_ext." #name "_backward", FFN_EXT_P_MAKE_##P, g, gate, up); \
  } \
  static Triple name##_backward_recompute(T g, T gate, T up FFN_EXT_P_DECL_##P) { \
    return O::template gated_backward_recompute<math::Gate>("ffn_ext." #name "_backward_recompute", \
                                                            FFN_EXT_P_MAKE_##P, g, gate, up); \
  } \
  static Tensor name##_packed(T gu FFN_EXT_P_DECL_##P, const std::string& layout) { \
    return O::template gated_packed<math::Gate>("ffn_ext." #name "_packed", FFN_EXT_P_MAKE_##P, gu, layout); \
  } \
  static Tensor name##_packed_backward(T g, T gu FFN_EXT_P_DECL_##P, const std::string& layout) { \
    return O::template gated_packed_backward<math::Gate>("ffn_ext." #name "_packed_backward", FFN_EXT_P_MAKE_##P, g, \
                                                         gu, layout); \
  }
  FFN_EXT_ACTIVATIONS(FFN_EXT_KERNELS_ACT)
  FFN_EXT_GATED(FFN_EXT_KERNELS_GATED)
#undef FFN_EXT_KERNELS_ACT
#undef FFN_EXT_KERNELS_GATED
};

// Registers Kernels<Launcher> with m.impl for one dispatch key: the table lines whose index (ops_table.h
// TableLine) is Part modulo Parts (a line's ops all land in one part; the concat packed ops run their gated op's
// kernels). The other lines are discarded statements, never instantiated.
template <class Launcher, int Parts = 1, int Part = 0>
void impl_all(torch::stable::detail::StableLibrary& m) {
  using K = Kernels<Launcher>;
#define FFN_EXT_IMPL_ACT(name, Act, ...) \
  if constexpr (kLine_##name % Parts == Part) { \
    m.impl(#name, TORCH_BOX(&K::name)); \
    m.impl(#name "_backward", TORCH_BOX(&K::name##_backward)); \
    m.impl(#name "_backward_recompute", TORCH_BOX(&K::name##_backward_recompute)); \
  }
#define FFN_EXT_IMPL_GATED(name, Gate, P) \
  if constexpr (kLine_##name % Parts == Part) { \
    m.impl(#name, TORCH_BOX(&K::name)); \
    m.impl(#name "_backward", TORCH_BOX(&K::name##_backward)); \
    m.impl(#name "_backward_recompute", TORCH_BOX(&K::name##_backward_recompute)); \
    m.impl(#name "_packed", TORCH_BOX(&K::name##_packed)); \
    m.impl(#name "_packed_backward", TORCH_BOX(&K::name##_packed_backward)); \
  }
  FFN_EXT_ACTIVATIONS(FFN_EXT_IMPL_ACT)
  FFN_EXT_GATED(FFN_EXT_IMPL_GATED)
#undef FFN_EXT_IMPL_ACT
#undef FFN_EXT_IMPL_GATED
}

}  // namespace rows
}  // namespace ffn_ext
