// The quantizing CUDA kernels' per-lane code, written once for the device and the host: cuda/quant.cu runs it as a
// CUDA kernel, test_paths.cpp's _emulate_quant runs the same code on the CPU group by group (tests/test_quant.py),
// so CI checks the indexing, the loads and the element math without a GPU (the warp shuffle itself only runs on
// a GPU).
//
// Work split (scaling="group"): h is rows x cols, cols a multiple of the group size G (32, 64 or 128). A lane
// computes 8 consecutive elements of h (one 16-byte load per 16-bit operand, two for float32), so a group is
// L = G / 8 consecutive lanes (4, 8, 16) of one warp. Each lane computes its h in float exactly as the unfused
// kernel does (opmath, then rounded once to the input dtype), takes the max |h| of its 8, the group's amax comes
// from log2(L) __shfl_xor_sync steps (every lane of the group ends with it, so each quantizes with the same scale),
// and the group's first lane writes that scale: the scale stored is the one quantized with. Any row count, any
// group count per row; offsets are int64. The recipe (fp8 format, pow2 scales, e8m0 or float32 scales, scale
// strides for row or column layout) is runtime data in QuantProblem: one kernel per (op, input dtype, pair layout).
#pragma once

#include <ATen/OpMathType.h>

#include <cstdint>
#include <cstring>

#include "ffn_math.h"
#include "rows.h"

namespace ffn_ext {
namespace quant {

constexpr int kLaneElems = 8;

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

// max(m, x) that keeps a NaN from either side (fmaxf would drop it): the amax of a group with a NaN is NaN.
FFN_HD float amax_step(float m, float x) { return (x > m || x != x) ? x : m; }

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

// Phase 1 of a lane: its 8 elements of h (row, columns col..col+7), rounded to T and held in float; returns their
// max |h| (NaN if one is NaN).
template <typename T, class F, bool Pair>
FFN_HD float lane_h(const QuantProblem& p, const F& f, int64_t row, int64_t col, float (&h)[kLaneElems]) {
  constexpr bool kFast = math::fast_math_for<T>();
  using A = at::opmath_type<T>;
  A a[2][kLaneElems] = {};  // the identity reads one operand
  if constexpr (Pair) {     // [g0, u0, g1, u1, ...]: 16 elements hold the lane's 8 pairs
    rows::Pack<T, 2 * kLaneElems> raw;
    load_elems(raw, static_cast<const T*>(p.in[0]) + row * p.in_stride[0] + 2 * col, p.vectorized);
    A w[2 * kLaneElems];
    rows::widen(raw, w);
    FFN_UNROLL
    for (int k = 0; k < kLaneElems; ++k) a[0][k] = w[2 * k], a[1][k] = w[2 * k + 1];
  } else {
    FFN_UNROLL
    for (int i = 0; i < F::NI; ++i) {
      rows::Pack<T, kLaneElems> raw;
      load_elems(raw, static_cast<const T*>(p.in[i]) + row * p.in_stride[i] + col, p.vectorized);
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
    m = amax_step(m, ::fabsf(h[k]));
  }
  return m;
}

// Phase 2 of a lane: quantize its 8 elements with the group's scale (from the group's amax) into one 8-byte store;
// the group's first lane (writer) stores the scale.
FFN_HD void lane_store(const QuantProblem& p, int64_t row, int64_t col, const float (&h)[kLaneElems], float amax,
                       bool writer) {
  const float scale = math::quant_scale(amax, p.fp8_max, p.pow2);
  const float inv = 1.0f / scale;
  uint8_t b[kLaneElems];
  FFN_UNROLL
  for (int k = 0; k < kLaneElems; ++k) b[k] = math::quant_element(h[k], inv, p.fp8_max);
  uint8_t* dst = p.q + row * p.cols + col;  // 8-byte aligned: cols is a multiple of 32
#if defined(__CUDA_ARCH__)
  uint2 bits;
  memcpy(&bits, b, sizeof(bits));
  *reinterpret_cast<uint2*>(dst) = bits;
#else
  memcpy(dst, b, sizeof(b));
#endif
  if (writer) {
    const int64_t at = row * p.scale_row + (col / (kLaneElems * p.lanes)) * p.scale_col;
    if (p.e8m0) {
      static_cast<uint8_t*>(p.scale)[at] = math::to_e8m0(scale);
    } else {
      static_cast<float*>(p.scale)[at] = scale;
    }
  }
}

// The whole launch on the host, group by group: each lane's phase 1, the amax combined in the shuffle's order
// (xor steps 1, 2, 4, ...: for a max the order does not matter, NaN included), each lane's phase 2.
template <typename T, class F, bool Pair>
void emulate(const QuantProblem& p, const F& f) {
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

}  // namespace quant
}  // namespace ffn_ext
