// The CUDA ops of one part of the table (TORCH_LIBRARY_IMPL(ffn_ext, CUDA)): ../row_ops.h's problems, run by the
// kernels of kernels_part<FFN_EXT_CUDA_PART>.cu through launch_rows.h. Compiled by g++ (ops_part<i>.cpp, CUDA
// builds only): it needs torch, which the kernel files leave out (kernels_part.cuh says why).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../row_ops.h"
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

}  // namespace

TORCH_LIBRARY_IMPL(ffn_ext, CUDA, m) { rows::impl_all<CudaLauncher, kCudaParts, FFN_EXT_CUDA_PART>(m); }

}  // namespace cuda
}  // namespace ffn_ext
