// The launcher's per-thread code and launch shape: what every ffn_ext CUDA kernel runs. Written once for the
// device and the host: cuda/rows_launcher.cuh launches it as a CUDA kernel; the tests' _emulate_cuda
// (tests/csrc/emulate_rows.cpp) runs the same code on the CPU for every block and thread of the same launch shape,
// one after the other (threads share nothing), so CI checks the indexing, peeling and strides without a GPU.
//
// A problem is `rows` x `cols` elements; each operand (NI inputs, NO outputs, one dtype T) is a base pointer and a
// row stride in elements, with unit stride along cols. That covers contiguous tensors (one row of numel
// elements), `chunk(2, -1)` views (row stride 2M) and the two halves of a packed [..., 2M] tensor, all without
// a copy.
//
// Per row, the elements before output 0 reaches a 16-byte boundary (the head, < VEC) and after the last whole
// vector (the tail, < VEC) are done one by one; the body moves 16 bytes per load/store, kUnroll vectors in flight
// per thread. An operand whose body start is not 16-byte aligned when output 0's is (it sits at another offset
// mod 16 bytes) uses element loads/stores for its body; the others stay vectorized. All offsets are int64. A
// thread whose kUnroll vectors are all in range, with every operand aligned (nearly every thread of a large
// tensor), runs a copy of the body without those checks (kFull).
//
// Interleaved pairs (the packed ops' layout="interleaved", [g0, u0, g1, u1, ...]): a functor whose kPairIn is p
// (ffn_math.h's Interleaved) reads inputs p and p + 1 from one operand, in[p] pointing at its first element and
// in[p + 1] = in[p] + 1, element j of each at offset 2 j (kPairOut likewise for outputs). A vector of VEC elements
// of the pair is two 16-byte accesses holding VEC whole pairs, split into the two inputs (or merged from the two
// outputs) in registers, so interleaved operands stay vectorized.
#pragma once

#include <torch/headeronly/util/BFloat16.h>  // c10::Half / c10::BFloat16, header-only (stable target)
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include "ffn_math.h"

namespace ffn_ext {
namespace rows {

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

// VEC elements of one operand, moved to and from memory as one 16-byte access (LDG.E.128 / STG.E.128).
template <typename T, int VEC>
struct alignas(16) Pack {
  T v[VEC];
};

template <typename T, int VEC>
FFN_HD void load_pack(Pack<T, VEC>& dst, const T* src, bool vectorized) {
  if (vectorized) {
#if defined(__CUDA_ARCH__)
    const uint4 bits = *reinterpret_cast<const uint4*>(src);
    memcpy(&dst, &bits, sizeof(bits));
#else
    memcpy(&dst, src, sizeof(dst));
#endif
  } else {
    FFN_UNROLL
    for (int k = 0; k < VEC; ++k) dst.v[k] = src[k];
  }
}

template <typename T, int VEC>
FFN_HD void store_pack(T* dst, const Pack<T, VEC>& src, bool vectorized) {
  if (vectorized) {
#if defined(__CUDA_ARCH__)
    uint4 bits;
    memcpy(&bits, &src, sizeof(bits));
    // Explicit 128-bit store: for float/double nvcc otherwise splits this into two 64-bit stores.
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(bits.x), "r"(bits.y), "r"(bits.z),
                 "r"(bits.w));
#else
    memcpy(dst, &src, sizeof(src));
#endif
  } else {
    FFN_UNROLL
    for (int k = 0; k < VEC; ++k) dst[k] = src.v[k];
  }
}

// Storage <-> accumulation type for a whole pack. On the device 16-bit types convert two elements at a time: a
// bfloat16 pair widens with one shift and one mask, and two floats narrow with one cvt.rn.{bf16x2,f16x2}.f32, the
// same round-to-nearest-even as c10's scalar casts, which cost about 1.5 instructions per element each way (a
// PRMT to split or merge the two halves of a 32-bit register). The host uses c10's casts.
template <typename A, typename T, int VEC>
FFN_HD void widen(const Pack<T, VEC>& p, A (&a)[VEC]) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    FFN_UNROLL
    for (int k = 0; k < VEC; k += 2) {
      uint32_t w;
      memcpy(&w, &p.v[k], sizeof(w));
      a[k] = __uint_as_float(w << 16);              // element k: the low half
      a[k + 1] = __uint_as_float(w & 0xffff0000u);  // element k + 1: the high half
    }
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    FFN_UNROLL
    for (int k = 0; k < VEC; k += 2) {
      __half2 h;
      memcpy(&h, &p.v[k], sizeof(h));
      const float2 f = __half22float2(h);
      a[k] = f.x;
      a[k + 1] = f.y;
    }
  } else
#endif
  {
    FFN_UNROLL
    for (int k = 0; k < VEC; ++k) a[k] = static_cast<A>(p.v[k]);
  }
}

