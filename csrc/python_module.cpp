// The pybind11 module ffn_ext._C (built per Python version). Importing it loads registration.cpp, which registers
// the torch.ops.ffn_ext schemas. It holds no kernels, so it loads under any torch >= 2.10, CUDA or not; the CUDA
// kernels are lib/libffn_ext_cuda.so, loaded on demand (ffn_ext/_loader.py). The fast entry points of the old
// module are gone: their torch API (THPVariable, torch_function mode, dispatch-key TLS) has no stable form
// (docs/internals/stable-abi.md).
#include <pybind11/pybind11.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/headeronly/version.h>

namespace ffn_ext {
bool pointwise_tagged();  // registration.cpp
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ffn_ext native module: importing it registers the torch.ops.ffn_ext schemas (stable ABI, torch >= 2.10)";
  m.def(
      "build_info",
      [] {
        pybind11::dict d;
        d["torch_version_built_against"] = TORCH_VERSION;  // the headers' torch; the binary serves >= the target
        d["torch_target_version"] = "2.10";
        const uint64_t v = aoti_torch_abi_version();  // the running torch's version: major << 56 | minor << 48 | ...
        d["torch_version_running"] =
            std::to_string(v >> 56) + "." + std::to_string((v >> 48) & 0xFF) + "." + std::to_string((v >> 40) & 0xFF);
        d["pointwise_tags"] = ffn_ext::pointwise_tagged() ? "yes" : "no";
        d["cuda_kernels"] = "no";  // _C's own; the loader reports lib/libffn_ext_cuda.so's
        d["cuda_version"] = "";
        d["cuda_archs"] = "";
        return d;
      },
      "What this build contains: the torch it was compiled with and for (target), the running torch's ABI "
      "version, whether the pointwise tags were applied.");
}
