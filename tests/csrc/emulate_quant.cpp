// ffn_ext_testing's _emulate_quant: the quantizing ops' CUDA kernels as libffn_ext_cuda.so registers them
// (quant_ops.h's QuantKernels: the recipe's checks, the outputs and the QuantProblem of csrc/cuda/ops.cpp's glue)
// with a host launcher: quant_kernel.h's per-lane and per-thread code run block by block on the CPU. A translation
// unit on torch's stable API at the library's target version (module.cpp says why), with the library code the glue
// calls: csrc/shapes.cpp (the ops' checks and output allocation) and csrc/quant_recipe.cpp (the recipe), compiled
// here as cuda/ops.cpp compiles them, rather than taken from ffn_ext's libraries, whose symbols are not an interface.
#include "stable_target.h"  // first: the target version, before any torch header

#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "cache_ops.h"
#include "quant_ops.h"
#include "quant_recipe.cpp"
#include "shapes.cpp"
#include "testing.h"

namespace ffn_ext {
namespace testing {
namespace {
struct HostQuant {
  struct Guard {  // cuda/ops.cpp's Guard takes the output's device index; the host has one device
    explicit Guard(int32_t) {}
  };
  // The outputs poisoned first (q bytes 0xA5, scales 12345.0f or e8m0 0x5A: values the formula never gives for
  // these tests' data), so that an element or scale the emulated kernels never write fails the comparison.
  template <typename T, class F, bool Pair>
  static void run(const quant::QuantProblem& p, const F& f) {
    std::memset(p.q, 0xA5, static_cast<size_t>(p.rows * p.cols));
    const int64_t per_row =
        p.scaling == quant::QScaling::kGroup ? p.cols / (quant::kLaneElems * quant::kGroupChunks * p.lanes) : 1;
    const int64_t rows = p.scaling == quant::QScaling::kTensor ? 1 : p.rows;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < per_row; ++g) {
        const int64_t at = r * p.scale_row + g * p.scale_col;
        if (p.e8m0) {
          static_cast<uint8_t*>(p.scale)[at] = 0x5A;
        } else {
          static_cast<float*>(p.scale)[at] = 12345.0f;
        }
      }
    }
    quant::emulate<T, F, Pair>(p, f);
  }
};
using K = quant::QuantKernels<HostQuant>;

// The cache ops' launches on the host, with small grids (at most 3 blocks) so that the grid-stride loops run more
// than once. Outputs poisoned first (h, dgate, dup NaN; q 0xA5; scales 12345.0f): what a kernel never writes fails
// the comparison.
struct HostCache {
  using Guard = HostQuant::Guard;
  template <typename T>
  static void poison(void* out, int64_t n) {
    if (out == nullptr) return;
    T* o = static_cast<T*>(out);
    for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(std::numeric_limits<float>::quiet_NaN());
  }
  template <typename T, class Gate>
  static void cache(const quant::CacheProblem& p, const Gate& gate) {
    poison<T>(p.h, p.rows * p.cols);
    std::memset(p.q, 0xA5, static_cast<size_t>(p.rows * 2 * p.cols));
    for (int64_t i = 0; i < p.rows * 2 * p.cols / p.group; ++i) p.scale[i] = 12345.0f;
    quant::emulate_cache<T>(p, gate, quant::emulated_grid(p.rows * quant::cache_lanes_per_row(p)));
  }
  template <typename T, class Gate>
  static void cached_backward(const quant::CacheProblem& p, const Gate& gate) {
    // the device's 8-byte loads of q fault off an 8-byte boundary, where the host's memcpy would not
    if (reinterpret_cast<uintptr_t>(p.q) % 8 != 0) throw std::runtime_error("_cached_backward: q misaligned");
    for (void* o : {p.h, p.dgate, p.dup}) poison<T>(o, p.rows * p.cols);
    quant::emulate_cached_backward<T>(p, gate, quant::emulated_grid(p.rows * quant::cached_lanes_per_row(p)));
  }
};
using KC = quant::CacheKernels<HostCache>;
}  // namespace

