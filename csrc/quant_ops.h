// The quantizing ops as QuantProblems (quant_kernel.h) for a Launcher: cuda/ops.cpp instantiates QuantOps
// with the CUDA launcher (cuda/launch_quant.h's launch_quant, the kernels in cuda/quant_part*.cu),
// the tests' host emulation (tests/csrc/emulate_quant.cpp). Every recipe has a kernel: scaling "group" (one
// launch), "row" (one launch: the row's amax in the block) and "tensor" (static scale: one launch; dynamic: two, the
// tensor's amax first). float64 inputs run the composite instead (the device's unfused op, then quant.cpp's ATen
// formula; bit-identical, several passes). A Launcher has `template <typename T, class F, bool Pair> static void
// run(const quant::QuantProblem&, const F&)` (it picks the kernels from p.scaling) and a `Guard` made from the
// device.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <functional>
#include <tuple>
#include <type_traits>
#include <vector>

#include <torch/library.h>

#include "ffn_ext.h"
#include "ops_table.h"
#include "quant.h"
#include "quant_kernel.h"
#include "row_ops.h"

namespace ffn_ext {
namespace quant {

template <class Sig>
c10::TypedOperatorHandle<Sig> unfused_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

template <class Launcher>
struct QuantOps {
  using T_ = const at::Tensor&;
  using Out = std::tuple<at::Tensor, at::Tensor>;

  static bool fused(const Recipe&, at::ScalarType dtype) {
    return dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
  }

  static QuantProblem problem(const Recipe& r, const at::Tensor& q, const at::Tensor& scale) {
    QuantProblem p{};
    p.q = static_cast<uint8_t*>(q.data_ptr());
    p.scale = scale.data_ptr();
    p.cols = q.dim() ? q.size(-1) : 1;
    p.rows = 1;  // rows of K = 0 count too: each still has its (row) scale
    for (int64_t d = 0; d + 1 < q.dim(); ++d) p.rows *= q.size(d);
    p.scaling = r.scaling == Scaling::kGroup ? QScaling::kGroup
                                             : (r.scaling == Scaling::kRow ? QScaling::kRow : QScaling::kTensor);
    if (p.scaling != QScaling::kTensor) {
      p.scale_row = scale.dim() >= 2 ? scale.stride(-2) : scale.size(-1);  // column layout: 1
      p.scale_col = scale.stride(-1);
      if (scale.dim() == 1) p.scale_row = 0;  // one row
    }
    p.lanes = static_cast<int>(r.group_size / (kLaneElems * kGroupChunks));
    p.fp8_max = r.fp8_max();
    p.pow2 = r.pow2;
    p.e8m0 = r.scale_dtype == at::kFloat8_e8m0fnu;
    p.phase = QPhase::kQuantize;
    p.has_static = r.static_scale.has_value();
    if (p.has_static) {  // the composite's scale: static_scale as float32, then rounded up to a power of two
      float s = static_cast<float>(*r.static_scale);
      if (r.pow2 && s == s) s = math::bits_f32((math::f32_bits(s) + 0x7FFFFFu) & 0x7F800000u);
      p.static_scale = s;
    }
    return p;
  }

  static bool aligned(const void* ptr, int64_t stride, size_t elem) {
    return rows::aligned16(ptr) && (stride * static_cast<int64_t>(elem)) % 16 == 0;
  }

  template <class Gate>
  static Out gated(const char* op, const typename Gate::Params& prm, const Recipe& r, T_ gate, T_ up,
                   const std::function<at::Tensor()>& unfused) {
    auto [q, s] = alloc_gated(op, prm, r, gate, up);
    if (!fused(r, gate.scalar_type())) {
      quantize_aten(unfused(), r, q, s);
      return {q, s};
    }
    typename Launcher::Guard guard(q.device());
    const auto g = rows::as_rows(gate), u = rows::as_rows(up);
    QuantProblem p = problem(r, q, s);
    p.in[0] = g.t.data_ptr(), p.in[1] = u.t.data_ptr();
    p.in_stride[0] = g.stride, p.in_stride[1] = u.stride;
    const size_t e = gate.element_size();
    p.vectorized = aligned(p.in[0], g.stride, e) && aligned(p.in[1], u.stride, e);
    run_typed<GatedH<Gate>, false>(GatedH<Gate>{Gate(for_dtype(prm, gate.scalar_type()))}, gate.scalar_type(), p);
    return {q, s};
  }

