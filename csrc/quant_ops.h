// The quantizing ops as QuantProblems (quant_kernel.h) for a Launcher: cuda/ops.cpp instantiates QuantOps
// with the CUDA launcher (cuda/launch_quant.h's launch_quant, the kernels in cuda/quant_part*.cu),
// the tests' host emulation (tests/csrc/emulate_quant.cpp). Every recipe has a kernel: scaling "group" (one
// launch), "row" (one launch: the row's amax in the block) and "tensor" (static scale: one launch; dynamic: two, the
// tensor's amax first). float64 inputs have no fused kernel: they are refused here, and the Python API routes them
// to the ATen formula (ffn_ext/quant.py), which the stable ABI cannot call from here without a second copy of it.
// A Launcher has `template <typename T, class F, bool Pair> static void
// run(const quant::QuantProblem&, const F&)` (it picks the kernels from p.scaling) and a `Guard` made from the
// device.
#pragma once

#include <torch/csrc/stable/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ffn_ext.h"
#include "ops_table.h"
#include "quant.h"
#include "quant_kernel.h"
#include "row_ops.h"

namespace ffn_ext {
namespace quant {

template <class Launcher>
struct QuantOps {
  using T_ = const Tensor&;
  using Out = std::tuple<Tensor, Tensor>;

  static void require_fused(const char* op, ScalarType dtype) {
    FFN_EXT_CHECK(dtype == ScalarType::Float || dtype == ScalarType::Half || dtype == ScalarType::BFloat16, op,
                  ": the CUDA kernels quantize float32, float16 and bfloat16 inputs, got ", dtype_name(dtype),
                  " (the Python API computes float64 with the ATen formula)");
  }

