// The one launcher every ffn_ext row kernel uses: rows_thread and launch_shape (../rows.h, shared with the host
// emulation that the CPU tests run) as a CUDA kernel on a given stream. Torch-free, for nvcc (kernels_part.cuh);
// the ops call it through launch_rows.h, with the current stream and the device's multiprocessor count.
#pragma once

#include <cuda_runtime_api.h>

#include <type_traits>

#include "../rows.h"
#include "launch_rows.h"

namespace ffn_ext {
namespace cuda {

using rows::RowProblem;

// Resident 256-thread blocks per multiprocessor that the register allocation must allow: at least 2 (at most 128
// registers), and 5 (48) for the unary forwards (gelu, gelu_tanh, silu) in 16-bit and fp32. Those move one
// 16-byte load per vector and need the most threads to keep enough bytes in flight; left alone, ptxas gave bf16
// GELU's kFull body 58 registers (4 blocks). float64 (general body only) is left uncapped. tests/test_sass.py
// checks that none spills.
template <typename T, typename F>
constexpr int min_blocks() {
  if constexpr (sizeof(T) == 8) return 1;  // double's erf/exp: GatedBwd<Gelu> spilled at 128 registers on sm_90
  // ReGLU's backward in 16-bit: ptxas spilled 8 bytes at 128 registers on sm_80 (its select-only math lets the
  // scheduler keep more loaded vectors live); uncapped, it does not spill. Its speed is not yet measured on a GPU.
  if constexpr (sizeof(T) == 2 && std::is_same_v<F, math::GatedBwd<math::Glu<math::Relu>>>) return 1;
  // The gated backward that also writes h over GELU and GELU-tanh: six operands' packs (96 registers) and erf's or
  // tanh's math spilled 8 bytes at 128 (fp32 on sm_80, 16-bit on sm_90); uncapped they do not. The other gates fit.
  if constexpr (std::is_same_v<F, math::GatedBwdRecompute<math::Glu<math::Gelu>>> ||
                std::is_same_v<F, math::GatedBwdRecompute<math::Glu<math::GeluTanh>>>)
    return 1;
  return F::NI + F::NO == 2 ? 5 : 2;
}

template <typename T, typename F, int VEC>
__global__ void __launch_bounds__(rows::kMaxThreads, (min_blocks<T, F>()))
    rows_kernel(RowProblem<F::NI, F::NO> p, F f) {
  rows::rows_thread<T, F, VEC>(p, f, {blockIdx.x, blockIdx.y, gridDim.y, threadIdx.x, blockDim.x});
}

template <typename T, typename F>
cudaError_t launch_rows(const F& f, const RowProblem<F::NI, F::NO>& p, cudaStream_t stream, int sms) {
  constexpr int VEC = 16 / sizeof(T);
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  const rows::LaunchShape s = rows::launch_shape(p.rows, p.cols, VEC, sms);
  const dim3 grid(static_cast<unsigned>(s.grid_x), static_cast<unsigned>(s.grid_y));
  rows_kernel<T, F, VEC><<<grid, s.threads, 0, stream>>>(p, f);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace ffn_ext
