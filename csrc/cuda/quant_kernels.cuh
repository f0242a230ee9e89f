// CUDA kernels of the quantizing ops (../quant.h): quant_kernel.h's per-lane and per-thread code as three kernels
// per (op, input dtype, pair layout), the recipe (fp8 format, pow2, scale dtype and layout, static scale, the
// tensor kernel's phase) runtime data in QuantProblem: quant_kernel (scaling="group", one launch), quant_row_kernel
// (scaling="row", one launch) and quant_tensor_kernel (scaling="tensor": one launch with a static scale, two with a
// dynamic one: amax, then quantize). Kernels per arch: 3 kinds x 3 dtypes x (identity + 7 gated ops x 2 layouts:
// two operands, or one interleaved pair) = 135 with today's table (45 per kind; tests/test_sass.py counts them).
// The row and tensor kernels are kept apart (not one kernel with a runtime scaling) so that the row kernel's held
// h (kRowChunks x 8 floats per thread) does not set the tensor kernel's register count. float64 runs the
// composite (../quant_ops.h).
//
// The quantizing ops' lines (the table's gated lines, then quantize) are dealt round-robin to kQuantParts parts
// (line % kQuantParts: a line's two layouts, three dtypes and three kinds in one part), quant_part<i>.cu, which
// ninja compiles in parallel; one quant.cu of all 135 kernels per arch was the CUDA build's critical path.
// Torch-free, as kernels_part.cuh: only quant_kernel.h (rows.h, ffn_math.h), ops_table.h and the CUDA runtime.
// The ops, which need torch, are registered by ops.cpp (g++) and call launch_quant (launch_quant.h).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include "../ffn_math.h"
#include "../ops_table.h"
#include "../quant_kernel.h"
#include "launch_quant.h"

namespace ffn_ext {
namespace quant {
namespace {

// Grid-stride over lanes; the loop bound is the same for every thread of a warp (it steps by whole blocks), so the
// shuffles always have the full warp. A group never straddles a warp: its L lanes are consecutive and L divides 32.
// The shuffle steps are unrolled, each under a test of p.lanes the whole grid takes alike: a loop of runtime length
// cost 5 instructions per step.
template <typename T, class F, bool Pair>
__global__ void __launch_bounds__(kThreads) quant_kernel(QuantProblem p, F f) {
  const int64_t per_row = group_lanes_per_row(p);
  const int64_t total = p.rows * per_row;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  const int shift = lane_shift(p.lanes);
  const bool writer = (threadIdx.x & (p.lanes - 1)) == 0;
  if (per_row == 0) return;
  LaneCursor l(static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x, step, per_row);
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads; base < total; base += step, l.next()) {
    const bool ok = l.row < p.rows;
    float h[kGroupChunks][kLaneElems];
    float m = ok ? group_lane_h<T, F, Pair>(p, f, l.row, l.chunk, shift, h) : 0.0f;
#pragma unroll
    for (int w = 1; w < kMaxLanes; w <<= 1) {
      if (w < p.lanes) m = amax_step(m, __shfl_xor_sync(0xffffffffu, m, w));
    }
    if (ok) group_lane_store(p, l.row, l.chunk, shift, h, m, writer);
  }
}

// The block's amax of every thread's m (all threads of the block call it; blockDim.x a multiple of 32, at most
// kThreads): each warp's xor shuffle, lane 0 of each warp into shared memory, then in every warp lane l takes warp
// l % kMaxWarps's value (0 past the block's warps) and xor-shuffles over kMaxWarps lanes, so every thread gets the
// max of all (a NaN is the canonical one on the device). A loop over the warps' values in shared memory, which
// every thread ran, took several times the instructions per row (docs/performance.md#kernel-instruction-counts).
// The second barrier lets the next call reuse warp_max.
__device__ float block_amax(float m, float* warp_max) {
  for (int s = 16; s >= 1; s >>= 1) m = amax_step(m, __shfl_xor_sync(0xffffffffu, m, s));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  const int w = static_cast<int>(threadIdx.x & (kMaxWarps - 1));
  m = w < static_cast<int>(blockDim.x / 32) ? warp_max[w] : 0.0f;
  for (int s = kMaxWarps / 2; s >= 1; s >>= 1) m = amax_step(m, __shfl_xor_sync(0xffffffffu, m, s));
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

// The FP8 activation cache (../cache_kernel.h): the group kernel's shape, with gate's and up's amaxes shuffled.
template <typename T, class Gate>
__global__ void __launch_bounds__(kThreads) cache_kernel(CacheProblem p, Gate gate) {
  const int64_t per_row = cache_lanes_per_row(p);
  const int64_t total = p.rows * per_row;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  const int shift = lane_shift(p.lanes);
  const bool writer = (threadIdx.x & (p.lanes - 1)) == 0;
  if (per_row == 0) return;
  LaneCursor l(static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x, step, per_row);
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads; base < total; base += step, l.next()) {
    const bool ok = l.row < p.rows;
    float g[kGroupChunks][kLaneElems], u[kGroupChunks][kLaneElems];
    float mg = 0.0f, mu = 0.0f;
    if (ok) cache_lane_h<T>(p, gate, l.row, l.chunk, shift, g, u, mg, mu);
#pragma unroll
    for (int w = 1; w < kMaxLanes; w <<= 1) {
      if (w < p.lanes) {
        mg = amax_step(mg, __shfl_xor_sync(0xffffffffu, mg, w));
        mu = amax_step(mu, __shfl_xor_sync(0xffffffffu, mu, w));
      }
    }
    if (ok) cache_lane_store(p, l.row, l.chunk, shift, g, u, mg, mu, writer);
  }
}

template <typename T, class Gate>
__global__ void __launch_bounds__(kThreads) cached_backward_kernel(CacheProblem p, Gate gate) {
  const int64_t per_row = cached_lanes_per_row(p);
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  if (per_row == 0) return;
  for (LaneCursor l(static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x, step, per_row); l.row < p.rows;
       l.next()) {
    cached_backward_lane<T>(p, gate, l.row, l.chunk);
  }
}

}  // namespace

template <typename T, class Gate>
cudaError_t launch_cache(const CacheProblem& p, const Gate& gate, cudaStream_t stream, int sms) {
  const int64_t blocks = cache_blocks(p.rows * cache_lanes_per_row(p), static_cast<int64_t>(sms) * 8);
  cache_kernel<T, Gate><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, gate);
  return cudaGetLastError();
}

