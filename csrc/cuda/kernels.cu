// What the CUDA build reports about itself (build_info): the CUDA runtime version and the architectures. The
// kernels of every ffn_ext op are in kernels_part<i>.cu (kernels_part.cuh: the table's lines split across them),
// the quantizing ops' in quant_part<i>.cu (quant_kernels.cuh). Torch-free as they are: it declares its two
// functions itself (../ffn_ext.h declares them for their callers) instead of including ../ffn_ext.h, whose
// ATen/core/Tensor.h nvcc would parse again per arch.
#include <cuda_runtime_api.h>

#include <string>

namespace ffn_ext {
namespace cuda {

std::string compiled_cuda_version();  // as declared in ../ffn_ext.h
std::string compiled_arch_list();

std::string compiled_cuda_version() {
  return std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
}

#define FFN_EXT_STR2(...) #__VA_ARGS__
#define FFN_EXT_STR(...) FFN_EXT_STR2(__VA_ARGS__)
std::string compiled_arch_list() {
#ifdef __CUDA_ARCH_LIST__
  return FFN_EXT_STR(__CUDA_ARCH_LIST__);
#else
  return "unknown";
#endif
}

}  // namespace cuda
}  // namespace ffn_ext
