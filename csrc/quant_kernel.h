// The quantizing CUDA kernels' per-lane code, written once for the device and the host: cuda/quant_kernels.cuh runs
// it as a CUDA kernel, the tests' _emulate_quant (tests/csrc/emulate_quant.cpp) runs the same code on the CPU group
// by group (tests/test_quant.py), so CI checks the indexing, the loads and the element math without a GPU (the warp
// shuffle itself only runs on a GPU).
//
// Work split (scaling="group"): h is rows x cols, cols a multiple of the group size G (32, 64 or 128). A chunk is 8
// consecutive elements of h (one 16-byte load per 16-bit operand, two for float32); a lane holds kGroupChunks = 2
// chunks of one group, so a group is L = G / 16 consecutive lanes (2, 4, 8) of one warp: lane l of the group takes
// chunks l and L + l (each of the lane's loads coalesced across the group). Each lane computes its h in float exactly
// as the unfused kernel does (opmath, then rounded once to the input dtype), takes the max |h| of its 16, the group's
// amax comes from log2(L) __shfl_xor_sync steps (every lane of the group ends with it, so each quantizes with the
// same scale), and the group's first lane writes that scale: the scale stored is the one quantized with. Two chunks
// per lane rather than one: the lane's index, address, scale and store arithmetic (about 110 instructions on sm_90)
// is paid per 16 elements, not per 8. Any row count, any group count per row; offsets are int64. The recipe (fp8
// format, pow2 scales, e8m0 or float32 scales, scale strides for row or column layout) is runtime data in
// QuantProblem: one kernel per (op, input dtype, pair layout).
//
// scaling="row" (one scale per row, rows of any length, cols not necessarily a multiple of 8: a row's last lane may
// hold fewer than 8 elements, loaded one by one): one block per row at a time (grid-stride over rows). Each thread
// takes the row's chunks tid, tid + T, ... (T threads, coalesced); sweep 1 computes its h and folds its amax, the
// block combines the threads' amaxes (block_amax: the warps' xor shuffles, then the warps' results through shared
// memory and xor shuffles again, so every thread holds the same max), and sweep 2
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
// capturable everywhere): two launches of the same kernel. Both take lanes of 16 consecutive elements of a row
// (kTensorChunks chunks; a row's last lane may hold fewer), grid-stride over the rows x lanes. Launch 1 (amax) folds
// each thread's lanes, combines them in the block as above and stores the block's amax in a scratch array of
// `parts` floats (one per block: no atomics and no zero-fill launch). Launch 2 (quantize) has every block fold those parts again (parts <= 8 per SM: a few KiB read from L2
// per block) into the same amax and scale; block 0's thread 0 stores it.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "ffn_math.h"
#include "rows.h"

