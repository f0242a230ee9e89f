// CUDA kernels of the ffn_ext ops (../ops_table.h), one part of them: each is a functor of ffn_math.h, turned into a
// RowProblem by ../row_ops.h and run by launch_rows (rows_launcher.cuh). The table's lines are dealt round-robin
// to kernels_part0.cu ... kernels_part<kCudaParts - 1>.cu (row_ops.h impl_all: a line and all its ops, packed ones
// included, in one part, so no kernel is instantiated twice), which ninja compiles in parallel: one translation
// unit of all the kernels was the build's critical path (csrc/build.json lists the parts).
#pragma once

#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../row_ops.h"
#include "rows_launcher.cuh"

namespace ffn_ext {
namespace cuda {

constexpr int kCudaParts = 4;  // kernels_part0.cu ... kernels_part3.cu (csrc/build.json)

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

TORCH_LIBRARY_IMPL(ffn_ext, CUDA, m) { rows::impl_all<CudaLauncher, kCudaParts, FFN_EXT_CUDA_PART>(m); }

}  // namespace cuda
}  // namespace ffn_ext
