// The one TORCH_LIBRARY(ffn_ext): every schema, and build information. Kernels: CUDA in cuda/ops.cpp (the kernels:
// cuda/kernels_part*.cu); the CPU and fake kernels and autograd are Python, registered from the table
// (ffn_ext/_kernels.py). Python API: ffn_ext/ops.py.
#include <torch/library.h>
#include <torch/version.h>

#include "ffn_ext.h"
#include "ops_table.h"

namespace ffn_ext {

std::vector<std::pair<std::string, std::string>> build_info() {
  std::vector<std::pair<std::string, std::string>> info;
  info.emplace_back("torch_version_built_against", TORCH_VERSION);
#ifdef FFN_EXT_WITH_CUDA
  info.emplace_back("cuda_kernels", "yes");
  info.emplace_back("cuda_version", cuda::compiled_cuda_version());
  info.emplace_back("cuda_archs", cuda::compiled_arch_list());
#else
  info.emplace_back("cuda_kernels", "no");
  info.emplace_back("cuda_version", "");
  info.emplace_back("cuda_archs", "");
#endif
  return info;
}

// Schemas, from the table (ops_table.h says what each computes). The unary and gated ops (forward and backward)
// are elementwise over same-shaped inputs: tagged pointwise, as ATen's gelu/silu/mul (torch.Tag.pointwise; tests/
// test_ops.py). The packed ops pair elements along the last dim, so they are not.
TORCH_LIBRARY(ffn_ext, m) {
  const std::vector<at::Tag> pointwise{at::Tag::pointwise};
#define FFN_EXT_DEF_ACT(name, ...) \
  m.def(#name "(Tensor x) -> Tensor", pointwise); \
  m.def(#name "_backward(Tensor grad, Tensor x) -> Tensor", pointwise); \
  m.def(#name "_backward_recompute(Tensor grad, Tensor x) -> (Tensor, Tensor)", pointwise);
#define FFN_EXT_DEF_GATED(name, Gate, P) \
  m.def(#name "(Tensor gate, Tensor up" FFN_EXT_P_KWONLY_##P ") -> Tensor", pointwise); \
  m.def(#name "_backward(Tensor grad, Tensor gate, Tensor up" FFN_EXT_P_KWONLY_##P ") -> (Tensor, Tensor)", \
        pointwise); \
  m.def(#name "_packed(Tensor gate_up, *" FFN_EXT_P_SCHEMA_##P ", str layout=\"concat\") -> Tensor"); \
  m.def(#name "_packed_backward(Tensor grad, Tensor gate_up, *" FFN_EXT_P_SCHEMA_##P \
        ", str layout=\"concat\") -> Tensor");
  FFN_EXT_ACTIVATIONS(FFN_EXT_DEF_ACT)
  FFN_EXT_GATED(FFN_EXT_DEF_GATED)
}

}  // namespace ffn_ext