namespace ffn_ext {
namespace quant {

constexpr int kLaneElems = 8;
constexpr int kThreads = 256;     // threads per block (every kernel); the row kernel may use fewer (row_threads)
constexpr int kRowChunks = 4;     // chunks of 8 elements per thread a row kernel keeps in registers between sweeps
constexpr int kGroupChunks = 2;   // chunks per lane of the group kernel
constexpr int kTensorChunks = 2;  // consecutive chunks per lane of the tensor kernel
constexpr int kMaxLanes = 128 / (kLaneElems * kGroupChunks);  // lanes per group at the largest group size (128)
constexpr int kMaxWarps = kThreads / 32;

enum class QScaling : int { kGroup, kRow, kTensor };
enum class QPhase : int { kQuantize, kAmax };  // the tensor kernel's launch: quantize, or the dynamic amax

struct QuantProblem {
  const void* in[2];     // gate, up; or x (in[0]); or an interleaved pair's first element (in[0])
  int64_t in_stride[2];  // row strides in elements (unit stride along the row)
  uint8_t* q;            // [rows, cols], contiguous
  void* scale;           // float32 or float8_e8m0fnu, [rows, cols / G] with the strides below (elements)
  int64_t scale_row, scale_col;
  int64_t rows, cols;
  int lanes;        // the group kernel's lanes per group: G / (kLaneElems * kGroupChunks)
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

// A thread's lanes in a grid-stride loop over the rows x `chunks` lanes (a row's lanes consecutive): lane i, then
// i + step, ... as (row, chunk), stepped rather than divided out of i: the 64-bit division was about 37 of the group
// kernel's 326 instructions per lane (sm_90, bf16 GeGLU), the stepping is about 20. One division per thread, when it
// starts.
struct LaneCursor {
  int64_t chunks;                  // lanes per row
  int64_t row, chunk;              // the current lane's; row >= rows once past the last lane
  int64_t step_rows, step_chunks;  // step = step_rows * chunks + step_chunks
  FFN_HD LaneCursor(int64_t i, int64_t step, int64_t chunks_) : chunks(chunks_) {
    row = i / chunks;
    chunk = i - row * chunks;
    step_rows = step / chunks;
    step_chunks = step - step_rows * chunks;
  }
  FFN_HD void next() {
    row += step_rows;
    chunk += step_chunks;
    if (chunk >= chunks) chunk -= chunks, ++row;
  }
};

// log2 of a group's lanes (a power of two): a lane's group index is its index in the row >> lane_shift.
FFN_HD int lane_shift(int lanes) {
  int s = 0;
  while ((1 << s) < lanes) ++s;
  return s;
}

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
// instructions (FSETP.NAN, FSETP.GT.OR, FSEL) per element, a tenth of the row kernel's
// (docs/performance.md#kernel-instruction-counts).
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
  using A = math::opmath_t<T>;
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

// The group kernel's lane `lane` of row `row` (lane in 0 .. cols / 16): its first chunk, lane + g * L for its group
// g = lane >> shift (shift = lane_shift(p.lanes)); its second is L further.
FFN_HD int64_t group_chunk(int64_t lane, int shift) { return lane + ((lane >> shift) << shift); }

// Phase 1 of a group kernel's lane: h of its two chunks (whole lanes: cols is a multiple of 32), their max |h|.
template <typename T, class F, bool Pair>
FFN_HD float group_lane_h(const QuantProblem& p, const F& f, int64_t row, int64_t lane, int shift,
                          float (&h)[kGroupChunks][kLaneElems]) {
  const int64_t c = group_chunk(lane, shift);
  const float m = lane_h<T, F, Pair>(p, f, row, c * kLaneElems, h[0]);
  return amax_step(m, lane_h<T, F, Pair>(p, f, row, (c + p.lanes) * kLaneElems, h[1]));
}

// Phase 2 of a group kernel's lane: quantize its chunks with the group's scale (from the group's amax), each into
// one 8-byte store; the group's first lane (writer) stores the scale. Every warp holds writers, so the warp issues
// the writer's instructions each time: the group index is a shift, not a 64-bit division.
FFN_HD void group_lane_store(const QuantProblem& p, int64_t row, int64_t lane, int shift,
                             const float (&h)[kGroupChunks][kLaneElems], float amax, bool writer) {
  const float scale = math::quant_scale(amax, p.fp8_max, p.pow2);
  const float inv = 1.0f / scale;
  const int64_t c = group_chunk(lane, shift);
  lane_quant(p, row, c * kLaneElems, h[0], inv);
  lane_quant(p, row, (c + p.lanes) * kLaneElems, h[1], inv);
  if (writer) store_scale(p, row * p.scale_row + (lane >> shift) * p.scale_col, scale);
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
// A row's elements from column col on, at most `width`: a chunk's (chunk_len), a tensor kernel's lane's.
FFN_HD int span_len(const QuantProblem& p, int64_t col, int width) {
  const int64_t left = p.cols - col;
  return left < width ? static_cast<int>(left) : width;
}
FFN_HD int chunk_len(const QuantProblem& p, int64_t c) { return span_len(p, c * kLaneElems, kLaneElems); }
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

// The tensor kernel's lanes: kTensorChunks consecutive chunks of a row, 16 elements (a row's last lane may hold
// fewer: its length n), so that a lane's index, address and length arithmetic (about 45 instructions on sm_90) is
// paid per 16 elements, not per 8. Thread `i` of `step` threads in the grid takes lanes i, i + step, ... of the
// rows x tensor_lanes_per_row lanes (a row's lanes consecutive).
FFN_HD int64_t tensor_lanes_per_row(const QuantProblem& p) {
  return (p.cols + kLaneElems * kTensorChunks - 1) / (kLaneElems * kTensorChunks);
}
// Phase 1 of a tensor kernel's lane (column col, n elements): h of its chunks and their max |h|; 16-byte loads for
// a whole lane of aligned operands, else element by element.
template <typename T, class F, bool Pair>
FFN_HD float tensor_lane_h(const QuantProblem& p, const F& f, int64_t row, int64_t col, int n,
                           float (&h)[kTensorChunks][kLaneElems]) {
  if (p.vectorized && n == kLaneElems * kTensorChunks) {
    const float m = lane_h_as<T, F, Pair, true>(p, f, row, col, h[0], kLaneElems);
    return amax_step(m, lane_h_as<T, F, Pair, true>(p, f, row, col + kLaneElems, h[1], kLaneElems));
  }
  float m = lane_h_as<T, F, Pair, false>(p, f, row, col, h[0], n < kLaneElems ? n : kLaneElems);
  if (n > kLaneElems) m = amax_step(m, lane_h_as<T, F, Pair, false>(p, f, row, col + kLaneElems, h[1], n - kLaneElems));
  return m;
}
template <typename T, class F, bool Pair>
FFN_HD float tensor_amax(const QuantProblem& p, const F& f, int64_t i, int64_t step) {
  float m = 0.0f;
  if (p.cols == 0) return m;
  for (LaneCursor l(i, step, tensor_lanes_per_row(p)); l.row < p.rows; l.next()) {
    const int64_t col = l.chunk * kLaneElems * kTensorChunks;
    float h[kTensorChunks][kLaneElems];
    m = amax_step(m, tensor_lane_h<T, F, Pair>(p, f, l.row, col, span_len(p, col, kLaneElems * kTensorChunks), h));
  }
  return m;
}
template <typename T, class F, bool Pair>
FFN_HD void tensor_quant(const QuantProblem& p, const F& f, int64_t i, int64_t step, float inv) {
  if (p.cols == 0) return;
  for (LaneCursor l(i, step, tensor_lanes_per_row(p)); l.row < p.rows; l.next()) {
    const int64_t col = l.chunk * kLaneElems * kTensorChunks;
    const int n = span_len(p, col, kLaneElems * kTensorChunks);
    float h[kTensorChunks][kLaneElems];
    tensor_lane_h<T, F, Pair>(p, f, l.row, col, n, h);
    lane_quant(p, l.row, col, h[0], inv, n < kLaneElems ? n : kLaneElems);
    if (n > kLaneElems) lane_quant(p, l.row, col + kLaneElems, h[1], inv, n - kLaneElems);
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

// A warp shuffle's xor-max over groups of `lanes` consecutive values of v[0..n) (xor steps 1, 2, ... lanes / 2; the
// device takes them in that order in the group kernel and in reverse in block_amax: for a max the order does not
// matter, a NaN's payload aside, which the tests do not compare).
inline void emulate_xor_max(float* v, int n, int lanes) {
  std::vector<float> nv(static_cast<size_t>(n));
  for (int s = 1; s < lanes; s <<= 1) {
    for (int l = 0; l < n; ++l) nv[l] = amax_step(v[l], v[l ^ s]);
    for (int l = 0; l < n; ++l) v[l] = nv[l];
  }
}

// The group kernel's lanes per row, and its launch on the host (quant_kernel in cuda/quant_kernels.cuh), block by
// block over `grid` blocks and, within each grid-stride iteration, thread by thread: each thread's phase 1 at its
// cursor, the group amax's xor steps across the block's threads as the warp shuffle takes them (steps 1, 2, 4
// below the group's lanes; t ^ w stays in t's warp), each thread's phase 2.
FFN_HD int64_t group_lanes_per_row(const QuantProblem& p) { return p.cols / (kLaneElems * kGroupChunks); }
template <typename T, class F, bool Pair>
void emulate_group(const QuantProblem& p, const F& f, int64_t grid) {
  const int64_t per_row = group_lanes_per_row(p), total = p.rows * per_row, step = grid * kThreads;
  const int shift = lane_shift(p.lanes);
  if (per_row == 0) return;
  std::vector<LaneCursor> cur;
  std::vector<float> hs(static_cast<size_t>(kThreads) * kGroupChunks * kLaneElems);
  auto h_of = [&](int t) -> float (&)[kGroupChunks][kLaneElems] {
    return *reinterpret_cast<float (*)[kGroupChunks][kLaneElems]>(
        &hs[static_cast<size_t>(t) * kGroupChunks * kLaneElems]);
  };
  float m[kThreads];
  for (int64_t b = 0; b < grid; ++b) {
    cur.clear();
    for (int t = 0; t < kThreads; ++t) cur.emplace_back(b * kThreads + t, step, per_row);
    for (int64_t base = b * kThreads; base < total; base += step) {
      for (int t = 0; t < kThreads; ++t) {
        m[t] = cur[t].row < p.rows ? group_lane_h<T, F, Pair>(p, f, cur[t].row, cur[t].chunk, shift, h_of(t)) : 0.0f;
      }
      emulate_xor_max(m, kThreads, p.lanes);
      for (int t = 0; t < kThreads; ++t) {
        const bool writer = (t & (p.lanes - 1)) == 0;
        if (cur[t].row < p.rows) group_lane_store(p, cur[t].row, cur[t].chunk, shift, h_of(t), m[t], writer);
        cur[t].next();
      }
    }
  }
}

// The CUDA launcher's steps (cuda/quant_kernels.cuh launch_quant) on the host, with small grids (at most 3 blocks) so
// that the grid-stride loops and the parts' fold run more than once.
template <typename T, class F, bool Pair>
void emulate_row(const QuantProblem& p, const F& f, int64_t grid);
template <typename T, class F, bool Pair>
void emulate_tensor(const QuantProblem& p, const F& f, int64_t grid);
inline int64_t emulated_grid(int64_t lanes) {  // kThreads per block, 1 to 3 blocks
  const int64_t grid = (lanes + kThreads - 1) / kThreads;
  return grid < 1 ? 1 : (grid > 3 ? 3 : grid);
}
template <typename T, class F, bool Pair>
void emulate(const QuantProblem& p, const F& f) {
  if (p.scaling == QScaling::kGroup) {
    emulate_group<T, F, Pair>(p, f, emulated_grid(p.rows * group_lanes_per_row(p)));
  } else if (p.scaling == QScaling::kRow) {
    emulate_row<T, F, Pair>(p, f, p.rows < 3 ? p.rows : 3);
  } else {
    const int64_t grid = emulated_grid(p.rows * tensor_lanes_per_row(p));
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

// A block's amax as the device combines it (block_amax in cuda/quant_kernels.cuh): each warp's xor shuffle (steps
// 16, 8, 4, 2, 1), then in every warp lane l takes warp (l % kMaxWarps)'s result (0 past the block's warps) and
// xor-shuffles over kMaxWarps lanes; lane 0's result is returned (every lane's is the same max).
inline float emulate_block_amax(const float* m, int threads) {
  float warp_max[kMaxWarps] = {};
  for (int w = 0; w < threads / 32; ++w) {
    float v[32];
    for (int l = 0; l < 32; ++l) v[l] = m[w * 32 + l];
    emulate_xor_max(v, 32, 32);
    warp_max[w] = v[0];
  }
  emulate_xor_max(warp_max, kMaxWarps, kMaxWarps);
  return warp_max[0];
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
