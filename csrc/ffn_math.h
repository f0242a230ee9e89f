// Element math of every ffn_ext op, shared by the CUDA kernels (csrc/cuda/) and the tests' host math
// (tests/native.py's _host_math, checked against an fp64 reference on CPU in CI).
//
// Each functor maps NI input values to NO output values in the accumulation type A (float for
// float/half/bfloat16, double for double): f.template apply<Fast>(in, out). Callers convert storage -> A once at
// the load and A -> storage once at the store, so every op rounds exactly once. Fast is true for 16-bit storage
// (half, bfloat16), whose rounding (2**-9 / 2**-12 relative) dwarfs a few ulps of float. There:
//   - the device takes one-instruction approximations of 1/d and 2**x (MUFU.RCP, MUFU.EX2: about 1-2 ulp of
//     float, denormal results flushed to 0); an IEEE division, a dozen instructions with a slow-path branch,
//     made bf16 SiLU and SwiGLU issue-bound on an H200. The host (the test path) computes both exactly;
//   - GELU evaluates Phi from one polynomial, one reciprocal and one exponential instead of erff (gelu_tail
//     below), which is also more accurate: on the host, all bfloat16 and 99.99% of float16 inputs give the
//     correctly rounded result (erff: 99.7% and 99.5%, off by up to 255 bf16 ulps where 1 + erf cancels).
// The CUDA tests check the device's results against the same fp64 reference and against the host.
//
// Infinities: the functors return the mathematical limits, which ATen does not always do (each activation's are
// its table entry's `limits` in ffn_ext/table.py; gelu, gelu_tanh, silu, quick_gelu: act(-inf) = -0,
// act(+inf) = +inf, act'(-inf) = 0, act'(+inf) = 1; relu2: act'(+inf) = +inf). NaN in -> NaN out.
#pragma once

#include <torch/headeronly/version.h>  // header-only: allowed at the stable target

#include <math.h>  // ::isinf on the host
#include <cmath>
#include <type_traits>

#if defined(__CUDACC__)
#define FFN_HD __host__ __device__ __forceinline__
#define FFN_UNROLL _Pragma("unroll")
#else
#define FFN_HD inline
#define FFN_UNROLL
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

// The two Fast primitives: one MUFU instruction each on the device (flush-to-zero), exact on the host.
// 1 / d for d >= 1 (the sigmoid's and gelu_tail's denominators): d > 2**126 and d = inf give 0.
template <bool Fast> FFN_HD float rcp_(float d) {
#if defined(__CUDA_ARCH__)
  if constexpr (Fast) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
    return r;
  }
#endif
  return 1.0f / d;
}
template <bool Fast> FFN_HD double rcp_(double d) { return 1.0 / d; }
// 2**x: x < -126 gives 0, x = -inf gives 0, about 2 ulp of float on the device.
template <bool Fast> FFN_HD float exp2_(float x) {
#if defined(__CUDA_ARCH__)
  if constexpr (Fast) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
  }
#endif
  return ::exp2f(x);
}
template <bool Fast> FFN_HD double exp2_(double x) { return ::exp2(x); }

template <bool Fast, typename A> FFN_HD A sigmoid(A x) { return rcp_<Fast>(A(1) + exp_(-x)); }

// The clamps x > hi ? hi : x and x < lo ? lo : x, which keep a NaN x. In float on sm_80+ one min.NaN / max.NaN
// (FMNMX.NAN) each instead of a compare and a select: the same bits for every x when hi is not -0 and lo not +0
// (the one difference, a zero against the opposite zero) and neither is NaN.
template <typename A> FFN_HD A clamp_hi(A x, A hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<A, float>) {
    float r;
    asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(hi));
    return r;
  }
#endif
  return x > hi ? hi : x;
}
template <typename A> FFN_HD A clamp_lo(A x, A lo) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<A, float>) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(lo));
    return r;
  }
#endif
  return x < lo ? lo : x;
}

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

// ---- GELU, exact (erf) form, evaluated two ways.
// float32 and float64 storage: Phi(x) = (1 + erf(x / sqrt(2))) / 2 with the library's erf, as one fused multiply-add.
template <typename A> FFN_HD A gelu_cdf(A x) { return A(0.5) + A(0.5) * erf_(x * A(0.70710678118654752440)); }

