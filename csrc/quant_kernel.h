// The quantizing CUDA kernels' per-lane code, written once for the device and the host: cuda/quant_kernels.cuh runs
// it as a CUDA kernel, test_paths_quant.cpp's _emulate_quant runs the same code on the CPU group by group
// (tests/test_quant.py), so CI checks the indexing, the loads and the element math without a GPU (the warp shuffle
// itself only runs on a GPU).
//
// Work split (scaling="group"): h is rows x cols, cols a multiple of the group size G (32, 64 or 128). A lane
// computes 8 consecutive elements of h (one 16-byte load per 16-bit operand, two for float32), so a group is
// L = G / 8 consecutive lanes (4, 8, 16) of one warp. Each lane computes its h in float exactly as the unfused
// kernel does (opmath, then rounded once to the input dtype), takes the max |h| of its 8, the group's amax comes
// from log2(L) __shfl_xor_sync steps (every lane of the group ends with it, so each quantizes with the same scale),
// and the group's first lane writes that scale: the scale stored is the one quantized with. Any row count, any
// group count per row; offsets are int64. The recipe (fp8 format, pow2 scales, e8m0 or float32 scales, scale
// strides for row or column layout) is runtime data in QuantProblem: one kernel per (op, input dtype, pair layout).
//
// scaling="row" (one scale per row, rows of any length, cols not necessarily a multiple of 8: a row's last lane may
// hold fewer than 8 elements, loaded one by one): one block per row at a time (grid-stride over rows). Each thread
// takes the row's chunks tid, tid + T, ... (T threads, coalesced); sweep 1 computes its h and folds its amax, the
// block combines the threads' amaxes (row_block_amax: the warps' xor shuffles, then the warps' results through
// shared memory, read by every thread in the same order, so every thread holds the same bits), and sweep 2
// quantizes with the scale from it; thread 0 stores that scale. A row of up to kRowChunks chunks per thread
// (kRowChunks * 8 * 256 = 8192 elements) keeps its h in registers between the sweeps: the inputs are read once
// (bytes read = the inputs', 2 B/element per bf16 operand). A longer row recomputes h in sweep 2 from the inputs:
// the inputs are read twice (for bf16 swiglu, 8 B read + 1 B written per element instead of 4 + 1), the second
// read expected mostly from L2, not measured yet (a 32768-element bf16 row of two operands is 128 KiB; at 2 blocks
// per SM, 132 x 2 such rows are 33 MiB in flight against the H200's 50 MiB L2). The alternatives cost more: h in shared memory would bound the row length by the 227 KiB of an
// SM and cut the blocks per SM; h written to global memory as scratch is the composite's extra pass.
//
// scaling="tensor": a static scale needs no amax: one launch of the tensor kernel quantizing every lane with it.
// A dynamic scale needs the amax of the whole tensor before the first element is quantized, and CUDA has no
// grid-wide barrier in an ordinary launch (a cooperative launch would bound the grid by residency and is not
// capturable everywhere): two launches of the same kernel. Launch 1 (amax) folds each thread's lanes (grid-stride
// over (row, chunk), as the group kernel), combines them in the block as above and stores the block's amax in a
// scratch array of `parts` floats (one per block: no atomics and no zero-fill launch, and the fold's order is
// fixed). Launch 2 (quantize) has every block fold those parts again (parts <= 8 per SM: a few KiB read from L2
// per block) into the same amax and scale; block 0's thread 0 stores it.
#pragma once

#include <ATen/OpMathType.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "ffn_math.h"
#include "rows.h"

