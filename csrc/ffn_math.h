// Element math of every ffn_ext op, shared by the CUDA kernels (csrc/cuda/) and the host test path
// (ffn_ext._C._host_math, checked against an fp64 reference on CPU in CI).
//
// Each functor maps NI input values to NO output values in the accumulation type A (float for
// float/half/bfloat16, double for double): f.template apply<Fast>(in, out). Callers convert storage -> A once at
// the load and A -> storage once at the store, so every op rounds exactly once. Fast is true for 16-bit storage
// (half, bfloat16): there the device takes the hardware's approximate reciprocal (MUFU.RCP, within about 1 ulp of
// float) instead of an IEEE division, whose dozen instructions and slow-path branch made bf16 SiLU and SwiGLU
// issue-bound on an H200; an error of 2**-23 is far below the 2**-9 / 2**-12 of the rounding to bf16 / fp16 that
// follows. The host (the test path) always divides exactly; the CUDA tests check the device's results.
//
// Infinities: the functors return the mathematical limits, which ATen does not always do:
//   silu(-inf) = -0, gelu(-inf) = -0, gelu(+inf) = silu(+inf) = +inf,
//   silu'(-inf) = gelu'(-inf) = 0, silu'(+inf) = gelu'(+inf) = 1.   NaN in -> NaN out.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define FFN_HD __host__ __device__ __forceinline__
#else
#define FFN_HD inline
#endif

namespace ffn_ext {
namespace math {

// Float overloads stay in float (erff/expf), double overloads in double.
FFN_HD float erf_(float x) { return ::erff(x); }
FFN_HD double erf_(double x) { return ::erf(x); }
FFN_HD float exp_(float x) { return ::expf(x); }
FFN_HD double exp_(double x) { return ::exp(x); }
FFN_HD bool isinf_(float x) { return ::isinf(x); }
FFN_HD bool isinf_(double x) { return ::isinf(x); }
// 1 / d for d >= 1 (the sigmoid's denominator). Fast on the device: MUFU.RCP (d > 2**126 gives 0, as 1 / inf does).
template <bool Fast> FFN_HD float rcp_(float d) {
#if defined(__CUDA_ARCH__)
  if (Fast) return __fdividef(1.0f, d);
#endif
  return 1.0f / d;
}
template <bool Fast> FFN_HD double rcp_(double d) { return 1.0 / d; }

template <bool Fast, typename A> FFN_HD A sigmoid(A x) { return rcp_<Fast>(A(1) + exp_(-x)); }

// silu(x) = x * sigmoid(x). sigmoid underflows to 0 for x < ~-88 (float), so only x = -inf needs care.
template <bool Fast, typename A> FFN_HD A silu(A x) {
  const A s = sigmoid<Fast>(x);
  return s == A(0) ? A(-0.0) : x * s;
}
// silu'(x) = s * (1 + x * (1 - s)).
template <bool Fast, typename A> FFN_HD A silu_grad(A x) {
  if (isinf_(x)) return x > A(0) ? A(1) : A(0);
  const A s = sigmoid<Fast>(x);
  return s * (A(1) + x * (A(1) - s));
}
// Phi(x) = (1 + erf(x / sqrt(2))) / 2, as one fused multiply-add.
template <typename A> FFN_HD A gelu_cdf(A x) { return A(0.5) + A(0.5) * erf_(x * A(0.70710678118654752440)); }
// Exact GELU: x * Phi(x). Phi is 0 only for x < ~-5.9 (float), where x * Phi is -0 anyway, and for x = -inf,
// where x * 0 would be NaN: a select, not a branch (the compiler turns an isinf test into more instructions).
template <typename A> FFN_HD A gelu(A x) {
  const A cdf = gelu_cdf(x);
  return cdf == A(0) ? A(-0.0) : x * cdf;
}
// gelu'(x) = Phi(x) + x * phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi). phi is 0 for |x| > ~13.2 (float) and
// |x| = inf, where the limit is Phi (x * 0 would be NaN at inf).
template <typename A> FFN_HD A gelu_grad(A x) {
  const A cdf = gelu_cdf(x);
  const A pdf = exp_(A(-0.5) * x * x) * A(0.39894228040143267794);
  return pdf == A(0) ? cdf : cdf + x * pdf;
}

// ---- the op functors: apply<Fast>(const A in[NI], A out[NO]) ----
struct GeluFwd {
  static constexpr int NI = 1, NO = 1;
  template <bool Fast, typename A> FFN_HD void apply(const A* in, A* out) const { out[0] = gelu(in[0]); }
};
struct GeluBwd {  // in: grad, x
  static constexpr int NI = 2, NO = 1;
  template <bool Fast, typename A> FFN_HD void apply(const A* in, A* out) const {
    out[0] = in[0] * gelu_grad(in[1]);
  }
};
struct SiluFwd {
  static constexpr int NI = 1, NO = 1;
  template <bool Fast, typename A> FFN_HD void apply(const A* in, A* out) const { out[0] = silu<Fast>(in[0]); }
};
struct SiluBwd {  // in: grad, x
  static constexpr int NI = 2, NO = 1;
  template <bool Fast, typename A> FFN_HD void apply(const A* in, A* out) const {
    out[0] = in[0] * silu_grad<Fast>(in[1]);
  }
};
struct SwigluFwd {  // in: gate, up
  static constexpr int NI = 2, NO = 1;
  template <bool Fast, typename A> FFN_HD void apply(const A* in, A* out) const {
    out[0] = silu<Fast>(in[0]) * in[1];
  }
};
struct SwigluBwd {  // in: grad, gate, up; out: dgate, dup
  static constexpr int NI = 3, NO = 2;
  template <bool Fast, typename A> FFN_HD void apply(const A* in, A* out) const {
    out[0] = in[0] * in[2] * silu_grad<Fast>(in[1]);
    out[1] = in[0] * silu<Fast>(in[1]);
  }
};

// Fast math for 16-bit storage types (see the top of this file).
template <typename T> constexpr bool fast_math_for() { return sizeof(T) == 2; }

}  // namespace math
}  // namespace ffn_ext