// 16-bit storage (Fast): erff's selects between its two polynomials left bf16 GELU issue-bound, short of copy
// bandwidth on an H200 (docs/performance.md#kernel-instruction-counts). Instead, for a = |x|, the normal
// tail Q(a) = 1 - Phi(a) is one polynomial, one reciprocal and one exponential:
//   Q(a) = u R(u) phi(a),  u = 1 / (1 + K a),  phi(a) = exp(-a^2 / 2) / sqrt(2 pi),
// where R(u) = (1 + K a) * Q(a) / phi(a) (a Mills ratio, smooth and bounded) is a degree-7 polynomial fitted by
// csrc/fit_gelu_tail.py (relative error 9.4e-8 on a in [0, 14]). With 16-bit inputs a*a is exact in float; the
// rounding of the exponent (up to ~130) bounds Q's relative error by about 4e-6 at a = 13, against 2**-9 / 2**-12
// for the rounding to bfloat16 / float16. Then, with no cancellation even where 1 + erf would cancel (x << 0):
//   gelu(x)  = (x >= 0 ? x : -0) - a Q             (x - x Q for x >= 0, x Q for x < 0)
//   gelu'(x) = x >= 0 ? 1 - W : W,  W = Q - a phi   (Phi(x) + x phi(x) for both signs)
// Q and phi underflow to 0 for a > ~13.2, so a is clamped to 14 in the products: x = +-inf gives
// +-inf - 14 * 0, not inf * 0. NaN passes through Q and phi (fminf drops it from the clamp).
struct GeluTail {
  float a;    // min(|x|, 14)
  float q;    // Q(|x|)
  float pdf;  // phi(x)
};
template <bool Fast> FFN_HD GeluTail gelu_tail(float x) {
  constexpr float kK = 0.305f;
  constexpr float c[8] = {0.304905593f,   0.306978787f, 0.259237663f,  0.303356378f,
                          -0.0951938281f, 0.465523286f, -0.383484861f, 0.091991237f};
  // phi(x) = 2**(x^2 * (-log2(e) / 2) + log2(1 / sqrt(2 pi)))
  const float pdf = exp2_<Fast>(x * x * -0.72134752044448170368f + -1.3257480647361594510f);
  const float u = rcp_<Fast>(::fabsf(x) * kK + 1.0f);
  float r = c[7];
  FFN_UNROLL
  for (int i = 6; i >= 0; --i) r = r * u + c[i];
  return {::fminf(::fabsf(x), 14.0f), u * r * pdf, pdf};
}

// Exact GELU: x * Phi(x). erf form: Phi is 0 only for x < ~-5.9 (float), where x * Phi is -0 anyway, and for
// x = -inf, where x * 0 would be NaN: a select, not a branch (an isinf test compiles to more instructions).
template <bool Fast, typename A> FFN_HD A gelu(A x) {
  if constexpr (Fast && sizeof(A) == 4) {
    const GeluTail t = gelu_tail<Fast>(x);
    return (x >= 0.0f ? x : -0.0f) - t.a * t.q;  // a select, not fmaxf: fmaxf(+0, -0) may be either zero
  } else {
    const A cdf = gelu_cdf(x);
    return cdf == A(0) ? A(-0.0) : x * cdf;
  }
}
// gelu'(x) = Phi(x) + x * phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi). erf form: phi is 0 for |x| > ~13.2
// (float) and |x| = inf, where the limit is Phi (x * 0 would be NaN at inf).
template <bool Fast, typename A> FFN_HD A gelu_grad(A x) {
  if constexpr (Fast && sizeof(A) == 4) {
    const GeluTail t = gelu_tail<Fast>(x);
    const float w = t.q - t.a * t.pdf;
    return x >= 0.0f ? 1.0f - w : w;
  } else {
    const A cdf = gelu_cdf(x);
    const A pdf = exp_(A(-0.5) * x * x) * A(0.39894228040143267794);
    return pdf == A(0) ? cdf : cdf + x * pdf;
  }
}