template <typename T, int VEC, typename A>
FFN_HD void narrow(const A (&a)[VEC], Pack<T, VEC>& p) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    FFN_UNROLL
    for (int k = 0; k < VEC; k += 2) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(a[k], a[k + 1]);
      memcpy(&p.v[k], &h, sizeof(h));
    }
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    FFN_UNROLL
    for (int k = 0; k < VEC; k += 2) {
      const __half2 h = __floats2half2_rn(a[k], a[k + 1]);
      memcpy(&p.v[k], &h, sizeof(h));
    }
  } else
#endif
  {
    FFN_UNROLL
    for (int k = 0; k < VEC; ++k) p.v[k] = static_cast<T>(a[k]);
  }
}

FFN_HD bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// A condition that is always false and that neither nvcc nor ptxas can prove false: launch_rows always launches
// gridDim.z == 1, which the compilers cannot know. rows_thread's kFull body is one straight block of loads and
// math, and ptxas, free to schedule it, sank the later loads below the first vectors' math
// (docs/performance.md#kernel-instruction-counts), so a thread had fewer bytes in flight. A never-taken branch
// after the loads ends their block, and all of them issue before any math (tests/test_sass.py checks the SASS).
FFN_HD bool never() {
#if defined(__CUDA_ARCH__)
  return gridDim.z != 1;
#else
  return false;
#endif
}

// Where a thread is: block (bx, by) of a grid_x x grid_y grid, thread t of `threads` (blockIdx, gridDim,
// threadIdx, blockDim on the device).
struct ThreadPos {
  int64_t bx, by, grid_y;
  int64_t t, threads;
};

// Operand i of a functor whose pair starts at P (kPairIn or kPairOut; -1 for none) is one of the pair's two.
FFN_HD constexpr bool in_pair(int P, int i) { return P >= 0 && (i == P || i == P + 1); }
// Its element stride: 2 for the members of an interleaved pair, 1 otherwise.
FFN_HD constexpr int64_t step(int P, int i) { return in_pair(P, i) ? 2 : 1; }

// Where, in the widened packs of a vector, element k of operand i lives: pack `src`, position `pos`. A pair's
// VEC elements k of its operands P and P + 1 sit at 2 k and 2 k + 1 of the pair's two packs (held in the slots of
// P and P + 1).
struct Slot {
  int src, pos;
};
FFN_HD constexpr Slot slot(int P, int i, int k, int vec) {
  if (!in_pair(P, i)) return {i, k};
  const int at = 2 * k + (i - P);
  return {P + at / vec, at % vec};
}

