// The CUDA ops (TORCH_LIBRARY_IMPL(ffn_ext, CUDA)), every one of them, in one g++ translation unit: the row ops
// (../row_ops.h's problems, run by the kernels of kernels_part<i>.cu through launch_rows.h) and the quantizing ops
// (../quant_ops.h's QuantProblems, run by the kernels of quant_part<i>.cu through launch_quant.h), on the current
// stream under a guard for the output's device. It needs torch, which the kernel files leave out
// (kernels_part.cuh says why). One file, not one per kernel part: on 2 cores a build is bound by total CPU time,
// and each of the files this replaces (ops_part0..3.cpp, quant_ops.cpp) spent most of its time parsing the same
// torch headers (figures: docs/building.md#build-time); the kernels' instantiations are the same.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../quant_ops.h"
#include "../row_ops.h"
#include "launch_quant.h"
#include "launch_rows.h"

namespace ffn_ext {
namespace cuda {
namespace {

// Ops<CudaLauncher>: the problems of ../row_ops.h run as CUDA kernels on the current stream, under a guard for
// the output's device.
struct CudaLauncher {
  using Guard = c10::cuda::CUDAGuard;
  template <typename T, typename F>
  static void run(const F& f, const rows::RowProblem<F::NI, F::NO>& p) {
    if (p.rows == 0 || p.cols == 0) return;
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
    C10_CUDA_CHECK(launch_rows<T>(f, p, c10::cuda::getCurrentCUDAStream(), sms));
  }
};

// QuantOps<CudaQuant>: the quantizing problems of ../quant_ops.h.
struct CudaQuant {
  using Guard = c10::cuda::CUDAGuard;
  template <typename T, class F, bool Pair>
  static void run(const quant::QuantProblem& p, const F& f) {
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
    at::Tensor parts;  // freed at return: the caching allocator reuses it only after this stream's kernels
    if (p.scaling == quant::QScaling::kTensor && !p.has_static) {
      parts = at::empty({quant::tensor_blocks(p, sms)},
                        at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, c10::cuda::current_device()));
    }
    const cudaError_t err = quant::launch_quant<T, F, Pair>(p, f, c10::cuda::getCurrentCUDAStream(), sms,
                                                            parts.defined() ? parts.data_ptr<float>() : nullptr);
    C10_CUDA_CHECK(err);
  }
};

}  // namespace

// Every line of the table (impl_all's Parts = 1): the kernels of line i are in kernels_part<i % kCudaParts>.cu.
TORCH_LIBRARY_IMPL(ffn_ext, CUDA, m) {
  rows::impl_all<CudaLauncher>(m);
  quant::impl_quant_all<CudaQuant>(m);
}

}  // namespace cuda
}  // namespace ffn_ext
