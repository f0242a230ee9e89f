// Element math of every ffn_ext op, shared by the CUDA kernels (csrc/cuda/) and the host test path
// (ffn_ext._C._host_math, checked against an fp64 reference on CPU in CI).
//
// Each functor maps NI input values to NO output values in the accumulation type A (float for
// float/half/bfloat16, double for double). Callers convert storage -> A once at the load and A -> storage
// once at the store, so every op rounds exactly once.
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

template <typename A> FFN_HD A sigmoid(A x) { return A(1) / (A(1) + exp_(-x)); }

// silu(x) = x * sigmoid(x). sigmoid underflows to 0 for x < ~-88 (float), so only x = -inf needs care.
template <typename A> FFN_HD A silu(A x) {
  const A s = sigmoid(x);
  return s == A(0) ? A(-0.0) : x * s;
}
// silu'(x) = s * (1 + x * (1 - s)).
template <typename A> FFN_HD A silu_grad(A x) {
  if (isinf_(x)) return x > A(0) ? A(1) : A(0);
  const A s = sigmoid(x);
  return s * (A(1) + x * (A(1) - s));
}
// Exact GELU: 0.5 * x * (1 + erf(x / sqrt(2))).
template <typename A> FFN_HD A gelu(A x) {
  if (isinf_(x)) return x > A(0) ? x : A(-0.0);
  return A(0.5) * x * (A(1) + erf_(x * A(0.70710678118654752440)));
}
// gelu'(x) = Phi(x) + x * phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi).
template <typename A> FFN_HD A gelu_grad(A x) {
  if (isinf_(x)) return x > A(0) ? A(1) : A(0);
  const A cdf = A(0.5) * (A(1) + erf_(x * A(0.70710678118654752440)));
  const A pdf = exp_(A(-0.5) * x * x) * A(0.39894228040143267794);
  return cdf + x * pdf;
}

// ---- the op functors: (const A in[NI], A out[NO]) ----
struct GeluFwd {
  static constexpr int NI = 1, NO = 1;
  template <typename A> FFN_HD void operator()(const A* in, A* out) const { out[0] = gelu(in[0]); }
};
struct GeluBwd {  // in: grad, x
  static constexpr int NI = 2, NO = 1;
  template <typename A> FFN_HD void operator()(const A* in, A* out) const { out[0] = in[0] * gelu_grad(in[1]); }
};
struct SiluFwd {
  static constexpr int NI = 1, NO = 1;
  template <typename A> FFN_HD void operator()(const A* in, A* out) const { out[0] = silu(in[0]); }
};
struct SiluBwd {  // in: grad, x
  static constexpr int NI = 2, NO = 1;
  template <typename A> FFN_HD void operator()(const A* in, A* out) const { out[0] = in[0] * silu_grad(in[1]); }
};
struct SwigluFwd {  // in: gate, up
  static constexpr int NI = 2, NO = 1;
  template <typename A> FFN_HD void operator()(const A* in, A* out) const { out[0] = silu(in[0]) * in[1]; }
};
struct SwigluBwd {  // in: grad, gate, up; out: dgate, dup
  static constexpr int NI = 3, NO = 2;
  template <typename A> FFN_HD void operator()(const A* in, A* out) const {
    out[0] = in[0] * in[2] * silu_grad(in[1]);
    out[1] = in[0] * silu(in[1]);
  }
};

}  // namespace math
}  // namespace ffn_ext
