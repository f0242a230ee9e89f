// ffn_ext's public C++ API, header-only on torch's stable ABI (torch::stable::Tensor, TORCH_TARGET_VERSION 2.10):
// typed functions that call the torch.ops.ffn_ext.* ops through the dispatcher (torch_call_dispatcher), so a call
// reaches whatever kernel is registered for the tensors' device and every dispatch key in front of it.
//
//   find_package(ffn_ext REQUIRED)                 # README "CMake"; needs torch >= 2.10 (its headers and libtorch_cpu)
//   target_link_libraries(app PRIVATE ffn_ext::ops)
//
//   #include <ffn_ext/ops.h>
//   torch::stable::Tensor h = ffn_ext::swiglu(gate, up);   // silu(gate) * up
//
// What registers what (docs/internals/stable-abi.md):
//   - libffn_ext_ops.so (the ffn_ext::ops target) registers the schemas, and the CUDA kernels when it was built
//     with FFN_EXT_WITH_CUDA=ON. This header references it (ffn_ext_ops_library below), so the library stays in
//     the link and registers at load also under the linker's --as-needed.
//   - The CPU kernels, the fake (meta) kernels and autograd are Python: they exist once `import ffn_ext` has run
//     in the process (embedded Python, or a C++ extension used from Python). A C++-only process has the schemas,
//     the CUDA kernels and the explicit backward ops below; a CPU tensor there fails with the dispatcher's
//     "Could not run 'ffn_ext::...' with arguments from the 'CPU' backend".
//
// One function per op of the table (<ffn_ext/ops_table.h>, installed next to this header; what each op computes is
// there). For each activation `name` (gelu, gelu_tanh, silu, relu, relu2, quick_gelu, ...):
//   Tensor name(const Tensor& x);
//   Tensor name_backward(const Tensor& grad, const Tensor& x);                     grad * act'(x)
// and for each gated op `name` (swiglu, geglu, geglu_tanh, reglu, ..., swiglu_clamped with its parameters):
//   Tensor name(const Tensor& gate, const Tensor& up[, params]);
//   std::pair<Tensor, Tensor> name_backward(const Tensor& grad, const Tensor& gate, const Tensor& up[, params]);
//   Tensor name_packed(const Tensor& gate_up[, params], const std::string& layout = "concat");
//   Tensor name_packed_backward(const Tensor& grad, const Tensor& gate_up[, params], const std::string& layout = ...);
// e.g. swiglu_clamped(gate, up, double limit, double alpha = 1.0, double up_offset = 0.0). Tensor is
// torch::stable::Tensor. Shapes: unary ops [...] -> [...]; gated ops gate, up [..., M] -> [..., M]; packed ops
// [..., 2M] -> [..., M] with layout "concat" ([gate | up]) or "interleaved" ([g0, u0, g1, u1, ...], GPT-OSS).
//
// Errors: std::runtime_error. Its message carries the failed guard (e.g. "ffn_ext.swiglu: `up` must have the
// dtype, device and shape of `gate`") when the running torch is 2.13 or newer; on 2.10-2.12 the stable ABI passes
// no message across the C API (it names the failed call only). The CPU kernels are Python's: from C++ they raise
// the Python checks' messages.
//
// From at::Tensor code (built against one torch anyway): convert at the edge with torch's
// torch::aot_inductor::new_tensor_handle / tensor_handle_to_tensor_pointer
// (torch/csrc/inductor/aoti_torch/utils.h), e.g. torch::stable::Tensor(new_tensor_handle(at::Tensor(t))); such a
// target sets the CMake property FFN_EXT_NO_TARGET_VERSION ON (ATen's headers refuse TORCH_TARGET_VERSION) and links
// torch itself.
// Define FFN_EXT_NO_LIBRARY_ANCHOR to use this header without linking libffn_ext_ops (when something else, such as
// the Python package's ffn_ext._C, registers the schemas).
#pragma once

#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/macros.h>
#include <torch/csrc/stable/stableivalue_conversions.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/csrc/stable/version.h>

#include <array>
#include <cstddef>
#include <string>
#include <utility>

#include "ops_table.h"