Handles emulate_cache(const std::string& op, const Handles& in, const Doubles& prm, int64_t group_size) {
  const std::vector<Tensor> a(in.begin(), in.end());
  std::tuple<Tensor, Tensor, Tensor> out;
  bool found = false;
#define FFN_EXT_EMU_CACHE(name, Gate, P) \
  if (op == #name "_cache" || op == #name "_cached_backward") { \
    found = true; \
    params_from<math::Gate::Params>(op, prm); \
    [[maybe_unused]] const double limit = prm.size() > 0 ? prm[0] : 0.0, alpha = prm.size() > 1 ? prm[1] : 0.0, \
                                  up_offset = prm.size() > 2 ? prm[2] : 0.0; \
    const size_t n = op == #name "_cache" ? 2 : 3; \
    if (a.size() != n) usage_error("_emulate_cache: ", op, " takes ", std::to_string(n), " inputs"); \
    out = n == 2 ? KC::name##_cache(a[0], a[1], group_size FFN_EXT_P_ARGS_##P) \
                 : KC::name##_cached_backward(a[0], a[1], a[2] FFN_EXT_P_ARGS_##P); \
  }
  FFN_EXT_GATED(FFN_EXT_EMU_CACHE)
#undef FFN_EXT_EMU_CACHE
  if (!found) usage_error("_emulate_cache: unknown op '", op, "'");
  Handles h(3, nullptr);
  FFN_EXT_SHIM(aoti_torch_new_tensor_handle(std::get<0>(out).get(), &h[0]));
  FFN_EXT_SHIM(aoti_torch_new_tensor_handle(std::get<1>(out).get(), &h[1]));
  FFN_EXT_SHIM(aoti_torch_new_tensor_handle(std::get<2>(out).get(), &h[2]));
  return h;
}

Handles emulate_quant(const std::string& op, const Handles& in, const Doubles& prm, const std::string& layout,
                      int32_t dtype, const std::string& scaling, int64_t group_size, bool pow2_scales,
                      int32_t scale_dtype, const std::string& scale_layout, std::optional<double> static_scale) {
  const std::vector<Tensor> a(in.begin(), in.end());  // owned from here on
  auto inputs = [&](size_t n) {
    if (a.size() != n) usage_error("_emulate_quant: ", op, " takes ", std::to_string(n), " input", n > 1 ? "s" : "");
  };
  std::tuple<Tensor, Tensor> out;
  if (op == "quantize") {
    inputs(1);
    if (!prm.empty()) usage_error("_emulate_quant: quantize takes no params");
    out = K::quantize(a[0], FFN_EXT_QUANT_ARGS);
  }
// The gated op's schema parameters as the table's ARGS macro names them (limit, alpha, up_offset).
#define FFN_EXT_EMU_QUANT(name, Gate, P) \
  else if (op == #name "_quant" || op == #name "_packed_quant") { \
    params_from<math::Gate::Params>(op, prm); \
    [[maybe_unused]] const double limit = prm.size() > 0 ? prm[0] : 0.0, alpha = prm.size() > 1 ? prm[1] : 0.0, \
                                  up_offset = prm.size() > 2 ? prm[2] : 0.0; \
    if (op == #name "_quant") { \
      inputs(2); \
      out = K::name##_quant(a[0], a[1], FFN_EXT_QUANT_ARGS FFN_EXT_P_ARGS_##P); \
    } else { \
      inputs(1); \
      out = K::name##_packed_quant(a[0], FFN_EXT_QUANT_ARGS FFN_EXT_P_ARGS_##P, layout); \
    } \
  }
  FFN_EXT_GATED(FFN_EXT_EMU_QUANT)
#undef FFN_EXT_EMU_QUANT
  else usage_error("_emulate_quant: unknown op '", op, "'");
  Handles h(2, nullptr);
  FFN_EXT_SHIM(aoti_torch_new_tensor_handle(std::get<0>(out).get(), &h[0]));
  FFN_EXT_SHIM(aoti_torch_new_tensor_handle(std::get<1>(out).get(), &h[1]));
  return h;
}
}  // namespace testing
}  // namespace ffn_ext
