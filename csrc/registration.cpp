// The one STABLE_TORCH_LIBRARY(ffn_ext): every schema, from the table (table.py writes them into ops_table.h), the
// quantizing ops' included, and the pointwise tags. Linked into ffn_ext._C, which holds no kernels: CUDA kernels
// are libffn_ext_cuda.so's (cuda/ops.cpp); fake, autograd, vmap and CPU are Python, from the table
// (ffn_ext/_kernels.py).
#include <torch/csrc/stable/library.h>

#include <dlfcn.h>

#include "ffn_ext.h"
#include "ops_table.h"

namespace ffn_ext {

// ---- pointwise tags ----
// The unary and gated ops (forward and backward) are elementwise over same-shaped inputs: tagged pointwise, as
// ATen's gelu/silu/mul. StableLibrary::def(schema, tags) and its shim torch_library_def_with_tags are 2.12+, so at
// the 2.10 target they are looked up at run time (never linked: the library still loads on 2.10/2.11, untagged
// there) and called on a fragment handle of our own, held for the process's life (a tag cannot be added after
// the definition). Docs: docs/internals/stable-abi.md.
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

// Every schema, from the table (ffn_ext/table.py SCHEMAS, generated into ops_table.h): the pointwise ones tagged.
STABLE_TORCH_LIBRARY(ffn_ext, m) {
#define FFN_EXT_DEF(schema, pointwise) \
  if (pointwise) \
    ffn_ext::def_pointwise(schema); \
  else \
    m.def(schema);
  FFN_EXT_SCHEMAS(FFN_EXT_DEF)
#undef FFN_EXT_DEF
}
