// The op table (include/ffn_ext/ops_table.h, installed with the public header) with the element math it names
// (ffn_math.h), for the library's sources. Torch-free (ffn_math.h includes only torch/version.h): the CUDA kernel
// files include it (cuda/kernels_part.cuh).
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

// The table's lines in order, activations first, then the gated lines: line i's ops and kernels are in CUDA part
// i % kCudaParts (row_ops.h impl_all registers them, cuda/kernels_part.cuh emits their kernels).
enum TableLine {
#define FFN_EXT_LINE_ACT(name, ...) kLine_##name,
#define FFN_EXT_LINE_GATED(name, ...) kLine_##name,
  FFN_EXT_ACTIVATIONS(FFN_EXT_LINE_ACT) FFN_EXT_GATED(FFN_EXT_LINE_GATED) kTableLines
#undef FFN_EXT_LINE_ACT
#undef FFN_EXT_LINE_GATED
};
}  // namespace ffn_ext
