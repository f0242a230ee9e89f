// The seam between the quantizing CUDA ops and their kernels, torch-free, as launch_rows.h is for the row ops:
// ops.cpp (g++, torch) registers the ops (../quant_ops.h's QuantProblems), allocates the dynamic tensor
// scale's scratch and calls launch_quant; quant_part<i>.cu (nvcc, no torch) defines it (quant_kernels.cuh) and
// emits the instantiations of its part. nvcc never parses the torch headers (kernels_part.cuh has what they cost).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "../cache_kernel.h"
#include "../quant_kernel.h"

namespace ffn_ext {
namespace quant {

constexpr int kQuantParts = 4;  // quant_part0.cu ... quant_part3.cu (csrc/build.json)

// The tensor kernel's grid for p on `sms` multiprocessors: at most 8 blocks per SM, at least 1. A dynamic scale's
// amax launch stores one float per block, so the caller's `parts` scratch holds this many floats.
inline int64_t tensor_blocks(const QuantProblem& p, int sms) {
  const int64_t lanes = p.rows * tensor_lanes_per_row(p);
  return std::max<int64_t>(1, std::min<int64_t>((lanes + kThreads - 1) / kThreads, static_cast<int64_t>(sms) * 8));
}

// Runs the kernels of p.scaling for (T, F, Pair) on `stream`, shaped for `sms` multiprocessors: scaling "group"
// and "row" one launch; "tensor" one with a static scale, two with a dynamic one (amax into `parts`, which holds
// tensor_blocks(p, sms) floats of device memory the caller keeps alive until the launches ran, then quantize).
// Returns the first launch error (cudaGetLastError after each launch), which the caller checks.
template <typename T, class F, bool Pair>
cudaError_t launch_quant(const QuantProblem& p, const F& f, cudaStream_t stream, int sms, float* parts);

// The FP8 activation cache's kernels (../cache_kernel.h) for (T, Gate) on `stream`, one launch each; returns the
// launch error.
template <typename T, class Gate>
cudaError_t launch_cache(const CacheProblem& p, const Gate& gate, cudaStream_t stream, int sms);
template <typename T, class Gate>
cudaError_t launch_cached_backward(const CacheProblem& p, const Gate& gate, cudaStream_t stream, int sms);

// Takes the address of every launch_quant<T, F, Pair> of part Part, so that quant_part<Part>.cu, which explicitly
// instantiates it, emits them (and launch_cache / launch_cached_backward of its gated lines) (and their kernels) for ops.cpp. `keep` only has to be opaque to the compiler;
// nothing calls this.
template <int Part>
void quant_kernels_of_part(void (*keep)(const void*));

}  // namespace quant
}  // namespace ffn_ext