namespace ffn_ext {
namespace quant {

constexpr int kLaneElems = 8;
constexpr int kThreads = 256;  // threads per block (every kernel); the row kernel may use fewer (row_threads)
constexpr int kRowChunks = 4;  // chunks of 8 elements per thread a row kernel keeps in registers between sweeps

enum class QScaling : int { kGroup, kRow, kTensor };
enum class QPhase : int { kQuantize, kAmax };  // the tensor kernel's launch: quantize, or the dynamic amax

struct QuantProblem {
  const void* in[2];     // gate, up; or x (in[0]); or an interleaved pair's first element (in[0])
  int64_t in_stride[2];  // row strides in elements (unit stride along the row)
  uint8_t* q;            // [rows, cols], contiguous
  void* scale;           // float32 or float8_e8m0fnu, [rows, cols / G] with the strides below (elements)
  int64_t scale_row, scale_col;
  int64_t rows, cols;
  int lanes;        // lanes per group: G / 8
  bool vectorized;  // every operand's rows start 16-byte aligned: 16-byte loads
  float fp8_max;    // 448 (e4m3fn) or 57344 (e5m2): selects the format
  bool pow2, e8m0;
  QScaling scaling;
  // scaling="tensor"
  QPhase phase;
  bool has_static;     // the scale is static_scale (already as float and pow2-rounded: the composite's scale)
  float static_scale;  //
  float* parts;        // dynamic: one amax per block of the amax launch (device scratch)
  int nparts;          // the amax launch's block count
};

// h of the identity (quantize x) and of a gated op, from the lane's inputs in opmath.
struct Identity {
  static constexpr int NI = 1;
  template <bool Fast, typename A> FFN_HD A h(const A* in) const { return in[0]; }
};
template <class Gate>
struct GatedH {
  static constexpr int NI = 2;
  Gate gate;
  template <bool Fast, typename A> FFN_HD A h(const A* in) const { return gate.template fwd<Fast>(in[0], in[1]); }
};

// max(m, x) that keeps a NaN from either side (fmaxf would drop it): the amax of a group with a NaN is NaN. On the
// device one max.NaN (FMNMX.NAN, |x| folded in), whose NaN is the canonical one rather than x's: a NaN scale's
// payload is not part of the formula (tests/test_quant.py compares NaN scales as NaN). The select form took three
// instructions (FSETP.NAN, FSETP.GT.OR, FSEL) per element: 4.2 of bf16 SwiGLU's 42.1 per element in the sm_90 row
// kernel.
FFN_HD float amax_step(float m, float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(x));
  return r;
#else
  return (x > m || x != x) ? x : m;
#endif
}

// N elements from src: N * sizeof(T) / 16 16-byte loads when vectorized, else one by one.
template <typename T, int N>
FFN_HD void load_elems(rows::Pack<T, N>& dst, const T* src, bool vectorized) {
  constexpr int kVec = 16 / sizeof(T);
  if (vectorized) {
    FFN_UNROLL
    for (int j = 0; j < N / kVec; ++j) {
      rows::Pack<T, kVec> part;
      rows::load_pack(part, src + j * kVec, true);
      memcpy(&dst.v[j * kVec], &part, sizeof(part));
    }
  } else {
    FFN_UNROLL
    for (int k = 0; k < N; ++k) dst.v[k] = src[k];
  }
}

// The first `n` of N elements (the rest 0): with Vec, all N by 16-byte loads (n == N, 16-byte aligned); else one
// by one.
template <bool Vec, typename T, int N>
FFN_HD void load_part(rows::Pack<T, N>& dst, const T* src, int n) {
  if constexpr (Vec) {
    load_elems(dst, src, true);
  } else {
    FFN_UNROLL
    for (int k = 0; k < N; ++k) dst.v[k] = k < n ? src[k] : T(0);
  }
}

// Phase 1 of a lane: its n (8, or fewer at the end of a row whose length is not a multiple of 8) elements of h
// (row, columns col..col+n-1), rounded to T and held in float; returns their max |h| (NaN if one is NaN). Vec: a
// whole lane of 16-byte aligned operands (n == 8), 16-byte loads; else element by element (the rest of its operands
// are 0 and its h past n is not counted). lane_h picks one of the two at run time.
template <typename T, class F, bool Pair, bool Vec>
FFN_HD float lane_h_as(const QuantProblem& p, const F& f, int64_t row, int64_t col, float (&h)[kLaneElems], int n) {
  constexpr bool kFast = math::fast_math_for<T>();
  using A = at::opmath_type<T>;
  A a[2][kLaneElems] = {};  // the identity reads one operand
  if constexpr (Pair) {     // [g0, u0, g1, u1, ...]: 16 elements hold the lane's 8 pairs
    rows::Pack<T, 2 * kLaneElems> raw;
    load_part<Vec>(raw, static_cast<const T*>(p.in[0]) + row * p.in_stride[0] + 2 * col, 2 * n);
    A w[2 * kLaneElems];
    rows::widen(raw, w);
    FFN_UNROLL
    for (int k = 0; k < kLaneElems; ++k) a[0][k] = w[2 * k], a[1][k] = w[2 * k + 1];
  } else {
    FFN_UNROLL
    for (int i = 0; i < F::NI; ++i) {
      rows::Pack<T, kLaneElems> raw;
      load_part<Vec>(raw, static_cast<const T*>(p.in[i]) + row * p.in_stride[i] + col, n);
      rows::widen(raw, a[i]);
    }
  }
  A r[kLaneElems];
  FFN_UNROLL
  for (int k = 0; k < kLaneElems; ++k) {
    const A in[2] = {a[0][k], a[1][k]};
    r[k] = f.template h<kFast>(in);
  }
  rows::Pack<T, kLaneElems> rounded;  // h as the unfused op stores it
  rows::narrow(r, rounded);
  A back[kLaneElems];
  rows::widen(rounded, back);
  float m = 0.0f;
  FFN_UNROLL
  for (int k = 0; k < kLaneElems; ++k) {
    h[k] = static_cast<float>(back[k]);
    if (k < n) m = amax_step(m, ::fabsf(h[k]));
  }
  return m;
}
// Two instantiations rather than one with the choice made per load: with it inside, ptxas predicated the 8
// element-wise loads per operand (and their merges) into the 16-byte path, issued there with their predicate off:
// about 7 of bf16 SwiGLU's 37.9 instructions per element in the sm_90 row kernel (and the n == 8 checks per element
// of the amax). With n == 8 a constant, the Vec instantiation has neither.
template <typename T, class F, bool Pair>
FFN_HD float lane_h(const QuantProblem& p, const F& f, int64_t row, int64_t col, float (&h)[kLaneElems],
                    int n = kLaneElems) {
  if (p.vectorized && n == kLaneElems) return lane_h_as<T, F, Pair, true>(p, f, row, col, h, kLaneElems);
  return lane_h_as<T, F, Pair, false>(p, f, row, col, h, n);
}

// A scale into p.scale at element offset `at`, as float32 or e8m0.
FFN_HD void store_scale(const QuantProblem& p, int64_t at, float scale) {
  if (p.e8m0) {
    static_cast<uint8_t*>(p.scale)[at] = math::to_e8m0(scale);
  } else {
    static_cast<float*>(p.scale)[at] = scale;
  }
}

// A lane's n elements quantized with inv = 1 / scale (one division per scale, by the caller), the whole chunk at
// once (math::quant_chunk: on sm_89+ two elements per conversion instruction, the clamp folded into its
// saturation): one 8-byte store when the lane is whole and its offset a multiple of 8 (cols a multiple of 8), else
// byte by byte (a row's last lane; its elements past n are converted and dropped).
FFN_HD void lane_quant(const QuantProblem& p, int64_t row, int64_t col, const float (&h)[kLaneElems], float inv,
                       int n = kLaneElems) {
  static_assert(kLaneElems == math::kChunk, "a lane is one chunk of the fp8 conversion");
  uint32_t w[2];
  math::quant_chunk(h, inv, p.fp8_max, w);
  uint8_t* dst = p.q + row * p.cols + col;
  if (n == kLaneElems && p.cols % kLaneElems == 0) {
#if defined(__CUDA_ARCH__)
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
#else
    memcpy(dst, w, sizeof(w));  // w's bytes in element order on a little-endian host, as on the device
#endif
  } else {
    FFN_UNROLL
    for (int k = 0; k < kLaneElems; ++k) {  // unrolled: w stays in registers
      if (k < n) dst[k] = static_cast<uint8_t>(w[k / 4] >> (8 * (k % 4)));
    }
  }
}

// Phase 2 of a lane (scaling="group"): quantize its 8 elements with the group's scale (from the group's amax) into
// one 8-byte store (cols is a multiple of 32); the group's first lane (writer) stores the scale.
FFN_HD void lane_store(const QuantProblem& p, int64_t row, int64_t col, const float (&h)[kLaneElems], float amax,
                       bool writer) {
  const float scale = math::quant_scale(amax, p.fp8_max, p.pow2);
  lane_quant(p, row, col, h, 1.0f / scale);
  if (writer) store_scale(p, row * p.scale_row + (col / (kLaneElems * p.lanes)) * p.scale_col, scale);
}

// ---------------------------------------------------------------- scaling="row" and "tensor": per-thread code
// The row kernel's threads per block for rows of `cols` elements: one chunk per thread up to 256 chunks (a warp
// at least), then 256 threads with up to kRowChunks chunks held each, then two sweeps.
FFN_HD int row_threads(int64_t cols) {
  const int64_t chunks = (cols + kLaneElems - 1) / kLaneElems;
  const int64_t t = (chunks + 31) / 32 * 32;
  return static_cast<int>(t < 32 ? 32 : (t > kThreads ? kThreads : t));
}
FFN_HD int64_t row_chunks(const QuantProblem& p) { return (p.cols + kLaneElems - 1) / kLaneElems; }
FFN_HD int chunk_len(const QuantProblem& p, int64_t c) {
  const int64_t left = p.cols - c * kLaneElems;
  return left < kLaneElems ? static_cast<int>(left) : kLaneElems;
}
FFN_HD bool row_held(const QuantProblem& p, int threads) {
  return row_chunks(p) <= static_cast<int64_t>(kRowChunks) * threads;
}

// Sweep 1 of thread `tid` (of `threads`) over a row: the max |h| of its chunks; their h kept in `h` when the row
// is held (row_held), else dropped.
template <typename T, class F, bool Pair>
FFN_HD float row_sweep1(const QuantProblem& p, const F& f, int64_t row, int tid, int threads,
                        float (&h)[kRowChunks][kLaneElems]) {
  const int64_t chunks = row_chunks(p);
  float m = 0.0f;
  if (row_held(p, threads)) {
    FFN_UNROLL
    for (int j = 0; j < kRowChunks; ++j) {  // unrolled: h[j] stays in registers
      const int64_t c = tid + static_cast<int64_t>(j) * threads;
      if (c < chunks) m = amax_step(m, lane_h<T, F, Pair>(p, f, row, c * kLaneElems, h[j], chunk_len(p, c)));
    }
  } else {
    for (int64_t c = tid; c < chunks; c += threads) {
      float t[kLaneElems];
      m = amax_step(m, lane_h<T, F, Pair>(p, f, row, c * kLaneElems, t, chunk_len(p, c)));
    }
  }
  return m;
}

// Sweep 2: quantize the thread's chunks with inv = 1 / the row's scale (h from sweep 1, or recomputed from the
// inputs).
template <typename T, class F, bool Pair>
FFN_HD void row_sweep2(const QuantProblem& p, const F& f, int64_t row, int tid, int threads,
                       const float (&h)[kRowChunks][kLaneElems], float inv) {
  const int64_t chunks = row_chunks(p);
  if (row_held(p, threads)) {
    FFN_UNROLL
    for (int j = 0; j < kRowChunks; ++j) {
      const int64_t c = tid + static_cast<int64_t>(j) * threads;
      if (c < chunks) lane_quant(p, row, c * kLaneElems, h[j], inv, chunk_len(p, c));
    }
  } else {
    for (int64_t c = tid; c < chunks; c += threads) {
      float t[kLaneElems];
      const int n = chunk_len(p, c);
      lane_h<T, F, Pair>(p, f, row, c * kLaneElems, t, n);
      lane_quant(p, row, c * kLaneElems, t, inv, n);
    }
  }
}

// The block's amax from its warps' amaxes (warp_max[w]: warp w's xor-shuffle result), folded in warp order; every
// thread runs this same fold, so all hold the same bits (a NaN's payload included).
FFN_HD float fold_warps(const float* warp_max, int warps) {
  float m = 0.0f;
  for (int w = 0; w < warps; ++w) m = amax_step(m, warp_max[w]);
  return m;
}

// The tensor kernel, thread `i` of `step` threads in the grid: its lanes are i, i + step, ... of the rows x chunks
// lanes (a row's chunks consecutive).
template <typename T, class F, bool Pair>
FFN_HD float tensor_amax(const QuantProblem& p, const F& f, int64_t i, int64_t step) {
  const int64_t chunks = row_chunks(p), total = p.rows * chunks;
  float m = 0.0f;
  for (; i < total; i += step) {
    const int64_t row = i / chunks, c = i - row * chunks;
    float h[kLaneElems];
    m = amax_step(m, lane_h<T, F, Pair>(p, f, row, c * kLaneElems, h, chunk_len(p, c)));
  }
  return m;
}
template <typename T, class F, bool Pair>
FFN_HD void tensor_quant(const QuantProblem& p, const F& f, int64_t i, int64_t step, float inv) {
  const int64_t chunks = row_chunks(p), total = p.rows * chunks;
  for (; i < total; i += step) {
    const int64_t row = i / chunks, c = i - row * chunks;
    const int n = chunk_len(p, c);
    float h[kLaneElems];
    lane_h<T, F, Pair>(p, f, row, c * kLaneElems, h, n);
    lane_quant(p, row, c * kLaneElems, h, inv, n);
  }
}
// Thread tid's fold of the amax launch's parts (tid, tid + threads, ...), before the block combines them.
FFN_HD float parts_amax(const QuantProblem& p, int tid, int threads) {
  float m = 0.0f;
  for (int i = tid; i < p.nparts; i += threads) m = amax_step(m, p.parts[i]);
  return m;
}
// The tensor's scale from the block's amax (dynamic) or the static one.
FFN_HD float tensor_scale(const QuantProblem& p, float amax) {
  return p.has_static ? p.static_scale : math::quant_scale(amax, p.fp8_max, p.pow2);
}

// The whole launch on the host, group by group: each lane's phase 1, the amax combined in the shuffle's order
// (xor steps 1, 2, 4, ...: for a max the order does not matter, NaN included), each lane's phase 2.
template <typename T, class F, bool Pair>
void emulate_group(const QuantProblem& p, const F& f) {
  const int64_t chunks = p.cols / kLaneElems;
  for (int64_t row = 0; row < p.rows; ++row) {
    for (int64_t c0 = 0; c0 < chunks; c0 += p.lanes) {
      float h[16][kLaneElems];
      float m = 0.0f;
      for (int l = 0; l < p.lanes; ++l) m = amax_step(m, lane_h<T, F, Pair>(p, f, row, (c0 + l) * kLaneElems, h[l]));
      for (int l = 0; l < p.lanes; ++l) lane_store(p, row, (c0 + l) * kLaneElems, h[l], m, l == 0);
    }
  }
}

// A block's amax as the device combines it (block_amax in cuda/quant_kernels.cuh): each warp's xor shuffle (steps
// 16, 8, 4, 2, 1; lane 0's result is the warp's), then fold_warps.
// The CUDA launcher's steps (cuda/quant_kernels.cuh launch_quant) on the host, with small grids (at most 3 blocks) so
// that the grid-stride loops and the parts' fold run more than once.
template <typename T, class F, bool Pair>
void emulate_row(const QuantProblem& p, const F& f, int64_t grid);
template <typename T, class F, bool Pair>
void emulate_tensor(const QuantProblem& p, const F& f, int64_t grid);
template <typename T, class F, bool Pair>
void emulate(const QuantProblem& p, const F& f) {
  if (p.scaling == QScaling::kGroup) {
    emulate_group<T, F, Pair>(p, f);
  } else if (p.scaling == QScaling::kRow) {
    emulate_row<T, F, Pair>(p, f, p.rows < 3 ? p.rows : 3);
  } else {
    const int64_t lanes = p.rows * row_chunks(p);
    int64_t grid = (lanes + kThreads - 1) / kThreads;
    grid = grid < 1 ? 1 : (grid > 3 ? 3 : grid);
    std::vector<float> parts(static_cast<size_t>(grid));
    QuantProblem q = p;
    if (!p.has_static) {
      q.parts = parts.data();
      q.nparts = static_cast<int>(grid);
      q.phase = QPhase::kAmax;
      emulate_tensor<T, F, Pair>(q, f, grid);
    }
    q.phase = QPhase::kQuantize;
    emulate_tensor<T, F, Pair>(q, f, grid);
  }
}

inline float emulate_block_amax(const float* m, int threads) {
  float warp_max[kThreads / 32];
  for (int w = 0; w < threads / 32; ++w) {
    float v[32];
    for (int l = 0; l < 32; ++l) v[l] = m[w * 32 + l];
    for (int s = 16; s >= 1; s >>= 1) {
      float nv[32];
      for (int l = 0; l < 32; ++l) nv[l] = amax_step(v[l], v[l ^ s]);
      for (int l = 0; l < 32; ++l) v[l] = nv[l];
    }
    warp_max[w] = v[0];
  }
  return fold_warps(warp_max, threads / 32);
}

// The row kernel on the host, block by block (grid blocks over the rows as the device's grid stride), thread by
// thread within each of the block's phases (sweep 1, the block's amax, sweep 2, the scale).
template <typename T, class F, bool Pair>
void emulate_row(const QuantProblem& p, const F& f, int64_t grid) {
  const int threads = row_threads(p.cols);
  std::vector<float> hs(static_cast<size_t>(threads) * kRowChunks * kLaneElems);
  auto h_of = [&](int t) -> float (&)[kRowChunks][kLaneElems] {
    return *reinterpret_cast<float (*)[kRowChunks][kLaneElems]>(&hs[static_cast<size_t>(t) * kRowChunks * kLaneElems]);
  };
  float m[kThreads];
  for (int64_t b = 0; b < grid; ++b) {
    for (int64_t row = b; row < p.rows; row += grid) {
      for (int t = 0; t < threads; ++t) m[t] = row_sweep1<T, F, Pair>(p, f, row, t, threads, h_of(t));
      const float scale = math::quant_scale(emulate_block_amax(m, threads), p.fp8_max, p.pow2);
      for (int t = 0; t < threads; ++t) row_sweep2<T, F, Pair>(p, f, row, t, threads, h_of(t), 1.0f / scale);
      store_scale(p, row * p.scale_row, scale);
    }
  }
}

// The tensor kernel's launch on the host (phase p.phase), block by block, thread by thread.
template <typename T, class F, bool Pair>
void emulate_tensor(const QuantProblem& p, const F& f, int64_t grid) {
  const int64_t step = grid * kThreads;
  float m[kThreads];
  for (int64_t b = 0; b < grid; ++b) {
    if (p.phase == QPhase::kAmax) {
      for (int t = 0; t < kThreads; ++t) m[t] = tensor_amax<T, F, Pair>(p, f, b * kThreads + t, step);
      p.parts[b] = emulate_block_amax(m, kThreads);
    } else {
      float amax = 0.0f;
      if (!p.has_static) {
        for (int t = 0; t < kThreads; ++t) m[t] = parts_amax(p, t, kThreads);
        amax = emulate_block_amax(m, kThreads);
      }
      const float scale = tensor_scale(p, amax);
      for (int t = 0; t < kThreads; ++t) tensor_quant<T, F, Pair>(p, f, b * kThreads + t, step, 1.0f / scale);
      if (b == 0) store_scale(p, 0, scale);
    }
  }
}

}  // namespace quant
}  // namespace ffn_ext