// ---- GELU, tanh form: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), exactly F.gelu(approximate="tanh").
// Since 0.5 (1 + tanh(u)) = sigmoid(2u), it is x * sigmoid(z) with z = 2u = x (kA + kB x^2): SiLU's code with a
// cubic argument, and no 1 + tanh that cancels for x << 0. z' = kA + 3 kB x^2.
template <typename A> FFN_HD A gelu_tanh_z(A x) { return x * (A(1.5957691216057308) + A(0.07135481627260025) * x * x); }
template <bool Fast, typename A> FFN_HD A gelu_tanh(A x) {
  const A s = sigmoid<Fast>(gelu_tanh_z(x));
  return s == A(0) ? A(-0.0) : x * s;  // x -> -inf (and x^3 overflowing): the limit -0, not -inf * 0
}
// gelu_tanh'(x) = s + x z' s (1 - s). Where s (1 - s) is 0 (|x| large or infinite: s is 0 or 1) the limit is s;
// the select also keeps x z' from meeting a 0 when x^2 overflows.
template <bool Fast, typename A> FFN_HD A gelu_tanh_grad(A x) {
  const A s = sigmoid<Fast>(gelu_tanh_z(x));
  const A sp = s * (A(1) - s);
  return sp == A(0) ? s : s + x * (A(1.5957691216057308) + A(0.21406444881780076) * x * x) * sp;
}

// ---- activations: value f and first derivative df for the kernels (Fast as above), and the backward product
// bwd(grad, x) = grad * act'(x) (double backward is the table's ATen form's, ffn_ext/_kernels.py); csrc/ops_table.h
// lists the activations. Each derives from ActBase<Self>, whose bwd is grad * df(x): an activation with an unbounded
// derivative (relu2: 2x) defines its own bwd, so that the product is finite wherever it is (df(x) alone may
// overflow).
template <class Self>
struct ActBase {
  template <bool Fast, typename A> static FFN_HD A bwd(A grad, A x) { return grad * Self::template df<Fast>(x); }
};
struct Gelu : ActBase<Gelu> {  // exact (erf) GELU
  template <bool Fast, typename A> static FFN_HD A f(A x) { return gelu<Fast>(x); }
  template <bool Fast, typename A> static FFN_HD A df(A x) { return gelu_grad<Fast>(x); }
};
struct GeluTanh : ActBase<GeluTanh> {  // tanh GELU: x s, s = sigmoid(z), z = x (kA + kB x^2)
  template <bool Fast, typename A> static FFN_HD A f(A x) { return gelu_tanh<Fast>(x); }
  template <bool Fast, typename A> static FFN_HD A df(A x) { return gelu_tanh_grad<Fast>(x); }
};
struct Silu : ActBase<Silu> {
  template <bool Fast, typename A> static FFN_HD A f(A x) { return silu<Fast>(x); }
  template <bool Fast, typename A> static FFN_HD A df(A x) { return silu_grad<Fast>(x); }
};
// relu(x) = max(x, 0), a select (NaN passes: NaN < 0 is false); relu' = step, 0 at 0 as ATen's, NaN for NaN.
struct Relu : ActBase<Relu> {
  template <bool Fast, typename A> static FFN_HD A f(A x) { return x < A(0) ? A(0) : x; }
  template <bool Fast, typename A> static FFN_HD A df(A x) { return x > A(0) ? A(1) : (x <= A(0) ? A(0) : x); }
};
// relu2(x) = relu(x)^2 (Primer; Nemotron-H, Arcee AFM): relu2' = 2 relu(x) is unbounded, so the backward product
// is 2 (grad relu(x)): it overflows only where the product itself does (grad * df overflows for x > max / 2).
struct Relu2 : ActBase<Relu2> {
  template <bool Fast, typename A> static FFN_HD A f(A x) {
    const A r = Relu::f<Fast>(x);
    return r * r;
  }
  template <bool Fast, typename A> static FFN_HD A df(A x) { return A(2) * Relu::f<Fast>(x); }
  template <bool Fast, typename A> static FFN_HD A bwd(A grad, A x) { return A(2) * (grad * Relu::f<Fast>(x)); }
};
// quick_gelu(x) = x sigmoid(a x), a = 1.702 (CLIP; transformers' QuickGELUActivation): SiLU at z = a x, scaled,
// quick_gelu' = s (1 + z (1 - s)) = silu'(z). z, not x, decides the limits: z overflows to inf for finite x.
struct QuickGelu : ActBase<QuickGelu> {
  static constexpr double kA = 1.702;
  template <bool Fast, typename A> static FFN_HD A f(A x) {
    const A s = sigmoid<Fast>(A(kA) * x);
    return s == A(0) ? A(-0.0) : x * s;
  }
  template <bool Fast, typename A> static FFN_HD A df(A x) {
    const A z = A(kA) * x;
    if (isinf_(z)) return z > A(0) ? A(1) : A(0);
    const A s = sigmoid<Fast>(z);
    return s * (A(1) + z * (A(1) - s));
  }
};

