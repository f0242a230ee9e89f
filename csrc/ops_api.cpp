// The public C++ API (include/ffn_ext/ops.h): one function per forward op of the table (ops_table.h), each a typed
// dispatcher call. Out of line on purpose: a consumer that calls one links against this library for real.
#include "include/ffn_ext/ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include "ops_table.h"

namespace ffn_ext {
namespace {
template <class Sig>
c10::TypedOperatorHandle<Sig> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}
}  // namespace

using T = const at::Tensor&;
#define FFN_EXT_API_ACT(name, ...) \
  at::Tensor name(T x) { \
    static const auto op = typed_op<at::Tensor(T)>("ffn_ext::" #name); \
    return op.call(x); \
  }
#define FFN_EXT_API_GATED(name, Gate, P) \
  at::Tensor name(T gate, T up FFN_EXT_P_DECL_##P) { \
    static const auto op = typed_op<at::Tensor(T, T FFN_EXT_P_DECL_##P)>("ffn_ext::" #name); \
    return op.call(gate, up FFN_EXT_P_ARGS_##P); \
  } \
  at::Tensor name##_packed(T gate_up FFN_EXT_P_DECL_##P, c10::string_view layout) { \
    static const auto op = typed_op<at::Tensor(T FFN_EXT_P_DECL_##P, c10::string_view)>("ffn_ext::" #name "_packed"); \
    return op.call(gate_up FFN_EXT_P_ARGS_##P, layout); \
  }
FFN_EXT_ACTIVATIONS(FFN_EXT_API_ACT)
FFN_EXT_GATED(FFN_EXT_API_GATED)
#undef FFN_EXT_API_ACT
#undef FFN_EXT_API_GATED

}  // namespace ffn_ext
