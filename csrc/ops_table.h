// The op table (include/ffn_ext/ops_table.h, installed with the public header) with the element math it names
// (ffn_math.h), for the library's sources.
#pragma once

#include "ffn_math.h"
#include "include/ffn_ext/ops_table.h"

namespace ffn_ext {
// The name of an activation's unary op, by its functor: ActName<math::Silu>::value == "silu".
template <class Act> struct ActName;
#define FFN_EXT_ACT_NAME(name, Act, ...) \
  template <> struct ActName<math::Act> { \
    static constexpr const char* value = #name; \
  };
FFN_EXT_ACTIVATIONS(FFN_EXT_ACT_NAME)
#undef FFN_EXT_ACT_NAME
}  // namespace ffn_ext