#if TORCH_FEATURE_VERSION < TORCH_VERSION_2_10_0
#error \
    "<ffn_ext/ops.h> needs torch's stable ABI at 2.10 or newer: -DTORCH_TARGET_VERSION=0x020a000000000000 (ffn_ext::ops sets it)"
#endif

// Defined by libffn_ext_ops.so (csrc/ops_library.cpp): returns its API version (FFN_EXT_OPS_API_VERSION).
extern "C" __attribute__((visibility("default"))) int ffn_ext_ops_library();
#define FFN_EXT_OPS_API_VERSION 2  // 2: header-only, torch::stable::Tensor (1: at::Tensor, libffn_ext_ops)

namespace ffn_ext {
namespace detail {

#ifndef FFN_EXT_NO_LIBRARY_ANCHOR
// A reference from every program that includes this header, so that linking ffn_ext::ops keeps libffn_ext_ops.so
// (which registers the schemas at load) also under --as-needed.
[[maybe_unused]] __attribute__((used)) static int (*const library_anchor)() = &ffn_ext_ops_library;
#endif

constexpr std::size_t max_size(std::size_t a, std::size_t b) { return a < b ? b : a; }

// Calls the ffn_ext op `op` ("ffn_ext::swiglu", default overload) on args (tensors, doubles, strings), boxed; the
// first n_out entries of the returned stack are its outputs.
template <std::size_t n_out, class... Args>
inline std::array<StableIValue, max_size(n_out, sizeof...(Args))> call(const char* op, const Args&... args) {
  std::array<StableIValue, max_size(n_out, sizeof...(Args))> stack{torch::stable::detail::from(args)...};
  STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher(op, "", stack.data(), TORCH_ABI_VERSION));
  return stack;
}

template <class... Args>
inline torch::stable::Tensor call1(const char* op, const Args&... args) {
  return torch::stable::detail::to<torch::stable::Tensor>(call<1>(op, args...)[0]);
}

template <class... Args>
inline std::pair<torch::stable::Tensor, torch::stable::Tensor> call2(const char* op, const Args&... args) {
  auto stack = call<2>(op, args...);
  return {torch::stable::detail::to<torch::stable::Tensor>(stack[0]),
          torch::stable::detail::to<torch::stable::Tensor>(stack[1])};
}

}  // namespace detail

using Tensor = torch::stable::Tensor;

#define FFN_EXT_DECLARE_ACT(name, ...) \
  inline Tensor name(const Tensor& x) { return detail::call1("ffn_ext::" #name, x); } \
  inline Tensor name##_backward(const Tensor& grad, const Tensor& x) { \
    return detail::call1("ffn_ext::" #name "_backward", grad, x); \
  }
#define FFN_EXT_DECLARE_GATED(name, Gate, P) \
  inline Tensor name(const Tensor& gate, const Tensor& up FFN_EXT_P_DEFAULTS_##P) { \
    return detail::call1("ffn_ext::" #name, gate, up FFN_EXT_P_ARGS_##P); \
  } \
  inline std::pair<Tensor, Tensor> name##_backward(const Tensor& grad, const Tensor& gate, \
                                                   const Tensor& up FFN_EXT_P_DEFAULTS_##P) { \
    return detail::call2("ffn_ext::" #name "_backward", grad, gate, up FFN_EXT_P_ARGS_##P); \
  } \
  inline Tensor name##_packed(const Tensor& gate_up FFN_EXT_P_DEFAULTS_##P, const std::string& layout = "concat") { \
    return detail::call1("ffn_ext::" #name "_packed", gate_up FFN_EXT_P_ARGS_##P, layout); \
  } \
  inline Tensor name##_packed_backward(const Tensor& grad, const Tensor& gate_up FFN_EXT_P_DEFAULTS_##P, \
                                       const std::string& layout = "concat") { \
    return detail::call1("ffn_ext::" #name "_packed_backward", grad, gate_up FFN_EXT_P_ARGS_##P, layout); \
  }
FFN_EXT_ACTIVATIONS(FFN_EXT_DECLARE_ACT)
FFN_EXT_GATED(FFN_EXT_DECLARE_GATED)
#undef FFN_EXT_DECLARE_ACT
#undef FFN_EXT_DECLARE_GATED

}  // namespace ffn_ext