  template <class Gate>
  static Out packed(const char* op, const typename Gate::Params& prm, const Recipe& r, T_ gate_up,
                    c10::string_view layout, const std::function<at::Tensor()>& unfused) {
    auto [q, s] = alloc_packed(op, prm, r, gate_up, layout);
    const Layout lay = parse_layout(op, layout);
    if (!fused(r, gate_up.scalar_type())) {
      quantize_aten(unfused(), r, q, s);
      return {q, s};
    }
    typename Launcher::Guard guard(q.device());
    const auto gu = rows::as_rows(gate_up);
    QuantProblem p = problem(r, q, s);
    const size_t e = gate_up.element_size();
    const GatedH<Gate> f{Gate(for_dtype(prm, gate_up.scalar_type()))};
    if (lay == Layout::kInterleaved) {
      p.in[0] = gu.t.data_ptr(), p.in_stride[0] = gu.stride;
      p.vectorized = aligned(p.in[0], gu.stride, e);
      run_typed<GatedH<Gate>, true>(f, gate_up.scalar_type(), p);
    } else {
      const int64_t half = p.cols;
      p.in[0] = gu.t.data_ptr();
      p.in[1] = static_cast<const char*>(p.in[0]) + half * static_cast<int64_t>(e);
      p.in_stride[0] = p.in_stride[1] = gu.stride;
      p.vectorized = aligned(p.in[0], gu.stride, e) && aligned(p.in[1], gu.stride, e);
      run_typed<GatedH<Gate>, false>(f, gate_up.scalar_type(), p);
    }
    return {q, s};
  }

  static Out quantize(const Recipe& r, T_ x) {
    auto [q, s] = alloc_x("ffn_ext.quantize", r, x);
    if (!fused(r, x.scalar_type())) {
      quantize_aten(x, r, q, s);
      return {q, s};
    }
    typename Launcher::Guard guard(q.device());
    const auto xr = rows::as_rows(x);
    QuantProblem p = problem(r, q, s);
    p.in[0] = xr.t.data_ptr(), p.in_stride[0] = xr.stride;
    p.vectorized = aligned(p.in[0], xr.stride, x.element_size());
    run_typed<Identity, false>(Identity{}, x.scalar_type(), p);
    return {q, s};
  }

  template <class F, bool Pair>
  static void run_typed(const F& f, at::ScalarType dtype, const QuantProblem& p) {
    // group: nothing to write without elements; row: each row's scale, even for K = 0; tensor: always the scale
    if (p.rows == 0 && p.scaling != QScaling::kTensor) return;
    if (p.cols == 0 && p.scaling == QScaling::kGroup) return;
    switch (dtype) {
      case at::kFloat: Launcher::template run<float, F, Pair>(p, f); break;
      case at::kHalf: Launcher::template run<c10::Half, F, Pair>(p, f); break;
      case at::kBFloat16: Launcher::template run<c10::BFloat16, F, Pair>(p, f); break;
      default: TORCH_CHECK(false, "ffn_ext quantizing kernel: unsupported dtype");
    }
  }
};

// Every quantizing op for one dispatch key, through QuantOps<Launcher>; the composite's h is the unfused op on the
// same device (through the dispatcher).
template <class Launcher>
void impl_quant_all(torch::Library& m) {
  using T = const at::Tensor&;
  using Q = QuantOps<Launcher>;
#define FFN_EXT_QUANT_FUSED(name, Gate, P) \
  m.impl(#name "_quant", [](T gate, T up, FFN_EXT_QUANT_DECL FFN_EXT_P_DECL_##P) { \
    const char* op = "ffn_ext." #name "_quant"; \
    static const auto h_op = unfused_op<at::Tensor(T, T FFN_EXT_P_DECL_##P)>("ffn_ext::" #name); \
    return Q::template gated<math::Gate>(op, FFN_EXT_P_MAKE_##P, parse_recipe(op, FFN_EXT_QUANT_ARGS), gate, up, \
                                         [&] { return h_op.call(gate, up FFN_EXT_P_ARGS_##P); }); \
  }); \
  m.impl(#name "_packed_quant", [](T gu, FFN_EXT_QUANT_DECL FFN_EXT_P_DECL_##P, c10::string_view layout) { \
    const char* op = "ffn_ext." #name "_packed_quant"; \
    static const auto h_op = \
        unfused_op<at::Tensor(T FFN_EXT_P_DECL_##P, c10::string_view)>("ffn_ext::" #name "_packed"); \
    return Q::template packed<math::Gate>(op, FFN_EXT_P_MAKE_##P, parse_recipe(op, FFN_EXT_QUANT_ARGS), gu, layout, \
                                          [&] { return h_op.call(gu FFN_EXT_P_ARGS_##P, layout); }); \
  });
  FFN_EXT_GATED(FFN_EXT_QUANT_FUSED)
#undef FFN_EXT_QUANT_FUSED
  m.impl("quantize",
         [](T x, FFN_EXT_QUANT_DECL) { return Q::quantize(parse_recipe("ffn_ext.quantize", FFN_EXT_QUANT_ARGS), x); });
}

}  // namespace quant
}  // namespace ffn_ext