// ---- gates: the element math of a gated op, gate(g, u) and its two partial derivatives, over an activation or
// with parameters of its own (csrc/ops_table.h's gated lines). A gate is built from its op's parameters (the
// schema's keyword arguments) on the host and passed to the kernel by value.
struct NoParams {};
// torch.clamp's gradient at the bound itself, which swiglu_clamped's gradients follow: passed (subgradient 1)
// before torch 2.14, 0 since (pytorch#191142: the minimum-norm subgradient, as relu and hardtanh).
constexpr bool clamp_grad_at_bound(int torch_major, int torch_minor) {
  return torch_major < 2 || (torch_major == 2 && torch_minor < 14);
}
struct ClampParams {  // swiglu_clamped: limit > 0 (checked in shapes.cpp), alpha, up_offset
  double limit, alpha, up_offset;
  // One build serves every torch from 2.10 on, so the running torch's convention is a value: the CUDA glue sets it
  // (for_dtype, shapes.cpp); the default is the torch the code is compiled with (the tests' host math).
  bool grad_at_bound = clamp_grad_at_bound(TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR);
};

// act(g) * u for an activation above (ops_table.h FFN_EXT_GATED: swiglu is Glu<Silu>, ...). dgate goes through the
// activation's bwd (grad u act'(g) without an overflowing act').
template <class Act_>
struct Glu {
  using Act = Act_;
  using Params = NoParams;
  explicit Glu(NoParams = {}) {}
  template <bool Fast, typename A> FFN_HD A fwd(A g, A u) const { return Act::template f<Fast>(g) * u; }
  // dgate = grad u act'(g), dup = grad act(g)
  template <bool Fast, typename A> FFN_HD void bwd(A grad, A g, A u, A& dg, A& du) const {
    dg = Act::template bwd<Fast>(grad * u, g);
    du = grad * Act::template f<Fast>(g);
  }
};

// Clamped SwiGLU (GPT-OSS with alpha = 1.702, up_offset = 1, limit = 7; DeepSeek-V4 with alpha = 1, no offset):
//   (clamp(u, -L, L) + up_offset) h(clamp(g, max=L)),  h(x) = x sigmoid(alpha x)
// h'(x) = silu'(alpha x), so the derivative is SiLU's at z = alpha x. The gradients are torch.clamp's: each passes
// where its input is within the bounds, is 0 beyond, and at the bound itself follows p.grad_at_bound (and for
// NaN: 0, a select like ATen's where, so grad = NaN there gives 0 too). The clamps are selects, not fminf/fmaxf,
// so NaN passes through.
struct SwigluClamped {
  using Params = ClampParams;
  ClampParams p;
  explicit SwigluClamped(ClampParams params) : p(params) {}
  // limit > 0 (as float: >= +0), so -limit is <= -0: clamp_hi / clamp_lo's condition holds
  template <typename A> FFN_HD A clamp_g(A g) const { return clamp_hi(g, A(p.limit)); }
  // where the clamps pass the gradient
  template <typename A> FFN_HD bool pass_g(A g) const { return p.grad_at_bound ? g <= A(p.limit) : g < A(p.limit); }
  template <typename A> FFN_HD bool pass_u(A u) const {
    return p.grad_at_bound ? u >= A(-p.limit) && u <= A(p.limit) : u > A(-p.limit) && u < A(p.limit);
  }
  // clamp(u, -L, L): two clamps, not nested, compile to no branch (NaN passes both): the forward's cost went from
  // 33.9 to 27.6 instructions per bf16 element on sm_90 (selects), then to 24.6 (FMNMX.NAN). The backward keeps the
  // nested form, which nvcc branches on: with the selects its 16-bit kernels spilled at 128 registers.
  template <typename A> FFN_HD A clamp_u(A u) const { return clamp_hi(clamp_lo(u, A(-p.limit)), A(p.limit)); }
  template <typename A> FFN_HD A clamp_u_nested(A u) const {
    return u < A(-p.limit) ? A(-p.limit) : (u > A(p.limit) ? A(p.limit) : u);
  }
  template <typename A> static FFN_HD A h(A x, A s) { return s == A(0) ? A(-0.0) : x * s; }  // x -> -inf: -0
  template <bool Fast, typename A> FFN_HD A fwd(A g, A u) const {
    const A x = clamp_g(g);
    return h(x, sigmoid<Fast>(A(p.alpha) * x)) * (clamp_u(u) + A(p.up_offset));
  }
  template <bool Fast, typename A> FFN_HD void bwd(A grad, A g, A u, A& dg, A& du) const {
    const A x = clamp_g(g);
    const A z = A(p.alpha) * x;
    const A s = sigmoid<Fast>(z);
    const A dh = isinf_(z) ? (z > A(0) ? A(1) : A(0)) : s * (A(1) + z * (A(1) - s));  // silu'(z)
    dg = pass_g(g) ? grad * (clamp_u_nested(u) + A(p.up_offset)) * dh : A(0);
    du = pass_u(u) ? grad * h(x, s) : A(0);
  }
};

