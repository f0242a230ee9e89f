// CUDA kernels of every ffn_ext op (../ops_table.h): each is a functor of ffn_math.h, turned into a RowProblem
// by ../row_ops.h and run by launch_rows (rows_launcher.cuh).
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <string>

#include "../row_ops.h"
#include "rows_launcher.cuh"

namespace ffn_ext {
namespace cuda {

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

namespace {

// Ops<CudaLauncher>: the problems of ../row_ops.h run as CUDA kernels, under a guard for the output's device.
struct CudaLauncher {
  using Guard = c10::cuda::CUDAGuard;
  template <typename T, typename F>
  static void run(const F& f, const RowProblem<F::NI, F::NO>& p) {
    launch_rows<T>(f, p);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(ffn_ext, CUDA, m) { rows::impl_all<CudaLauncher>(m); }

}  // namespace cuda
}  // namespace ffn_ext