// Everything one thread does: rows by, by + grid_y, ...; in each, block bx's share of the row.
template <typename T, typename F, int VEC>
FFN_HD void rows_thread(const RowProblem<F::NI, F::NO>& p, const F& f, const ThreadPos pos) {
  constexpr int NI = F::NI, NO = F::NO, PI = F::kPairIn, PO = F::kPairOut;
  constexpr bool kFast = math::fast_math_for<T>();
  using A = math::opmath_t<T>;
  const int64_t cols = p.cols;

  for (int64_t row = pos.by; row < p.rows; row += pos.grid_y) {
    const T* in[NI];
    T* out[NO];
    FFN_UNROLL
    for (int i = 0; i < NI; ++i) in[i] = static_cast<const T*>(p.in[i]) + row * p.in_stride[i];
    FFN_UNROLL
    for (int o = 0; o < NO; ++o) out[o] = static_cast<T*>(p.out[o]) + row * p.out_stride[o];

    // Head: elements before out[0] + head is 16-byte aligned (none if out[0] is a pair at an odd element offset,
    // which no head can align: then its body stores are element stores).
    const int64_t mis = (reinterpret_cast<uintptr_t>(out[0]) / sizeof(T)) % VEC;
    const int64_t head = step(PO, 0) == 1 ? std::min<int64_t>(cols, (VEC - mis) % VEC)
                         : mis % 2        ? 0
                                          : std::min<int64_t>(cols, (VEC - mis) % VEC / 2);
    const int64_t nvec = (cols - head) / VEC;
    const int64_t tail_start = head + nvec * VEC;

    // One element at index j, scalar loads and stores (head and tail).
    auto one = [&](int64_t j) {
      A a[NI], r[NO];
      FFN_UNROLL
      for (int i = 0; i < NI; ++i) a[i] = static_cast<A>(in[i][j * step(PI, i)]);
      f.template apply<kFast>(a, r);
      FFN_UNROLL
      for (int o = 0; o < NO; ++o) out[o][j * step(PO, o)] = static_cast<T>(r[o]);
    };
    if (pos.bx == 0) {  // threads >= 32 > VEC: thread t does head element t and tail element t
      if (pos.t < head) one(pos.t);
      if (pos.t < cols - tail_start) one(tail_start + pos.t);
    }

    // The first element of vector v of operand i (of its half of the pair's two packs, for a pair member).
    auto in_at = [&](int i, int64_t v) -> const T* {
      if (!in_pair(PI, i)) return in[i] + head + v * VEC;
      return in[PI] + 2 * (head + v * VEC) + (i - PI) * VEC;
    };
    auto out_at = [&](int o, int64_t v) -> T* {
      if (!in_pair(PO, o)) return out[o] + head + v * VEC;
      return out[PO] + 2 * (head + v * VEC) + (o - PO) * VEC;
    };
    bool in_vec[NI], out_vec[NO], all_vec = true;
    FFN_UNROLL
    for (int i = 0; i < NI; ++i) all_vec &= in_vec[i] = aligned16(in_at(i, 0));
    FFN_UNROLL
    for (int o = 0; o < NO; ++o) all_vec &= out_vec[o] = aligned16(out_at(o, 0));

    // Body: this block's kUnroll * threads vectors; thread t takes vectors t, t + threads, ... (coalesced).
    // Written once, instantiated twice: kFull (every operand 16-byte aligned and all kUnroll vectors in range,
    // which is every thread of a large aligned tensor but the last block's) drops the per-vector range checks
    // and alignment branches, a sizeable share of the instructions per element
    // (docs/performance.md#kernel-instruction-counts).
    const int64_t v0 = pos.bx * pos.threads * kUnroll + pos.t;
    auto body = [&](auto full) {
      constexpr bool kFull = decltype(full)::value;
      Pack<T, VEC> buf[kUnroll][NI];
      FFN_UNROLL
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * pos.threads;
        if (kFull || v < nvec) {
          FFN_UNROLL
          for (int i = 0; i < NI; ++i) load_pack(buf[u][i], in_at(i, v), kFull || in_vec[i]);
        }
      }
      if (kFull && never()) return;  // keeps every load above: see never()
      FFN_UNROLL
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * pos.threads;
        if (kFull || v < nvec) {
          A x[NI][VEC], y[NO][VEC];
          FFN_UNROLL
          for (int i = 0; i < NI; ++i) widen(buf[u][i], x[i]);
          FFN_UNROLL
          for (int k = 0; k < VEC; ++k) {
            A a[NI], r[NO];
            FFN_UNROLL
            for (int i = 0; i < NI; ++i) {
              const Slot s = slot(PI, i, k, VEC);
              a[i] = x[s.src][s.pos];
            }
            f.template apply<kFast>(a, r);
            FFN_UNROLL
            for (int o = 0; o < NO; ++o) {
              const Slot s = slot(PO, o, k, VEC);
              y[s.src][s.pos] = r[o];
            }
          }
          FFN_UNROLL
          for (int o = 0; o < NO; ++o) {
            Pack<T, VEC> res;
            narrow(y[o], res);
            store_pack(out_at(o, v), res, kFull || out_vec[o]);
          }
        }
      }
    };
    // float64 has no kFull body: with its long exp/erf it needs more than 128 registers (GELU backward spilled).
    if (sizeof(T) < 8 && all_vec && v0 + (kUnroll - 1) * pos.threads < nvec) {
      body(std::true_type{});
    } else {
      body(std::false_type{});
    }
  }
}

// Launch shape. Rows go on grid.y (a strided loop past 65535); along a row each block covers threads * kUnroll
// vectors. Large problems get 256-thread blocks. Small ones (decode: a few rows of a few thousand elements) get
// narrower blocks, down to one warp, so that the grid still has about two blocks per multiprocessor instead of a
// handful of wide ones.
struct LaunchShape {
  int64_t grid_x, grid_y;
  int threads;
};
inline LaunchShape launch_shape(int64_t rows, int64_t cols, int vec, int sms) {
  const int64_t grid_y = std::min<int64_t>(rows, 65535);
  const int64_t want_bx = std::max<int64_t>(1, (2 * sms + grid_y - 1) / grid_y);
  const int64_t vecs = (cols + vec - 1) / vec;  // per row
  const int64_t lanes = (vecs + kUnroll * want_bx - 1) / (kUnroll * want_bx);
  const int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, std::max<int64_t>(32, (lanes + 31) / 32 * 32)));
  const int64_t per_block = static_cast<int64_t>(threads) * kUnroll;
  const int64_t grid_x = std::max<int64_t>(1, (vecs + per_block - 1) / per_block);
  if (grid_x > 0x7fffffff)
    throw std::runtime_error("ffn_ext: row of " + std::to_string(cols) + " elements is too long for one launch");
  return {grid_x, grid_y, threads};
}

}  // namespace rows
}  // namespace ffn_ext