template <typename T, class Gate>
cudaError_t launch_cached_backward(const CacheProblem& p, const Gate& gate, cudaStream_t stream, int sms) {
  const int64_t blocks = cache_blocks(p.rows * cached_lanes_per_row(p), static_cast<int64_t>(sms) * 8);
  cached_backward_kernel<T, Gate><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, gate);
  return cudaGetLastError();
}

template <typename T, class F, bool Pair>
cudaError_t launch_quant(const QuantProblem& p, const F& f, cudaStream_t stream, int sms, float* parts) {
  if (p.scaling == QScaling::kGroup) {
    const int64_t lanes = p.rows * group_lanes_per_row(p);
    const int64_t blocks = std::min<int64_t>((lanes + kThreads - 1) / kThreads, static_cast<int64_t>(sms) * 8);
    quant_kernel<T, F, Pair><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, f);
    return cudaGetLastError();
  }
  if (p.scaling == QScaling::kRow) {
    const int threads = row_threads(p.cols);
    const int64_t blocks = std::min<int64_t>(p.rows, static_cast<int64_t>(sms) * (2048 / threads));
    quant_row_kernel<T, F, Pair><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p, f);
    return cudaGetLastError();
  }
  const int64_t blocks = tensor_blocks(p, sms);
  QuantProblem q = p;
  if (!p.has_static) {
    q.parts = parts;
    q.nparts = static_cast<int>(blocks);
    q.phase = QPhase::kAmax;
    quant_tensor_kernel<T, F, Pair><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(q, f);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  q.phase = QPhase::kQuantize;
  quant_tensor_kernel<T, F, Pair><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(q, f);
  return cudaGetLastError();
}

// The quantizing ops' lines in order: the table's gated lines (each op with two operands and an interleaved pair),
// then quantize (the identity); line i's kernels are in part i % kQuantParts.
enum QuantLine {
#define FFN_EXT_QUANT_LINE(name, ...) kQuantLine_##name,
  FFN_EXT_GATED(FFN_EXT_QUANT_LINE) kQuantLine_quantize,
#undef FFN_EXT_QUANT_LINE
  kQuantLines
};

template <class F, bool Pair>
void keep_quant_types(void (*keep)(const void*)) {  // the fused dtypes (QuantOps::fused, run_typed)
  keep(reinterpret_cast<const void*>(&launch_quant<float, F, Pair>));
  keep(reinterpret_cast<const void*>(&launch_quant<c10::Half, F, Pair>));
  keep(reinterpret_cast<const void*>(&launch_quant<c10::BFloat16, F, Pair>));
}

// What QuantOps<CudaQuant> (ops.cpp) runs for a line: a gated op's GatedH with two operands (the op and its
// concat packed form) and with an interleaved pair; quantize's Identity. One missing here is an undefined symbol
// when `import ffn_ext` loads _C.
template <class Gate>
void keep_cache_types(void (*keep)(const void*)) {  // the cache ops' dtypes (CacheOps::typed)
  keep(reinterpret_cast<const void*>(&launch_cache<float, Gate>));
  keep(reinterpret_cast<const void*>(&launch_cache<c10::Half, Gate>));
  keep(reinterpret_cast<const void*>(&launch_cache<c10::BFloat16, Gate>));
  keep(reinterpret_cast<const void*>(&launch_cached_backward<float, Gate>));
  keep(reinterpret_cast<const void*>(&launch_cached_backward<c10::Half, Gate>));
  keep(reinterpret_cast<const void*>(&launch_cached_backward<c10::BFloat16, Gate>));
}

template <int Part>
void quant_kernels_of_part(void (*keep)(const void*)) {
#define FFN_EXT_KEEP_QUANT(name, Gate, P) \
  if constexpr (kQuantLine_##name % kQuantParts == Part) { \
    keep_quant_types<GatedH<math::Gate>, false>(keep); \
    keep_quant_types<GatedH<math::Gate>, true>(keep); \
    keep_cache_types<math::Gate>(keep); \
  }
  FFN_EXT_GATED(FFN_EXT_KEEP_QUANT)
#undef FFN_EXT_KEEP_QUANT
  if constexpr (kQuantLine_quantize % kQuantParts == Part) keep_quant_types<Identity, false>(keep);
}

template void quant_kernels_of_part<FFN_EXT_QUANT_PART>(void (*)(const void*));

}  // namespace quant
}  // namespace ffn_ext
