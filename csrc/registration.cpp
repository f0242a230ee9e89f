// The one STABLE_TORCH_LIBRARY(ffn_ext): every schema, from the table (ops_table.h says what each computes), the
// quantizing ops' included, and the pointwise tags. Linked into ffn_ext._C, which holds no kernels: CUDA kernels
// are libffn_ext_cuda.so's (cuda/ops.cpp); fake, autograd, vmap and CPU are Python, from the table
// (ffn_ext/_kernels.py).
#include <torch/csrc/stable/library.h>

#include <dlfcn.h>

#include "ffn_ext.h"
#include "ops_table.h"
#include "quant.h"

namespace ffn_ext {

// ---- pointwise tags ----
// The unary and gated ops (forward and backward) are elementwise over same-shaped inputs: tagged pointwise, as
// ATen's gelu/silu/mul. StableLibrary::def(schema, tags) and its shim torch_library_def_with_tags are 2.12+, so at
// the 2.10 target they are looked up at run time (never linked: the library still loads on 2.10/2.11, untagged
// there) and called on a fragment handle of our own, held for the process's life (a tag cannot be added after
// the definition). Docs: docs/internals/stable-abi.md §1.2.
namespace {
bool g_tagged = false;
using DefWithTags = AOTITorchError (*)(TorchLibraryHandle, const char*, const int32_t*, int32_t);
using TagFn = int32_t (*)();

TorchLibraryHandle pointwise_fragment() {
  static TorchLibraryHandle h = [] {
    TorchLibraryHandle lib = nullptr;
    FFN_EXT_SHIM(aoti_torch_library_init_fragment("ffn_ext", __FILE__, __LINE__, &lib));
    return lib;  // never deleted: deleting it would deregister its schemas
  }();
  return h;
}

void def_pointwise(const char* schema) {
  static const auto def_tags = reinterpret_cast<DefWithTags>(dlsym(RTLD_DEFAULT, "torch_library_def_with_tags"));
  static const auto tag_pw = reinterpret_cast<TagFn>(dlsym(RTLD_DEFAULT, "torch_tag_pointwise"));
  if (def_tags != nullptr && tag_pw != nullptr) {
    const int32_t tags[1] = {tag_pw()};
    FFN_EXT_SHIM(def_tags(pointwise_fragment(), schema, tags, 1));
    g_tagged = true;
  } else {
    FFN_EXT_SHIM(aoti_torch_library_def(pointwise_fragment(), schema));
  }
}
}  // namespace

bool pointwise_tagged() { return g_tagged; }

}  // namespace ffn_ext

// The packed ops pair elements along the last dim, so they are not pointwise; nor are the quantizing ops.
STABLE_TORCH_LIBRARY(ffn_ext, m) {
  using ffn_ext::def_pointwise;
#define FFN_EXT_DEF_ACT(name, ...) \
  def_pointwise(#name "(Tensor x) -> Tensor"); \
  def_pointwise(#name "_backward(Tensor grad, Tensor x) -> Tensor"); \
  def_pointwise(#name "_backward_recompute(Tensor grad, Tensor x) -> (Tensor, Tensor)");
#define FFN_EXT_DEF_GATED(name, Gate, P) \
  def_pointwise(#name "(Tensor gate, Tensor up" FFN_EXT_P_KWONLY_##P ") -> Tensor"); \
  def_pointwise(#name "_backward(Tensor grad, Tensor gate, Tensor up" FFN_EXT_P_KWONLY_##P ") -> (Tensor, Tensor)"); \
  m.def(#name "_packed(Tensor gate_up, *" FFN_EXT_P_SCHEMA_##P ", str layout=\"concat\") -> Tensor"); \
  m.def(#name "_packed_backward(Tensor grad, Tensor gate_up, *" FFN_EXT_P_SCHEMA_##P \
        ", str layout=\"concat\") -> Tensor");
#define FFN_EXT_DEF_QUANT(name, Gate, P) \
  m.def(#name "_quant(Tensor gate, Tensor up, *, " FFN_EXT_QUANT_SCHEMA FFN_EXT_P_SCHEMA_##P ") -> (Tensor, Tensor)"); \
  m.def(#name "_packed_quant(Tensor gate_up, *, " FFN_EXT_QUANT_SCHEMA FFN_EXT_P_SCHEMA_##P \
        ", str layout=\"concat\") -> (Tensor, Tensor)");
  FFN_EXT_ACTIVATIONS(FFN_EXT_DEF_ACT)
  FFN_EXT_GATED(FFN_EXT_DEF_GATED)
  FFN_EXT_GATED(FFN_EXT_DEF_QUANT)  // [..., M] x2 -> q [..., M], scale; [..., 2M] -> q [..., M], scale
  m.def("quantize(Tensor x, *, " FFN_EXT_QUANT_SCHEMA ") -> (Tensor, Tensor)");  // [..., K] -> q [..., K], scale
#undef FFN_EXT_DEF_ACT
#undef FFN_EXT_DEF_GATED
#undef FFN_EXT_DEF_QUANT
}
