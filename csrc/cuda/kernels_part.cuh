// CUDA kernels of the ffn_ext ops (../ops_table.h), one part of them: each is a functor of ffn_math.h run by
// launch_rows (rows_launcher.cuh); ops.cpp turns the op's tensors into a RowProblem
// (../row_ops.h) and calls it. The table's lines are dealt round-robin to the parts (line % kCudaParts: a line
// and all its ops, packed ones included, in one part, so no kernel is instantiated twice), which ninja compiles
// in parallel: one translation unit of all the kernels was the build's critical path (csrc/build.json lists them).
//
// Torch-free: only rows.h (ATen/OpMathType.h and c10/util/Exception.h), ffn_math.h, ops_table.h and the CUDA
// runtime. With torch's headers, most of a part's nvcc time went to parsing them, and cicc parses them again per
// arch (nvcc --time figures: docs/building.md#build-time).
// The registration, which needs torch, is ops.cpp (g++).
#pragma once

#include <cuda_runtime.h>

#include "../ffn_math.h"
#include "../ops_table.h"
#include "../rows.h"
#include "launch_rows.h"
#include "rows_launcher.cuh"

namespace ffn_ext {
namespace cuda {

template <typename F>
void keep_all_types(void (*keep)(const void*)) {  // AT_DISPATCH_FLOATING_TYPES_AND2(Half, BFloat16) in row_ops.h
  keep(reinterpret_cast<const void*>(&launch_rows<double, F>));
  keep(reinterpret_cast<const void*>(&launch_rows<float, F>));
  keep(reinterpret_cast<const void*>(&launch_rows<c10::Half, F>));
  keep(reinterpret_cast<const void*>(&launch_rows<c10::BFloat16, F>));
}

// The functors row_ops.h's Ops runs for a table line: an activation's unary, unary_backward and
// unary_backward_recompute; a gate's gated, gated_backward (both also the concat packed ops') and
// gated_backward_recompute, and the interleaved packed ops'. This list follows Ops: a functor missing here is an
// undefined symbol when `import ffn_ext` loads _C.
template <int Part>
void kernels_of_part(void (*keep)(const void*)) {
#define FFN_EXT_KEEP_ACT(name, Act, ...) \
  if constexpr (kLine_##name % kCudaParts == Part) { \
    keep_all_types<math::UnaryFwd<math::Act>>(keep); \
    keep_all_types<math::UnaryBwd<math::Act>>(keep); \
    keep_all_types<math::UnaryBwdRecompute<math::Act>>(keep); \
  }
#define FFN_EXT_KEEP_GATED(name, Gate, P) \
  if constexpr (kLine_##name % kCudaParts == Part) { \
    keep_all_types<math::GatedFwd<math::Gate>>(keep); \
    keep_all_types<math::GatedBwd<math::Gate>>(keep); \
    keep_all_types<math::GatedBwdRecompute<math::Gate>>(keep); \
    keep_all_types<math::Interleaved<math::GatedFwd<math::Gate>, 0, -1>>(keep); \
    keep_all_types<math::Interleaved<math::GatedBwd<math::Gate>, 1, 0>>(keep); \
  }
  FFN_EXT_ACTIVATIONS(FFN_EXT_KEEP_ACT)
  FFN_EXT_GATED(FFN_EXT_KEEP_GATED)
#undef FFN_EXT_KEEP_ACT
#undef FFN_EXT_KEEP_GATED
}

template void kernels_of_part<FFN_EXT_CUDA_PART>(void (*)(const void*));

}  // namespace cuda
}  // namespace ffn_ext
