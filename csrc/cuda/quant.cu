// CUDA kernels of the quantizing ops (../quant.h): quant_kernel.h's per-lane and per-thread code as three kernels
// per (op, input dtype, pair layout), the recipe (fp8 format, pow2, scale dtype and layout, static scale, the
// tensor kernel's phase) runtime data in QuantProblem: quant_kernel (scaling="group", one launch), quant_row_kernel
// (scaling="row", one launch) and quant_tensor_kernel (scaling="tensor": one launch with a static scale, two with a
// dynamic one: amax, then quantize). Kernels per arch: 3 kinds x 3 dtypes x (identity + 7 gated ops x 2 layouts:
// two operands, or one interleaved pair) = 135 with today's table (45 per kind; tests/test_sass.py counts them).
// The row and tensor kernels are kept apart (not one kernel with a runtime scaling) so that the row kernel's held
// h (kRowChunks x 8 floats per thread) does not set the tensor kernel's register count. float64 runs the
// composite (../quant_ops.h).
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

// The block's amax of every thread's m (all threads of the block call it; blockDim.x a multiple of 32): each
// warp's xor shuffle, lane 0 of each warp into shared memory, then every thread folds the warps' values in the same
// order (fold_warps), so every thread gets the same bits. The second barrier lets the next call reuse warp_max.
__device__ float block_amax(float m, float* warp_max) {
  for (int s = 16; s >= 1; s >>= 1) m = amax_step(m, __shfl_xor_sync(0xffffffffu, m, s));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  m = fold_warps(warp_max, static_cast<int>(blockDim.x / 32));
  __syncthreads();
  return m;
}

// scaling="row": a block per row at a time (row_threads(cols) threads); the row loop's bound is the same for the
// whole block, so block_amax's barriers are reached by every thread. Launch bounds (256, 1): with (256) alone
// ptxas kept the float32 Relu2 kernel at 64 registers and spilled 4 bytes around the division's slow-path call
// (sm_90, CUDA 13.0); with min 1 block per SM it takes 93 (72-92 for the bf16 ones) and spills nothing; h held in
// registers needs them either way (2 blocks of 256 per SM at 93).
template <typename T, class F, bool Pair>
__global__ void __launch_bounds__(kThreads, 1) quant_row_kernel(QuantProblem p, F f) {
  __shared__ float warp_max[kThreads / 32];
  const int tid = static_cast<int>(threadIdx.x), threads = static_cast<int>(blockDim.x);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    float h[kRowChunks][kLaneElems];
    const float amax = block_amax(row_sweep1<T, F, Pair>(p, f, row, tid, threads, h), warp_max);
    const float scale = math::quant_scale(amax, p.fp8_max, p.pow2);
    row_sweep2<T, F, Pair>(p, f, row, tid, threads, h, 1.0f / scale);
    if (tid == 0) store_scale(p, row * p.scale_row, scale);
  }
}

// scaling="tensor", kThreads threads, grid-stride over the rows x chunks lanes: phase kAmax stores the block's amax
// in p.parts[blockIdx.x]; phase kQuantize quantizes with the static scale or with the scale of the parts' amax
// (every block folds all the parts itself: the amax launch has finished, stream order).
template <typename T, class F, bool Pair>
__global__ void __launch_bounds__(kThreads) quant_tensor_kernel(QuantProblem p, F f) {
  __shared__ float warp_max[kThreads / 32];
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + tid;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  if (p.phase == QPhase::kAmax) {
    const float m = block_amax(tensor_amax<T, F, Pair>(p, f, i, step), warp_max);
    if (tid == 0) p.parts[blockIdx.x] = m;
    return;
  }
  const float amax = p.has_static ? 0.0f : block_amax(parts_amax(p, tid, kThreads), warp_max);
  const float scale = tensor_scale(p, amax);
  if (blockIdx.x == 0 && tid == 0) store_scale(p, 0, scale);
  tensor_quant<T, F, Pair>(p, f, i, step, 1.0f / scale);
}

struct CudaQuant {
  using Guard = c10::cuda::CUDAGuard;
  template <typename T, class F, bool Pair>
  static void run(const QuantProblem& p, const F& f) {
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
    const auto stream = c10::cuda::getCurrentCUDAStream();
    if (p.scaling == QScaling::kGroup) {
      const int64_t lanes = p.rows * (p.cols / kLaneElems);
      const int64_t blocks = std::min<int64_t>((lanes + kThreads - 1) / kThreads, static_cast<int64_t>(sms) * 8);
      quant_kernel<T, F, Pair><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, f);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else if (p.scaling == QScaling::kRow) {
      const int threads = row_threads(p.cols);
      const int64_t blocks = std::min<int64_t>(p.rows, static_cast<int64_t>(sms) * (2048 / threads));
      quant_row_kernel<T, F, Pair><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p, f);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      const int64_t lanes = p.rows * row_chunks(p);
      const int64_t blocks =
          std::max<int64_t>(1, std::min<int64_t>((lanes + kThreads - 1) / kThreads, static_cast<int64_t>(sms) * 8));
      QuantProblem q = p;
      at::Tensor parts;  // freed at return: the caching allocator reuses it only after this stream's kernels
      if (!p.has_static) {
        parts =
            at::empty({blocks}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, c10::cuda::current_device()));
        q.parts = parts.data_ptr<float>();
        q.nparts = static_cast<int>(blocks);
        q.phase = QPhase::kAmax;
        quant_tensor_kernel<T, F, Pair><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(q, f);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      q.phase = QPhase::kQuantize;
      quant_tensor_kernel<T, F, Pair><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(q, f);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(ffn_ext, CUDA, m) { impl_quant_all<CudaQuant>(m); }

}  // namespace quant
}  // namespace ffn_ext
