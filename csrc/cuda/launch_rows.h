// The seam between the CUDA ops and their kernels, torch-free: ops.cpp (g++, torch) registers the ops and
// calls launch_rows; kernels_part<i>.cu (nvcc, no torch) defines it (rows_launcher.cuh) and emits the
// instantiations its part needs (kernels_part.cuh). Each part is two translation units so that nvcc never parses
// the torch headers: they were most of a part's compile time (kernels_part.cuh has the numbers).
#pragma once

#include <cuda_runtime_api.h>

#include "../rows.h"

namespace ffn_ext {
namespace cuda {

constexpr int kCudaParts = 4;  // kernels_part0.cu ... kernels_part3.cu (csrc/build.json); all registered by ops.cpp

// Runs f over p as rows_kernel<T, F, 16 / sizeof(T)> on `stream`, shaped for `sms` multiprocessors
// (rows::launch_shape); returns the launch's error (cudaGetLastError), which the caller checks. Nothing to do for
// an empty problem.
template <typename T, typename F>
cudaError_t launch_rows(const F& f, const rows::RowProblem<F::NI, F::NO>& p, cudaStream_t stream, int sms);

// Takes the address of every launch_rows<T, F> of the table lines of part Part (line % kCudaParts == Part), so that
// kernels_part<Part>.cu, which explicitly instantiates it, emits them (and their kernels) for ops.cpp.
// `keep` only has to be opaque to the compiler; nothing calls this.
template <int Part>
void kernels_of_part(void (*keep)(const void*));

}  // namespace cuda
}  // namespace ffn_ext