// ---- the op functors: apply<Fast>(const A in[NI], A out[NO]), one per op shape over an activation or a gate.
// kPairIn / kPairOut: the launcher's interleaved operands (rows.h), -1 for none; set by Interleaved below.
struct PlainLayout {
  static constexpr int kPairIn = -1, kPairOut = -1;
};
template <class Act>
struct UnaryFwd : PlainLayout {  // in: x
  static constexpr int NI = 1, NO = 1;
  template <bool Fast, typename A> FFN_HD void apply(const A* in, A* out) const {
    out[0] = Act::template f<Fast>(in[0]);
  }
};
template <class Act>
struct UnaryBwd : PlainLayout {  // in: grad, x
  static constexpr int NI = 2, NO = 1;
  template <bool Fast, typename A> FFN_HD void apply(const A* in, A* out) const {
    out[0] = Act::template bwd<Fast>(in[0], in[1]);
  }
};
// The classic FFN's lean backward (h = act(z) recomputed, not saved): dz = grad * act'(z) and act(z) from one read of
// grad and z.
template <class Act>
struct UnaryBwdRecompute : PlainLayout {  // in: grad, x; out: grad * act'(x), act(x)
  static constexpr int NI = 2, NO = 2;
  template <bool Fast, typename A> FFN_HD void apply(const A* in, A* out) const {
    out[0] = Act::template bwd<Fast>(in[0], in[1]);
    out[1] = Act::template f<Fast>(in[1]);
  }
};
template <class Gate>
struct GatedFwd : PlainLayout {  // in: gate, up; out: gate(gate, up)
  static constexpr int NI = 2, NO = 1;
  Gate gate;
  explicit GatedFwd(Gate g = Gate{typename Gate::Params{}}) : gate(g) {}
  template <bool Fast, typename A> FFN_HD void apply(const A* in, A* out) const {
    out[0] = gate.template fwd<Fast>(in[0], in[1]);
  }
};
template <class Gate>
struct GatedBwd : PlainLayout {  // in: grad, gate, up; out: dgate, dup
  static constexpr int NI = 3, NO = 2;
  Gate gate;
  explicit GatedBwd(Gate g = Gate{typename Gate::Params{}}) : gate(g) {}
  template <bool Fast, typename A> FFN_HD void apply(const A* in, A* out) const {
    gate.template bwd<Fast>(in[0], in[1], in[2], out[0], out[1]);
  }
};
// The gated MLPs' lean backward (h recomputed for the down projection's weight gradient, not saved): dgate, dup and
// h = gate(gate, up) from one read of grad, gate and up.
template <class Gate>
struct GatedBwdRecompute : PlainLayout {  // in: grad, gate, up; out: dgate, dup, gate(gate, up)
  static constexpr int NI = 3, NO = 3;
  Gate gate;
  explicit GatedBwdRecompute(Gate g = Gate{typename Gate::Params{}}) : gate(g) {}
  template <bool Fast, typename A> FFN_HD void apply(const A* in, A* out) const {
    gate.template bwd<Fast>(in[0], in[1], in[2], out[0], out[1]);
    out[2] = gate.template fwd<Fast>(in[1], in[2]);
  }
};
// F with inputs PairIn, PairIn + 1 (and outputs PairOut, PairOut + 1) stored interleaved in one operand,
// [a0, b0, a1, b1, ...]: the packed ops' layout="interleaved" (GPT-OSS). -1: no such pair.
template <class F, int PairIn, int PairOut>
struct Interleaved : F {
  explicit Interleaved(const F& f) : F(f) {}
  static constexpr int kPairIn = PairIn, kPairOut = PairOut;
};

