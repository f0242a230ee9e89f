// The one launcher every ffn_ext CUDA kernel uses.
//
// A problem is `rows` x `cols` elements; each operand (NI inputs, NO outputs, one dtype T) is a base pointer and a
// row stride in elements, with unit stride along cols. That covers contiguous tensors (one row of numel
// elements), `chunk(2, -1)` views (row stride 2M) and the two halves of a packed [..., 2M] tensor, all without
// a copy.
//
// Per row, the elements before output 0 reaches a 16-byte boundary (the head, < VEC) and after the last whole
// vector (the tail, < VEC) are done one by one; the body moves 16 bytes per load/store, UNROLL vectors in flight
// per thread. An operand whose body start is not 16-byte aligned when output 0's is (it sits at another offset
// mod 16 bytes) uses element loads/stores for its body; the others stay vectorized. All offsets are int64.
#pragma once

#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "../ffn_math.h"

namespace ffn_ext {
namespace cuda {

constexpr int kUnroll = 4;
constexpr int kMaxThreads = 256;

template <int NI, int NO>
struct RowProblem {
  const void* in[NI];
  void* out[NO];
  int64_t in_stride[NI];
  int64_t out_stride[NO];
  int64_t rows;
  int64_t cols;
};

// VEC elements of one operand, moved to and from memory as one 16-byte uint4 (LDG.E.128 / STG.E.128).
template <typename T, int VEC>
struct alignas(16) Pack {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ void load_pack(Pack<T, VEC>& dst, const T* src, bool vectorized) {
  if (vectorized) {
    const uint4 bits = *reinterpret_cast<const uint4*>(src);
    memcpy(&dst, &bits, sizeof(bits));
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) dst.v[k] = src[k];
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_pack(T* dst, const Pack<T, VEC>& src, bool vectorized) {
  if (vectorized) {
    uint4 bits;
    memcpy(&bits, &src, sizeof(bits));
    // Explicit 128-bit store: for float/double nvcc otherwise splits this into two 64-bit stores.
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(bits.x), "r"(bits.y), "r"(bits.z),
                 "r"(bits.w));
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) dst[k] = src.v[k];
  }
}

// Storage <-> accumulation type for a whole pack. 16-bit types convert two elements at a time: a bfloat16 pair
// widens with one shift and one mask, and two floats narrow with one cvt.rn.{bf16x2,f16x2}.f32, the same
// round-to-nearest-even as c10's scalar casts, which cost about 1.5 instructions per element each way (a PRMT
// to split or merge the two halves of a 32-bit register).
template <typename A, typename T, int VEC>
__device__ __forceinline__ void widen(const Pack<T, VEC>& p, A (&a)[VEC]) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
#pragma unroll
    for (int k = 0; k < VEC; k += 2) {
      uint32_t w;
      memcpy(&w, &p.v[k], sizeof(w));
      a[k] = __uint_as_float(w << 16);              // element k: the low half
      a[k + 1] = __uint_as_float(w & 0xffff0000u);  // element k + 1: the high half
    }
  } else if constexpr (std::is_same_v<T, c10::Half>) {
#pragma unroll
    for (int k = 0; k < VEC; k += 2) {
      __half2 h;
      memcpy(&h, &p.v[k], sizeof(h));
      const float2 f = __half22float2(h);
      a[k] = f.x;
      a[k + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) a[k] = static_cast<A>(p.v[k]);
  }
}

template <typename T, int VEC, typename A>
__device__ __forceinline__ void narrow(const A (&a)[VEC], Pack<T, VEC>& p) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
#pragma unroll
    for (int k = 0; k < VEC; k += 2) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(a[k], a[k + 1]);
      memcpy(&p.v[k], &h, sizeof(h));
    }
  } else if constexpr (std::is_same_v<T, c10::Half>) {
#pragma unroll
    for (int k = 0; k < VEC; k += 2) {
      const __half2 h = __floats2half2_rn(a[k], a[k + 1]);
      memcpy(&p.v[k], &h, sizeof(h));
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) p.v[k] = static_cast<T>(a[k]);
  }
}

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <typename T, typename F, int VEC>
__global__ void __launch_bounds__(kMaxThreads) rows_kernel(RowProblem<F::NI, F::NO> p, F f) {
  constexpr int NI = F::NI, NO = F::NO;
  constexpr bool kFast = math::fast_math_for<T>();
  using A = at::opmath_type<T>;
  const int64_t cols = p.cols;

  for (int64_t row = blockIdx.y; row < p.rows; row += gridDim.y) {
    const T* in[NI];
    T* out[NO];
#pragma unroll
    for (int i = 0; i < NI; ++i) in[i] = static_cast<const T*>(p.in[i]) + row * p.in_stride[i];
#pragma unroll
    for (int o = 0; o < NO; ++o) out[o] = static_cast<T*>(p.out[o]) + row * p.out_stride[o];

    // Head: elements before out[0] + head is 16-byte aligned.
    const int64_t mis = (reinterpret_cast<uintptr_t>(out[0]) / sizeof(T)) % VEC;
    const int64_t head = std::min<int64_t>(cols, (VEC - mis) % VEC);
    const int64_t nvec = (cols - head) / VEC;
    const int64_t tail_start = head + nvec * VEC;

    // One element at index j, scalar loads and stores (head and tail).
    auto one = [&](int64_t j) {
      A a[NI], r[NO];
#pragma unroll
      for (int i = 0; i < NI; ++i) a[i] = static_cast<A>(in[i][j]);
      f.template apply<kFast>(a, r);
#pragma unroll
      for (int o = 0; o < NO; ++o) out[o][j] = static_cast<T>(r[o]);
    };
    if (blockIdx.x == 0) {
      const int64_t t = threadIdx.x;
      if (t < head) one(t);
      if (t < cols - tail_start) one(tail_start + t);
    }

    bool in_vec[NI], out_vec[NO];
#pragma unroll
    for (int i = 0; i < NI; ++i) in_vec[i] = aligned16(in[i] + head);
#pragma unroll
    for (int o = 0; o < NO; ++o) out_vec[o] = aligned16(out[o] + head);

    // Body: this block's UNROLL * blockDim vectors; thread t takes vectors t, t + blockDim, ... (coalesced).
    const int64_t v0 = static_cast<int64_t>(blockIdx.x) * blockDim.x * kUnroll + threadIdx.x;
    Pack<T, VEC> buf[kUnroll][NI];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + static_cast<int64_t>(u) * blockDim.x;
      if (v < nvec) {
#pragma unroll
        for (int i = 0; i < NI; ++i) load_pack(buf[u][i], in[i] + head + v * VEC, in_vec[i]);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + static_cast<int64_t>(u) * blockDim.x;
      if (v < nvec) {
        A x[NI][VEC], y[NO][VEC];
#pragma unroll
        for (int i = 0; i < NI; ++i) widen(buf[u][i], x[i]);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          A a[NI], r[NO];
#pragma unroll
          for (int i = 0; i < NI; ++i) a[i] = x[i][k];
          f.template apply<kFast>(a, r);
#pragma unroll
          for (int o = 0; o < NO; ++o) y[o][k] = r[o];
        }
#pragma unroll
        for (int o = 0; o < NO; ++o) {
          Pack<T, VEC> res;
          narrow(y[o], res);
          store_pack(out[o] + head + v * VEC, res, out_vec[o]);
        }
      }
    }
  }
}