  static QuantProblem problem(const Recipe& r, const Tensor& q, const Tensor& scale) {
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
    p.e8m0 = r.scale_dtype == ScalarType::Float8_e8m0fnu;
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
  static Out gated(const char* op, const typename Gate::Params& prm, const Recipe& r, T_ gate, T_ up) {
    auto [q, s] = alloc_gated(op, prm, r, gate, up);
    const ScalarType dtype = dtype_of(gate);
    require_fused(op, dtype);
    typename Launcher::Guard guard(q.get_device_index());
    const auto g = rows::as_rows(gate), u = rows::as_rows(up);
    QuantProblem p = problem(r, q, s);
    p.in[0] = g.t.data_ptr(), p.in[1] = u.t.data_ptr();
    p.in_stride[0] = g.stride, p.in_stride[1] = u.stride;
    const size_t e = gate.element_size();
    p.vectorized = aligned(p.in[0], g.stride, e) && aligned(p.in[1], u.stride, e);
    run_typed<GatedH<Gate>, false>(GatedH<Gate>{Gate(for_dtype(prm, dtype))}, dtype, p);
    return {q, s};
  }

  template <class Gate>
  static Out packed(const char* op, const typename Gate::Params& prm, const Recipe& r, T_ gate_up,
                    std::string_view layout) {
    auto [q, s] = alloc_packed(op, prm, r, gate_up, layout);
    const Layout lay = parse_layout(op, layout);
    const ScalarType dtype = dtype_of(gate_up);
    require_fused(op, dtype);
    typename Launcher::Guard guard(q.get_device_index());
    const auto gu = rows::as_rows(gate_up);
    QuantProblem p = problem(r, q, s);
    const size_t e = gate_up.element_size();
    const GatedH<Gate> f{Gate(for_dtype(prm, dtype))};
    if (lay == Layout::kInterleaved) {
      p.in[0] = gu.t.data_ptr(), p.in_stride[0] = gu.stride;
      p.vectorized = aligned(p.in[0], gu.stride, e);
      run_typed<GatedH<Gate>, true>(f, dtype, p);
    } else {
      const int64_t half = p.cols;
      p.in[0] = gu.t.data_ptr();
      p.in[1] = static_cast<const char*>(p.in[0]) + half * static_cast<int64_t>(e);
      p.in_stride[0] = p.in_stride[1] = gu.stride;
      p.vectorized = aligned(p.in[0], gu.stride, e) && aligned(p.in[1], gu.stride, e);
      run_typed<GatedH<Gate>, false>(f, dtype, p);
    }
    return {q, s};
  }

  static Out quantize(const Recipe& r, T_ x) {
    auto [q, s] = alloc_x("ffn_ext.quantize", r, x);
    const ScalarType dtype = dtype_of(x);
    require_fused("ffn_ext.quantize", dtype);
    typename Launcher::Guard guard(q.get_device_index());
    const auto xr = rows::as_rows(x);
    QuantProblem p = problem(r, q, s);
    p.in[0] = xr.t.data_ptr(), p.in_stride[0] = xr.stride;
    p.vectorized = aligned(p.in[0], xr.stride, x.element_size());
    run_typed<Identity, false>(Identity{}, dtype, p);
    return {q, s};
  }

  template <class F, bool Pair>
  static void run_typed(const F& f, ScalarType dtype, const QuantProblem& p) {
    // group: nothing to write without elements; row: each row's scale, even for K = 0; tensor: always the scale
    if (p.rows == 0 && p.scaling != QScaling::kTensor) return;
    if (p.cols == 0 && p.scaling == QScaling::kGroup) return;
    switch (dtype) {
      case ScalarType::Float: Launcher::template run<float, F, Pair>(p, f); break;
      case ScalarType::Half: Launcher::template run<torch::headeronly::Half, F, Pair>(p, f); break;
      case ScalarType::BFloat16: Launcher::template run<torch::headeronly::BFloat16, F, Pair>(p, f); break;
      default: detail::fail("ffn_ext quantizing kernel: unsupported dtype");
    }
  }
};

// The quantizing ops of one Launcher as free functions, stamped per table line (TORCH_BOX takes function pointers).
template <class Launcher>
struct QuantKernels {
  using Q = QuantOps<Launcher>;
  using T = const Tensor&;
  using Out = std::tuple<Tensor, Tensor>;
#define FFN_EXT_QUANT_KERNELS(name, Gate, P) \
  static Out name##_quant(T gate, T up, FFN_EXT_QUANT_DECL FFN_EXT_P_DECL_##P) { \
    const char* op = "ffn_ext." #name "_quant"; \
    return Q::template gated<math::Gate>(op, FFN_EXT_P_MAKE_##P, parse_recipe(op, FFN_EXT_QUANT_ARGS), gate, up); \
  } \
  static Out name##_packed_quant(T gu, FFN_EXT_QUANT_DECL FFN_EXT_P_DECL_##P, const std::string& layout) { \
    const char* op = "ffn_ext." #name "_packed_quant"; \
    return Q::template packed<math::Gate>(op, FFN_EXT_P_MAKE_##P, parse_recipe(op, FFN_EXT_QUANT_ARGS), gu, layout); \
  }
  FFN_EXT_GATED(FFN_EXT_QUANT_KERNELS)
#undef FFN_EXT_QUANT_KERNELS
  static Out quantize(T x, FFN_EXT_QUANT_DECL) {
    return Q::quantize(parse_recipe("ffn_ext.quantize", FFN_EXT_QUANT_ARGS), x);
  }
};

// Every quantizing op for one dispatch key, through QuantOps<Launcher>.
template <class Launcher>
void impl_quant_all(torch::stable::detail::StableLibrary& m) {
  using K = QuantKernels<Launcher>;
#define FFN_EXT_QUANT_IMPL(name, Gate, P) \
  m.impl(#name "_quant", TORCH_BOX(&K::name##_quant)); \
  m.impl(#name "_packed_quant", TORCH_BOX(&K::name##_packed_quant));
  FFN_EXT_GATED(FFN_EXT_QUANT_IMPL)
#undef FFN_EXT_QUANT_IMPL
  m.impl("quantize", TORCH_BOX(&K::quantize));
}

}  // namespace quant
}  // namespace ffn_ext
