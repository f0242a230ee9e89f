// CUDA kernels of the quantizing ops (../quant.h): quant_kernel.h's per-lane code as one kernel per (op, input
// dtype, pair layout), the recipe a runtime argument; one launch per call. Calls the kernel does not cover run the
// composite (../quant_ops.h says which). Kernels: 3 dtypes x (identity + 4 gated ops x 2 layouts: two operands, or
// one interleaved pair) = 27 with today's table.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>

#include "../quant_ops.h"

namespace ffn_ext {
namespace quant {
namespace {

constexpr int kThreads = 256;

// Grid-stride over lanes; the loop bound is the same for every thread of a warp (it steps by whole blocks), so the
// shuffles always have the full warp. A group never straddles a warp: its L lanes are consecutive and L divides 32.
template <typename T, class F, bool Pair>
__global__ void __launch_bounds__(kThreads) quant_kernel(QuantProblem p, F f) {
  const int64_t chunks = p.cols / kLaneElems;
  const int64_t total = p.rows * chunks;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads; base < total; base += step) {
    const int64_t i = base + threadIdx.x;
    const bool ok = i < total;
    const int64_t row = ok ? i / chunks : 0, col = ok ? (i - row * chunks) * kLaneElems : 0;
    float h[kLaneElems];
    float m = ok ? lane_h<T, F, Pair>(p, f, row, col, h) : 0.0f;
    for (int w = 1; w < p.lanes; w <<= 1) m = amax_step(m, __shfl_xor_sync(0xffffffffu, m, w));
    if (ok) lane_store(p, row, col, h, m, (threadIdx.x & (p.lanes - 1)) == 0);
  }
}

struct CudaQuant {
  using Guard = c10::cuda::CUDAGuard;
  template <typename T, class F, bool Pair>
  static void run(const QuantProblem& p, const F& f) {
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
    const int64_t lanes = p.rows * (p.cols / kLaneElems);
    const int64_t blocks = std::min<int64_t>((lanes + kThreads - 1) / kThreads, static_cast<int64_t>(sms) * 8);
    quant_kernel<T, F, Pair><<<static_cast<unsigned>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(p, f);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(ffn_ext, CUDA, m) { impl_quant_all<CudaQuant>(m); }

}  // namespace quant
}  // namespace ffn_ext
