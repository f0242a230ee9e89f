// The quantizing ops (quant.h): schemas from the table, and the Meta, CPU and Autograd kernels. The CPU kernels
// compute h with ffn_ext's own unfused op (through the dispatcher, so h is bit for bit what that op returns on the
// device) and quantize it with the ATen composite of ffn_ext/quant.py's formula (quant_recipe.cpp, with the
// recipe's checks and the outputs' allocation).
// The CUDA kernels are in cuda/quant_part*.cu (registered by cuda/ops.cpp). Kept in one file of its own, a TORCH_LIBRARY_FRAGMENT next to
// registration.cpp's TORCH_LIBRARY, so that the table's other users need no change for it.
#include "quant.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>

#include "ffn_ext.h"
#include "ops_table.h"

namespace ffn_ext {
namespace quant {
namespace {

using T = const at::Tensor&;
using Out = std::tuple<at::Tensor, at::Tensor>;

// Refuses inputs that require grad under grad mode (these ops are not differentiable), then runs the kernel
// below autograd: one boxed kernel for every quantizing op.
void no_grad_kernel(const c10::OperatorHandle& opr, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto& args = opr.schema().arguments();
  if (at::GradMode::is_enabled()) {
    for (size_t i = 0; i < args.size(); ++i) {
      const auto& v = (*stack)[stack->size() - args.size() + i];
      TORCH_CHECK(!(v.isTensor() && v.toTensor().defined() && v.toTensor().requires_grad()), "ffn_ext.",
                  opr.schema().name().substr(9), ": `", args[i].name(), "` requires grad; the quantizing ops are ",
                  "forward only (not differentiable): call them under torch.no_grad() or on detached tensors");
    }
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  opr.redispatchBoxed(ks & c10::after_ADInplaceOrView_keyset, stack);
}

// The unfused op's handle, looked up once: ffn_ext::<name> with the C++ signature Sig.
template <class Sig>
c10::TypedOperatorHandle<Sig> unfused(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

void impl_composite(torch::Library& m) {
#define FFN_EXT_QUANT_CPU(name, Gate, P) \
  m.impl(#name "_quant", [](T gate, T up, FFN_EXT_QUANT_DECL FFN_EXT_P_DECL_##P) -> Out { \
    const char* op = "ffn_ext." #name "_quant"; \
    const Recipe r = parse_recipe(op, FFN_EXT_QUANT_ARGS); \
    auto [q, s] = alloc_gated(op, FFN_EXT_P_MAKE_##P, r, gate, up); \
    static const auto h_op = unfused<at::Tensor(T, T FFN_EXT_P_DECL_##P)>("ffn_ext::" #name); \
    quantize_aten(h_op.call(gate, up FFN_EXT_P_ARGS_##P), r, q, s); \
    return {q, s}; \
  }); \
  m.impl(#name "_packed_quant", [](T gu, FFN_EXT_QUANT_DECL FFN_EXT_P_DECL_##P, c10::string_view layout) -> Out { \
    const char* op = "ffn_ext." #name "_packed_quant"; \
    const Recipe r = parse_recipe(op, FFN_EXT_QUANT_ARGS); \
    auto [q, s] = alloc_packed(op, FFN_EXT_P_MAKE_##P, r, gu, layout); \
    static const auto h_op = unfused<at::Tensor(T FFN_EXT_P_DECL_##P, c10::string_view)>("ffn_ext::" #name "_packed"); \
    quantize_aten(h_op.call(gu FFN_EXT_P_ARGS_##P, layout), r, q, s); \
    return {q, s}; \
  });
  FFN_EXT_GATED(FFN_EXT_QUANT_CPU)
#undef FFN_EXT_QUANT_CPU
  m.impl("quantize", [](T x, FFN_EXT_QUANT_DECL) -> Out {
    const Recipe r = parse_recipe("ffn_ext.quantize", FFN_EXT_QUANT_ARGS);
    auto [q, s] = alloc_x("ffn_ext.quantize", r, x);
    quantize_aten(x, r, q, s);
    return {q, s};
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ffn_ext, m) {
#define FFN_EXT_QUANT_DEF(name, Gate, P) \
  m.def(#name "_quant(Tensor gate, Tensor up, *, " FFN_EXT_QUANT_SCHEMA FFN_EXT_P_SCHEMA_##P ") -> (Tensor, Tensor)"); \
  m.def(#name "_packed_quant(Tensor gate_up, *, " FFN_EXT_QUANT_SCHEMA FFN_EXT_P_SCHEMA_##P \
        ", str layout=\"concat\") -> (Tensor, Tensor)");
  FFN_EXT_GATED(FFN_EXT_QUANT_DEF)  // [..., M] x2 -> q [..., M], scale; [..., 2M] -> q [..., M], scale
#undef FFN_EXT_QUANT_DEF
  m.def("quantize(Tensor x, *, " FFN_EXT_QUANT_SCHEMA ") -> (Tensor, Tensor)");  // [..., K] -> q [..., K], scale
}

TORCH_LIBRARY_IMPL(ffn_ext, Meta, m) {
#define FFN_EXT_QUANT_META(name, Gate, P) \
  m.impl(#name "_quant", [](T gate, T up, FFN_EXT_QUANT_DECL FFN_EXT_P_DECL_##P) -> Out { \
    const char* op = "ffn_ext." #name "_quant"; \
    auto [q, s] = alloc_gated(op, FFN_EXT_P_MAKE_##P, parse_recipe(op, FFN_EXT_QUANT_ARGS), gate, up); \
    return {q, s}; \
  }); \
  m.impl(#name "_packed_quant", [](T gu, FFN_EXT_QUANT_DECL FFN_EXT_P_DECL_##P, c10::string_view layout) -> Out { \
    const char* op = "ffn_ext." #name "_packed_quant"; \
    auto [q, s] = alloc_packed(op, FFN_EXT_P_MAKE_##P, parse_recipe(op, FFN_EXT_QUANT_ARGS), gu, layout); \
    return {q, s}; \
  });
  FFN_EXT_GATED(FFN_EXT_QUANT_META)
#undef FFN_EXT_QUANT_META
  m.impl("quantize", [](T x, FFN_EXT_QUANT_DECL) -> Out {
    auto [q, s] = alloc_x("ffn_ext.quantize", parse_recipe("ffn_ext.quantize", FFN_EXT_QUANT_ARGS), x);
    return {q, s};
  });
}

TORCH_LIBRARY_IMPL(ffn_ext, Autograd, m) {
#define FFN_EXT_QUANT_AUTOGRAD(name, Gate, P) \
  m.impl(#name "_quant", torch::CppFunction::makeFromBoxedFunction<&no_grad_kernel>()); \
  m.impl(#name "_packed_quant", torch::CppFunction::makeFromBoxedFunction<&no_grad_kernel>());
  FFN_EXT_GATED(FFN_EXT_QUANT_AUTOGRAD)
#undef FFN_EXT_QUANT_AUTOGRAD
  m.impl("quantize", torch::CppFunction::makeFromBoxedFunction<&no_grad_kernel>());
}

TORCH_LIBRARY_IMPL(ffn_ext, CPU, m) { impl_composite(m); }
#ifndef FFN_EXT_WITH_CUDA
// No CUDA kernels in this build: CUDA tensors take the composite (the unfused op warns once that the build has
// no CUDA kernels).
TORCH_LIBRARY_IMPL(ffn_ext, CUDA, m) { impl_composite(m); }
#endif

}  // namespace quant
}  // namespace ffn_ext