// Launch shape. Rows go on grid.y (a strided loop past 65535); along a row each block covers threads * UNROLL
// vectors. Large problems get 256-thread blocks. Small ones (decode: a few rows of a few thousand elements) get
// narrower blocks, down to one warp, so that the grid still has about two blocks per multiprocessor instead of a
// handful of wide ones.
template <typename T, typename F>
void launch_rows(const F& f, const RowProblem<F::NI, F::NO>& p) {
  constexpr int VEC = 16 / sizeof(T);
  if (p.rows == 0 || p.cols == 0) return;
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  const int64_t grid_rows = std::min<int64_t>(p.rows, 65535);
  const int64_t want_bx = std::max<int64_t>(1, (2 * sms + grid_rows - 1) / grid_rows);
  const int64_t vecs = (p.cols + VEC - 1) / VEC;  // per row
  const int64_t lanes = (vecs + kUnroll * want_bx - 1) / (kUnroll * want_bx);
  const int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, std::max<int64_t>(32, (lanes + 31) / 32 * 32)));
  const int64_t per_block = static_cast<int64_t>(threads) * kUnroll;
  const int64_t bx = std::max<int64_t>(1, (vecs + per_block - 1) / per_block);
  TORCH_CHECK(bx <= 0x7fffffff, "ffn_ext: row of ", std::to_string(p.cols), " elements is too long for one launch");
  const dim3 grid(static_cast<unsigned>(bx), static_cast<unsigned>(grid_rows));
  rows_kernel<T, F, VEC><<<grid, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(p, f);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace ffn_ext
