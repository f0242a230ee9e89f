// The quantizing CUDA ops (TORCH_LIBRARY_IMPL(ffn_ext, CUDA)): ../quant_ops.h's QuantProblems, run by the kernels
// of quant_part<i>.cu through launch_quant.h on the current stream, under a guard for the output's device.
// Compiled by g++ (CUDA builds only): it needs torch, which the kernel files leave out (kernels_part.cuh says why).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../quant_ops.h"
#include "launch_quant.h"

namespace ffn_ext {
namespace quant {
namespace {

struct CudaQuant {
  using Guard = c10::cuda::CUDAGuard;
  template <typename T, class F, bool Pair>
  static void run(const QuantProblem& p, const F& f) {
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
    at::Tensor parts;  // freed at return: the caching allocator reuses it only after this stream's kernels
    if (p.scaling == QScaling::kTensor && !p.has_static) {
      parts = at::empty({tensor_blocks(p, sms)},
                        at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, c10::cuda::current_device()));
    }
    const cudaError_t err = launch_quant<T, F, Pair>(p, f, c10::cuda::getCurrentCUDAStream(), sms,
                                                     parts.defined() ? parts.data_ptr<float>() : nullptr);
    C10_CUDA_CHECK(err);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(ffn_ext, CUDA, m) { impl_quant_all<CudaQuant>(m); }

}  // namespace quant
}  // namespace ffn_ext
