// The FP8 activation cache's ops (cache_kernel.h says what they compute) as CacheProblems for a Launcher, as
// quant_ops.h is for the quantizing ops: cuda/ops.cpp instantiates CacheKernels with the CUDA launcher (the kernels
// in cuda/quant_kernels.cuh), the tests' host emulation (tests/csrc/emulate_quant.cpp) with its own. float64 has no
// kernel (refused here; the Python API computes it with the ATen formula, ffn_ext/_kernels.py CacheOp). A Launcher
// has `template <typename T, class Gate> static void cache(const CacheProblem&, const Gate&)` and `cached_backward`
// alike, and a `Guard` made from the device.
#pragma once

#include <torch/csrc/stable/library.h>

#include <cstdint>
#include <string>
#include <tuple>

#include "cache_kernel.h"
#include "ffn_ext.h"
#include "ops_table.h"
#include "quant.h"
#include "quant_ops.h"
#include "row_ops.h"

namespace ffn_ext {
namespace quant {

template <class Launcher>
struct CacheOps {
  using T_ = const Tensor&;
  using Out = std::tuple<Tensor, Tensor, Tensor>;

  template <class Fn>
  static void typed(ScalarType dtype, Fn&& fn) {
    switch (dtype) {
      case ScalarType::Float: return fn(float{});
      case ScalarType::Half: return fn(torch::headeronly::Half{});
      case ScalarType::BFloat16: return fn(torch::headeronly::BFloat16{});
      default: detail::fail("ffn_ext cache kernel: unsupported dtype");
    }
  }

  template <class Gate>
  static Out cache(const char* op, const typename Gate::Params& prm, T_ gate, T_ up, int64_t group) {
    check_params(op, prm);
    check_gated(op, gate, up);
    const ScalarType dtype = dtype_of(gate);
    QuantOps<Launcher>::require_fused(op, dtype);
    const int64_t m = check_cache_group(op, gate, group);
    auto sizes = vec(gate.sizes());
    Tensor h = empty_strided(gate, sizes, contiguous_strides(sizes), dtype);
    sizes.back() = 2 * m;
    Tensor q = empty_strided(gate, sizes, contiguous_strides(sizes), ScalarType::Float8_e4m3fn);
    sizes.back() = 2 * m / group;
    Tensor s = empty_strided(gate, sizes, contiguous_strides(sizes), ScalarType::Float);
    if (h.numel() == 0) return {h, q, s};
    typename Launcher::Guard guard(h.get_device_index());
    const auto g = rows::as_rows(gate), u = rows::as_rows(up);
    CacheProblem p = problem(h, q, s, m, group);
    p.gate = g.t.data_ptr(), p.up = u.t.data_ptr();
    p.gate_stride = g.stride, p.up_stride = u.stride;
    const size_t e = gate.element_size();
    p.lanes = static_cast<int>(group / (kLaneElems * kGroupChunks));
    p.vectorized = QuantOps<Launcher>::aligned(p.gate, g.stride, e) && QuantOps<Launcher>::aligned(p.up, u.stride, e);
    const Gate f(for_dtype(prm, dtype));
    typed(dtype, [&](auto t) { Launcher::template cache<decltype(t), Gate>(p, f); });
    return {h, q, s};
  }

  template <class Gate>
  static Out cached_backward(const char* op, const typename Gate::Params& prm, T_ grad, T_ q_in, T_ s_in) {
    check_params(op, prm);
    const int64_t group = check_cache(op, grad, q_in, s_in);
    const ScalarType dtype = dtype_of(grad);
    QuantOps<Launcher>::require_fused(op, dtype);
    const auto sizes = vec(grad.sizes());
    const auto st = contiguous_strides(sizes);
    Tensor dg = empty_strided(grad, sizes, st, dtype), du = empty_strided(grad, sizes, st, dtype);
    Tensor h = empty_strided(grad, sizes, st, dtype);
    if (h.numel() == 0) return {dg, du, h};
    typename Launcher::Guard guard(h.get_device_index());
    const Tensor q = aligned8(torch::stable::contiguous(q_in)), s = torch::stable::contiguous(s_in);
    const auto d = rows::as_rows(grad);
    CacheProblem p = problem(h, q, s, grad.size(-1), group);
    p.grad = d.t.data_ptr(), p.grad_stride = d.stride;
    p.dgate = dg.data_ptr(), p.dup = du.data_ptr();
    p.vectorized = QuantOps<Launcher>::aligned(p.grad, d.stride, grad.element_size());
    const Gate f(for_dtype(prm, dtype));
    typed(dtype, [&](auto t) { Launcher::template cached_backward<decltype(t), Gate>(p, f); });
    return {dg, du, h};
  }

  // q as the kernel reads it, 8 values per 8-byte load: a view that starts off an 8-byte boundary is copied first.
  static Tensor aligned8(const Tensor& q) {
    if (reinterpret_cast<uintptr_t>(q.data_ptr()) % 8 == 0) return q;
    const auto sizes = vec(q.sizes());
    Tensor c = empty_strided(q, sizes, contiguous_strides(sizes), ScalarType::Float8_e4m3fn);
    torch::stable::copy_(c, q);
    return c;
  }

  static CacheProblem problem(const Tensor& h, const Tensor& q, const Tensor& s, int64_t m, int64_t group) {
    CacheProblem p{};
    p.h = h.data_ptr();
    p.q = static_cast<uint8_t*>(q.data_ptr());
    p.scale = static_cast<float*>(s.data_ptr());
    p.cols = m;
    p.rows = m ? h.numel() / m : 0;
    p.group = static_cast<int>(group);
    return p;
  }
};

// The cache ops of one Launcher as free functions, stamped per table line (TORCH_BOX takes function pointers).
template <class Launcher>
struct CacheKernels {
  using C = CacheOps<Launcher>;
  using T = const Tensor&;
  using Out = std::tuple<Tensor, Tensor, Tensor>;
#define FFN_EXT_CACHE_KERNELS(name, Gate, P) \
  static Out name##_cache(T gate, T up, int64_t group_size FFN_EXT_P_DECL_##P) { \
    return C::template cache<math::Gate>("ffn_ext." #name "_cache", FFN_EXT_P_MAKE_##P, gate, up, group_size); \
  } \
  static Out name##_cached_backward(T grad, T q, T scale FFN_EXT_P_DECL_##P) { \
    return C::template cached_backward<math::Gate>("ffn_ext." #name "_cached_backward", FFN_EXT_P_MAKE_##P, grad, q, \
                                                   scale); \
  }
  FFN_EXT_GATED(FFN_EXT_CACHE_KERNELS)
#undef FFN_EXT_CACHE_KERNELS
};

template <class Launcher>
void impl_cache_all(torch::stable::detail::StableLibrary& m) {
  using K = CacheKernels<Launcher>;
#define FFN_EXT_CACHE_IMPL(name, Gate, P) \
  m.impl(#name "_cache", TORCH_BOX(&K::name##_cache)); \
  m.impl(#name "_cached_backward", TORCH_BOX(&K::name##_cached_backward));
  FFN_EXT_GATED(FFN_EXT_CACHE_IMPL)
#undef FFN_EXT_CACHE_IMPL
}

}  // namespace quant
}  // namespace ffn_ext
