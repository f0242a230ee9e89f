// The FP8 activation cache's CUDA kernels' per-lane code (saved_dtype=torch.float8_e4m3fn, ffn_ext/mlp.py), written
// once for the device and the host as quant_kernel.h is: cuda/quant_kernels.cuh runs it as CUDA kernels, the tests'
// _emulate_cache (tests/csrc/emulate_quant.cpp) runs the same code on the CPU, block by block and thread by thread.
//
// <gated>_cache(gate, up, group_size) -> (h, q, scale), one pass over gate and up: h = gate(gate, up) in their dtype
// (the unfused op's value), and gate and up quantized to float8_e4m3fn with a float32 scale per group of G (128, 64,
// 32) elements of a row, by ffn_ext.quant's formula (ffn_ext.quantize of [gate | up] with that group size): q is
// [rows, 2M], gate's values then up's, scale [rows, 2M / G] likewise. The work split is the group kernel's: a lane
// holds kGroupChunks chunks of 8 elements of one group, of gate and of up; a group is G / 16 lanes of one warp, whose
// two amaxes (gate's and up's) come from xor shuffles.
//
// <gated>_cached_backward(grad, q, scale) -> (dgate, dup, h): gate and up read back from the cache inside the kernel
// (value = fp8 * scale in float32, rounded to grad's dtype: what ffn_ext.mlp's Kept reads), then the gated op's
// backward and its forward from them, one pass: d_gate and d_up for the input projections' gradients and h for the
// down projection's weight gradient, which the unfused backward recomputes in a pass of its own. A lane is one chunk
// of 8 elements (one scale each for gate and up: G is a multiple of 8), lanes in a grid-stride loop.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_kernel.h"