// Fast math for 16-bit storage types (see the top of this file).
template <typename T> constexpr bool fast_math_for() { return sizeof(T) == 2; }

// The accumulation type of storage type T, as ATen's opmath_type (double for double, else float), which is not in
// torch's header-only set.
template <typename T> using opmath_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

}  // namespace math
}  // namespace ffn_ext

// ---- FP8 element math: the quantizing ops' conversion and scales (ffn_ext/quant.py documents the formula) ----
// __host__ __device__ and bit-level, so that the host tests compare them with torch's casts bit for bit
// (tests/test_quant_math.py: every fp8 value's rounding neighbourhood, ties, subnormals, saturation, NaN).
#include <cstdint>
#include <cstring>

namespace ffn_ext {
namespace math {

FFN_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
FFN_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// float -> fp8 with round to nearest even, for the two formats: mantissa bits M, exponent bias B. NaN -> 0x7F
// (the positive canonical NaN, what sm_89+'s cvt.rn gives; torch's cast keeps NaN's sign bit). Past the largest
// finite value (+-inf included), as torch 2.13's casts: e4m3fn (no inf) saturates to +-448 (0x7E), e5m2 goes to
// +-inf (0x7C). The quantizing ops clamp to +-fp8_max first, so from them only NaN reaches either rule.
template <int M, int B>
FFN_HD uint8_t to_fp8(float f) {
  const uint32_t u = f32_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7F;
  constexpr uint32_t kShift = 23 - M;
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(127 - B + 1) << 23;  // 2^(1-B)
  constexpr uint32_t kOver = M == 3 ? 0x7Eu : 0x7Cu;  // e4m3fn: 448, the largest finite; e5m2: inf
  uint32_t code;
  if (a < kMinNormal) {
    // subnormal: multiples of 2^(1-B-M), a * 2^(B+M-1) rounded to an integer (exact scaling, then RNE: adding and
    // subtracting 2^23 rounds a float in [0, 2^22) to an integer in the default rounding mode, nearest even)
    const float scaled = bits_f32(a) * bits_f32(static_cast<uint32_t>(127 + B + M - 1) << 23);
    code = static_cast<uint32_t>((scaled + 8388608.0f) - 8388608.0f);
  } else {
    const uint32_t r = a + ((1u << (kShift - 1)) - 1) + ((a >> kShift) & 1u);  // round the dropped bits, ties even
    code = (r >> kShift) - (static_cast<uint32_t>(127 - B) << M);
    if (code > kOver) code = kOver;
  }
  return static_cast<uint8_t>(code | sign);
}
FFN_HD uint8_t to_e4m3fn(float f) { return to_fp8<3, 7>(f); }
FFN_HD uint8_t to_e5m2(float f) { return to_fp8<2, 15>(f); }

constexpr float kAmaxFloor = 1e-12f;  // quant.py AMAX_FLOOR
constexpr float kFltMax = 3.402823466e38f;

// The scale of a group from its amax (>= 0 or NaN): min(max(amax, floor), FLT_MAX) / fp8_max, then with pow2
// 2^ceil(log2 s) exactly (the mantissa rounded up; s is positive and normal, or NaN, which stays). Selects, not
// fminf/fmaxf, which would drop a NaN.
FFN_HD float quant_scale(float amax, float fp8_max, bool pow2) {
  float a = amax < kAmaxFloor ? kAmaxFloor : amax;
  a = a > kFltMax ? kFltMax : a;
  float s = a / fp8_max;
  if (pow2 && s == s) s = bits_f32((f32_bits(s) + 0x7FFFFFu) & 0x7F800000u);
  return s;
}
// A power-of-two scale as float8_e8m0fnu (its exponent byte; NaN -> 0xFF).
FFN_HD uint8_t to_e8m0(float s) { return s == s ? static_cast<uint8_t>(f32_bits(s) >> 23) : uint8_t(0xFF); }
// h * inv clamped to +-fp8_max (NaN stays), as fp8 of the format with that maximum.
FFN_HD uint8_t quant_element(float h, float inv, float fp8_max) {
  float x = h * inv;
  x = x > fp8_max ? fp8_max : (x < -fp8_max ? -fp8_max : x);
  return fp8_max == 448.0f ? to_e4m3fn(x) : to_e5m2(x);
}

// ---- a whole chunk of 8: h[k] * inv quantized to byte k of w (w[0] holds elements 0-3, w[1] 4-7, little-endian:
// the bytes as one 8-byte store writes them).
constexpr int kChunk = 8;

// The chunk two elements at a time through cvt2(lo, hi) -> (fp8(hi) << 8) | fp8(lo), a conversion with
// cvt.rn.satfinite's definition (PTX ISA, cvt: round to nearest even; with .satfinite a NaN input gives NaN and an
// input of magnitude above the format's largest finite value, infinities included, gives that value with the
// input's sign). For x = h * inv that is exactly quant_element's clamp-then-round, so the clamp is left out:
//   |x| <= fp8_max: the same input, the same rounding (448 and 57344 are the largest finite values, exactly
//     representable, so nothing within the clamp rounds past them);
//   |x| > fp8_max or +-inf: the clamp gives +-fp8_max, which converts to +-fp8_max; satfinite gives +-fp8_max
//     (e5m2 too: satfinite's 57344, not the inf of a plain e5m2 cast, which the clamp never lets happen);
//   NaN: the clamp passes it and to_fp8 gives 0x7F; the instruction gives NaN, and 0x7F is the NaN that cuda_fp8.h's
//     host emulation of this instruction returns for either sign (it canonicalizes the input to +NaN first; a
//     negative NaN is the one case where torch's own cast, which keeps the sign, differs: 0xFF).
// tests/test_fp8_cvt.py checks this with cuda_fp8.h's host __nv_cvt_float2_to_fp8x2 as cvt2 against the
// software path, bit for bit, over every fp8 value's rounding neighbourhood, the saturation edge, inf and NaN.
template <class Cvt2>
FFN_HD void quant_chunk_pairs(const float (&h)[kChunk], float inv, uint32_t (&w)[2], Cvt2 cvt2) {
  FFN_UNROLL
  for (int j = 0; j < 2; ++j) {
    const uint32_t lo = cvt2(h[4 * j] * inv, h[4 * j + 1] * inv);
    const uint32_t hi = cvt2(h[4 * j + 2] * inv, h[4 * j + 3] * inv);
    w[j] = (lo & 0xFFFFu) | (hi << 16);
  }
}

// The software path: quant_element per element (the host; sm_80, which has no fp8 conversion instruction).
FFN_HD void quant_chunk_soft(const float (&h)[kChunk], float inv, float fp8_max, uint32_t (&w)[2]) {
  FFN_UNROLL
  for (int j = 0; j < 2; ++j) {
    uint32_t v = 0;
    FFN_UNROLL
    for (int k = 0; k < 4; ++k) v |= static_cast<uint32_t>(quant_element(h[4 * j + k], inv, fp8_max)) << (8 * k);
    w[j] = v;
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// sm_89+ (the sm_90 build): cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 d, a, b puts fp8(a) in d's upper byte and
// fp8(b) in its lower one, two elements per instruction (one F2FP in the SASS) instead of about 24 instructions
// of bit manipulation per element in to_fp8.
struct CvtE4m3x2 {
  __device__ __forceinline__ uint32_t operator()(float lo, float hi) const {
    unsigned short d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return d;
  }
};
struct CvtE5m2x2 {
  __device__ __forceinline__ uint32_t operator()(float lo, float hi) const {
    unsigned short d;
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return d;
  }
};
#endif

// The chunk quantized as the op's formula says (ffn_ext/quant.py): the hardware conversion where there is one
// (bit-identical, see quant_chunk_pairs), else the software one.
FFN_HD void quant_chunk(const float (&h)[kChunk], float inv, float fp8_max, uint32_t (&w)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (fp8_max == 448.0f) {
    quant_chunk_pairs(h, inv, w, CvtE4m3x2{});
  } else {
    quant_chunk_pairs(h, inv, w, CvtE5m2x2{});
  }
#else
  quant_chunk_soft(h, inv, fp8_max, w);
#endif
}

}  // namespace math
}  // namespace ffn_ext
