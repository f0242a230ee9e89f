// ffn_math.h's FP8 conversion, software path against cuda_fp8.h's host emulation of the hardware instruction that
// the sm_89+ build runs (cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32, through __nv_cvt_float2_to_fp8x2 with
// __NV_SATFINITE), bit for bit. Built and run by tests/test_fp8_cvt.py with the host compiler (no GPU, no nvcc):
//   c++ -std=c++17 -O2 -I csrc -I <torch include> -I $CUDA_HOME/include tests/fp8_cvt_check.cpp
// Checks, for both formats:
//   1. element by element: quant_element(x, 1, fp8_max) (clamp, then to_fp8) == __nv_cvt_float_to_fp8(x, SATFINITE)
//      on the unclamped x, over the float32 neighbourhood (+-64 ulps) of every fp8 value and of every midpoint of
//      two consecutive ones, the saturation edge and far past it, +-inf, NaNs of both signs, float32 subnormals,
//      and every 4093rd float32 bit pattern;
//   2. whole chunks: quant_chunk_soft == quant_chunk_pairs with the emulated instruction as cvt2 (the device code's
//      structure: pairs, no clamp, packing), for chunks of those values with several scales' reciprocals.
// Prints "ok <values checked>" and exits 0, or prints the first mismatches and exits 1.
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "ffn_math.h"

namespace m = ffn_ext::math;

namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// The value of fp8 code c (finite codes only are asked for): e4m3fn (M = 3, bias 7) or e5m2 (M = 2, bias 15).
double fp8_value(unsigned c, int mant, int bias) {
  const int e = static_cast<int>((c & 0x7Fu) >> mant);
  const unsigned f = c & ((1u << mant) - 1);
  const double mag = e == 0 ? std::ldexp(f, 1 - bias - mant) : std::ldexp((1u << mant) + f, e - bias - mant);
  return (c & 0x80u) ? -mag : mag;
}

std::vector<float> values(int mant, int bias, float fp8_max) {
  std::vector<double> base;
  const unsigned top = mant == 3 ? 0x7Eu : 0x7Bu;  // the largest finite code of each format
  for (unsigned c = 0; c <= top; ++c) {
    base.push_back(fp8_value(c, mant, bias));
    if (c < top) base.push_back((fp8_value(c, mant, bias) + fp8_value(c + 1, mant, bias)) / 2);  // exact in float
  }
  for (double s : {1.0625, 1.125, 1.5, 2.0, 1e10}) base.push_back(fp8_max * s);
  std::vector<float> out;
  for (double b : base) {
    const int64_t u = to_bits(static_cast<float>(b));
    for (int64_t d = -64; d <= 64; ++d) {
      if (u + d >= 0 && u + d <= 0x7F800000) out.push_back(from_bits(static_cast<uint32_t>(u + d)));
    }
  }
  for (uint32_t u = 1; u < 0x800000u; u = u * 3 + 1) out.push_back(from_bits(u));  // float32 subnormals
  for (uint64_t u = 0; u < 0x100000000ull; u += 4093) out.push_back(from_bits(static_cast<uint32_t>(u)));
  const float specials[] = {0.0f,
                            std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::denorm_min(),
                            from_bits(0x7FC00000u),
                            from_bits(0x7F800001u),
                            from_bits(0x7FFFFFFFu)};
  for (float v : specials) out.push_back(v);
  const size_t n = out.size();
  for (size_t i = 0; i < n; ++i) out.push_back(from_bits(to_bits(out[i]) | 0x80000000u));  // both signs, NaN too
  return out;
}

int check(const char* name, float fp8_max, __nv_fp8_interpretation_t fmt, int mant, int bias, long& checked) {
  const std::vector<float> xs = values(mant, bias, fp8_max);
  int bad = 0;
  for (float x : xs) {
    const unsigned soft = m::quant_element(x, 1.0f, fp8_max);
    const unsigned hw = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, fmt);
    if (soft != hw && bad++ < 10) {
      std::printf("%s: x = %a (0x%08x): software 0x%02x, cvt.rn.satfinite 0x%02x\n", name, x, to_bits(x), soft, hw);
    }
  }
  // chunks of 8 consecutive values, each with a few reciprocals of scales (1, a pow2, an arbitrary one)
  auto cvt2 = [fmt](float lo, float hi) -> uint32_t {
    return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, fmt);
  };
  for (float inv : {1.0f, 0.0078125f, 1.0f / 3.1f, 7.75f}) {
    for (size_t i = 0; i + m::kChunk <= xs.size(); i += m::kChunk) {
      float h[m::kChunk];
      for (int k = 0; k < m::kChunk; ++k) h[k] = xs[i + k];
      uint32_t soft[2], pairs[2];
      m::quant_chunk_soft(h, inv, fp8_max, soft);
      m::quant_chunk_pairs(h, inv, pairs, cvt2);
      if ((soft[0] != pairs[0] || soft[1] != pairs[1]) && bad++ < 10) {
        std::printf("%s chunk at %zu, inv %a: software %08x %08x, pairs %08x %08x\n", name, i, inv, soft[0], soft[1],
                    pairs[0], pairs[1]);
      }
    }
  }
  checked += static_cast<long>(xs.size());
  return bad;
}

}  // namespace

int main() {
  long checked = 0;
  int bad = check("e4m3fn", 448.0f, __NV_E4M3, 3, 7, checked);
  bad += check("e5m2", 57344.0f, __NV_E5M2, 2, 15, checked);
  if (bad) {
    std::printf("FAILED: %d mismatches\n", bad);
    return 1;
  }
  std::printf("ok %ld\n", checked);
  return 0;
}