namespace ffn_ext {
namespace quant {

struct CacheProblem {
  const void* gate;  // _cache: inputs [rows, cols], unit stride along the row
  const void* up;
  int64_t gate_stride, up_stride;
  const void* grad;  // _cached_backward: [rows, cols]
  int64_t grad_stride;
  void* h;  // [rows, cols], contiguous (both ops)
  void* dgate;
  void* dup;
  uint8_t* q;    // [rows, 2 cols], contiguous: gate's values, then up's
  float* scale;  // [rows, 2 cols / group], contiguous
  int64_t rows, cols;
  int group;        // 128, 64 or 32
  int lanes;        // _cache: lanes per group, group / (kLaneElems * kGroupChunks)
  bool vectorized;  // _cache: gate's and up's rows start 16-byte aligned; _cached_backward: grad's
};

constexpr float kE4m3Max = 448.0f;

// A float8_e4m3fn byte as float, exactly: a normal's exponent and mantissa placed in a float's and rebiased (7 ->
// 127), a subnormal's m * 2^-9 (no float subnormal involved, so a flush-to-zero build reads them too); 0x7F / 0xFF
// are NaN (e4m3fn has no inf).
FFN_HD float from_e4m3fn(uint32_t b) {
  const uint32_t mag = b & 0x7Fu;
  const float v = (mag >> 3) == 0 ? static_cast<float>(mag) * 0.001953125f  // 2^-9
                                  : math::bits_f32((mag << 20) + (120u << 23));
  const float s = (b & 0x80u) ? -v : v;
  return mag == 0x7Fu ? math::bits_f32(0x7FC00000u) : s;
}

// N elements to dst: 16-byte stores when vectorized (dst 16-byte aligned), else one by one.
template <typename T, int N>
FFN_HD void store_elems(T* dst, const rows::Pack<T, N>& src, bool vectorized) {
  constexpr int kVec = 16 / sizeof(T);
  if (vectorized) {
    FFN_UNROLL
    for (int j = 0; j < N / kVec; ++j) {
      rows::Pack<T, kVec> part;
      memcpy(&part, &src.v[j * kVec], sizeof(part));
      rows::store_pack(dst + j * kVec, part, true);
    }
  } else {
    FFN_UNROLL
    for (int k = 0; k < N; ++k) dst[k] = src.v[k];
  }
}

// A chunk of results in opmath, rounded to T and stored at dst (a contiguous output: 16-byte aligned chunks).
template <typename T, typename A>
FFN_HD void store_chunk(T* dst, const A (&r)[kLaneElems]) {
  rows::Pack<T, kLaneElems> out;
  rows::narrow(r, out);
  store_elems(dst, out, true);
}

// 8 fp8 values (w: bytes in element order) quantized by lane_quant's store.
FFN_HD void store_q(uint8_t* dst, const uint32_t (&w)[2]) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
#else
  memcpy(dst, w, sizeof(w));
#endif
}

// ---------------------------------------------------------------- <gated>_cache
// Phase 1 of a lane's chunk at (row, col): gate and up loaded (as floats: their values, exact), h computed and
// stored; returns their max |.| in mg, mu.
template <typename T, class Gate>
FFN_HD void cache_chunk_h(const CacheProblem& p, const Gate& gate, int64_t row, int64_t col, float (&g)[kLaneElems],
                          float (&u)[kLaneElems], float& mg, float& mu) {
  constexpr bool kFast = math::fast_math_for<T>();
  using A = math::opmath_t<T>;
  rows::Pack<T, kLaneElems> rg, ru;
  load_elems(rg, static_cast<const T*>(p.gate) + row * p.gate_stride + col, p.vectorized);
  load_elems(ru, static_cast<const T*>(p.up) + row * p.up_stride + col, p.vectorized);
  A a[kLaneElems], b[kLaneElems], r[kLaneElems];
  rows::widen(rg, a);
  rows::widen(ru, b);
  FFN_UNROLL
  for (int k = 0; k < kLaneElems; ++k) {
    r[k] = gate.template fwd<kFast>(a[k], b[k]);
    g[k] = static_cast<float>(a[k]);
    u[k] = static_cast<float>(b[k]);
    mg = amax_step(mg, ::fabsf(g[k]));
    mu = amax_step(mu, ::fabsf(u[k]));
  }
  store_chunk(static_cast<T*>(p.h) + row * p.cols + col, r);
}

// Phase 1 of a group lane (lane in 0 .. cols / 16 of its row; its chunks group_chunk(lane) and L further): h of both
// chunks stored, gate and up kept for phase 2, their max |.|.
template <typename T, class Gate>
FFN_HD void cache_lane_h(const CacheProblem& p, const Gate& gate, int64_t row, int64_t lane, int shift,
                         float (&g)[kGroupChunks][kLaneElems], float (&u)[kGroupChunks][kLaneElems], float& mg,
                         float& mu) {
  const int64_t c = group_chunk(lane, shift);
  mg = mu = 0.0f;
  FFN_UNROLL
  for (int j = 0; j < kGroupChunks; ++j) {
    cache_chunk_h<T>(p, gate, row, (c + j * p.lanes) * kLaneElems, g[j], u[j], mg, mu);
  }
}

// Phase 2: gate and up quantized with their group's scales (from the group's amaxes), 8-byte stores; the group's
// first lane (writer) stores both scales.
FFN_HD void cache_lane_store(const CacheProblem& p, int64_t row, int64_t lane, int shift,
                             const float (&g)[kGroupChunks][kLaneElems], const float (&u)[kGroupChunks][kLaneElems],
                             float mg, float mu, bool writer) {
  const float sg = math::quant_scale(mg, kE4m3Max, false), su = math::quant_scale(mu, kE4m3Max, false);
  const float ig = 1.0f / sg, iu = 1.0f / su;
  const int64_t c = group_chunk(lane, shift);
  uint8_t* qrow = p.q + row * 2 * p.cols;
  FFN_UNROLL
  for (int j = 0; j < kGroupChunks; ++j) {
    const int64_t col = (c + j * p.lanes) * kLaneElems;
    uint32_t w[2];
    math::quant_chunk(g[j], ig, kE4m3Max, w);
    store_q(qrow + col, w);
    math::quant_chunk(u[j], iu, kE4m3Max, w);
    store_q(qrow + p.cols + col, w);
  }
  if (writer) {
    const int64_t groups = p.cols / p.group;
    float* srow = p.scale + row * 2 * groups;
    srow[lane >> shift] = sg;
    srow[groups + (lane >> shift)] = su;
  }
}

FFN_HD int64_t cache_lanes_per_row(const CacheProblem& p) { return p.cols / (kLaneElems * kGroupChunks); }

// ---------------------------------------------------------------- <gated>_cached_backward
// 8 values of one half of the cache at (row, col) as T, widened: fp8 * scale in float32, rounded to T.
template <typename T, typename A>
FFN_HD void cached_chunk(const CacheProblem& p, int64_t row, int64_t col, int64_t half, A (&v)[kLaneElems]) {
  const int64_t groups = p.cols / p.group;
  const float s = p.scale[row * 2 * groups + half * groups + col / p.group];
  const uint8_t* src = p.q + row * 2 * p.cols + half * p.cols + col;
  uint32_t w[2];
#if defined(__CUDA_ARCH__)
  const uint2 bits = *reinterpret_cast<const uint2*>(src);
  w[0] = bits.x, w[1] = bits.y;
#else
  memcpy(w, src, sizeof(w));
#endif
  A f[kLaneElems];
  FFN_UNROLL
  for (int k = 0; k < kLaneElems; ++k) f[k] = static_cast<A>(from_e4m3fn((w[k / 4] >> (8 * (k % 4))) & 0xFFu) * s);
  rows::Pack<T, kLaneElems> t;  // the value Kept reads: rounded to T
  rows::narrow(f, t);
  rows::widen(t, v);
}

// Lane (row, chunk): grad's 8 elements and the cache's, then dgate, dup and h stored.
template <typename T, class Gate>
FFN_HD void cached_backward_lane(const CacheProblem& p, const Gate& gate, int64_t row, int64_t chunk) {
  constexpr bool kFast = math::fast_math_for<T>();
  using A = math::opmath_t<T>;
  const int64_t col = chunk * kLaneElems;
  rows::Pack<T, kLaneElems> rd;
  load_elems(rd, static_cast<const T*>(p.grad) + row * p.grad_stride + col, p.vectorized);
  A d[kLaneElems], g[kLaneElems], u[kLaneElems];
  rows::widen(rd, d);
  cached_chunk<T>(p, row, col, 0, g);
  cached_chunk<T>(p, row, col, 1, u);
  A dg[kLaneElems], du[kLaneElems], h[kLaneElems];
  FFN_UNROLL
  for (int k = 0; k < kLaneElems; ++k) {
    gate.template bwd<kFast>(d[k], g[k], u[k], dg[k], du[k]);
    h[k] = gate.template fwd<kFast>(g[k], u[k]);
  }
  const int64_t at = row * p.cols + col;
  store_chunk(static_cast<T*>(p.dgate) + at, dg);
  store_chunk(static_cast<T*>(p.dup) + at, du);
  store_chunk(static_cast<T*>(p.h) + at, h);
}

FFN_HD int64_t cached_lanes_per_row(const CacheProblem& p) { return p.cols / kLaneElems; }

// The grid both kernels launch: kThreads per block, at most 8 blocks per multiprocessor (grid-stride loops).
inline int64_t cache_blocks(int64_t lanes, int64_t max_blocks) {
  const int64_t b = (lanes + kThreads - 1) / kThreads;
  return b < 1 ? 1 : (b > max_blocks ? max_blocks : b);
}

// ---------------------------------------------------------------- the launches on the host
// The _cache kernel (cache_kernel in cuda/quant_kernels.cuh) block by block over `grid` blocks, each grid-stride
// iteration thread by thread: phase 1, both amaxes' xor steps as the warp shuffles take them, phase 2.
template <typename T, class Gate>
void emulate_cache(const CacheProblem& p, const Gate& gate, int64_t grid) {
  const int64_t per_row = cache_lanes_per_row(p), total = p.rows * per_row, step = grid * kThreads;
  const int shift = lane_shift(p.lanes);
  if (per_row == 0) return;
  constexpr int kHeld = kGroupChunks * kLaneElems;
  std::vector<float> gs(static_cast<size_t>(kThreads) * kHeld), us(gs.size());
  auto held = [](std::vector<float>& v, int t) -> float (&)[kGroupChunks][kLaneElems] {
    return *reinterpret_cast<float (*)[kGroupChunks][kLaneElems]>(&v[static_cast<size_t>(t) * kHeld]);
  };
  float mg[kThreads], mu[kThreads];
  std::vector<LaneCursor> cur;
  for (int64_t b = 0; b < grid; ++b) {
    cur.clear();
    for (int t = 0; t < kThreads; ++t) cur.emplace_back(b * kThreads + t, step, per_row);
    for (int64_t base = b * kThreads; base < total; base += step) {
      for (int t = 0; t < kThreads; ++t) {
        mg[t] = mu[t] = 0.0f;
        if (cur[t].row < p.rows)
          cache_lane_h<T>(p, gate, cur[t].row, cur[t].chunk, shift, held(gs, t), held(us, t), mg[t], mu[t]);
      }
      emulate_xor_max(mg, kThreads, p.lanes);
      emulate_xor_max(mu, kThreads, p.lanes);
      for (int t = 0; t < kThreads; ++t) {
        const bool writer = (t & (p.lanes - 1)) == 0;
        if (cur[t].row < p.rows)
          cache_lane_store(p, cur[t].row, cur[t].chunk, shift, held(gs, t), held(us, t), mg[t], mu[t], writer);
        cur[t].next();
      }
    }
  }
}

// The _cached_backward kernel on the host: every thread's grid-stride loop over the lanes.
template <typename T, class Gate>
void emulate_cached_backward(const CacheProblem& p, const Gate& gate, int64_t grid) {
  const int64_t per_row = cached_lanes_per_row(p), step = grid * kThreads;
  if (per_row == 0) return;
  for (int64_t i = 0; i < step; ++i) {
    for (LaneCursor l(i, step, per_row); l.row < p.rows; l.next()) cached_backward_lane<T>(p, gate, l.row, l.chunk);
  }
}

}  // namespace quant
}  // namespace ffn_ext
