// Declarations shared by the ffn_ext sources, on PyTorch's stable ABI (torch/csrc/stable, torch/headeronly and the
// C shims only; every TU is compiled with -DTORCH_TARGET_VERSION=0x020a000000000000: docs/internals/stable-abi.md).
// Map of the code:
//   ops_table.h        the table of ops: every activation and gated activation, one line each
//   registration.cpp   STABLE_TORCH_LIBRARY(ffn_ext): every schema (quantizing ones included), pointwise tags
//   python_module.cpp  the pybind11 module ffn_ext._C (registration.cpp + build info): no kernels, so it loads
//                      under any torch >= 2.10, CUDA or not
//   shapes.cpp         the input checks and output allocation every CUDA kernel starts with
//   ffn_math.h         the element math of every op (activations and op functors, __host__ __device__)
//   rows.h, row_ops.h  the launcher (per-thread code, launch shape) and tensors -> launcher problems
//   cuda/ops.cpp       libffn_ext_cuda.so: the CUDA kernels' registration and glue (stream, guard, SM count)
//   cuda/kernels_part*.cu, cuda/quant_part*.cu  the kernels, torch-free
//   quant.h, quant_recipe.cpp, quant_ops.h, quant_kernel.h  the FP8 quantizing ops (recipe checks, outputs,
//                      the kernels' problems and per-lane code)
// Fake (Meta) kernels, autograd, vmap and the CPU kernels are Python, from the table (ffn_ext/_kernels.py; the
// quantizing ops' formula: ffn_ext/quant.py).
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "ffn_math.h"

namespace ffn_ext {
using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// ---- errors ----
// The C++ checks are guards of the kernels' own invariants, raised as RuntimeError (the one type that crosses the
// stable ABI reliably). The user-facing rules, exception types and messages are Python's (ffn_ext/_kernels.py,
// ffn_ext/quant.py), which the functional API runs to explain a guard's error. Messages are concatenated strings
// (numbers through std::to_string): no ostream, which a broken libstdc++ stream link turned into segfaults before
// (shapes.cpp), and no "func, file:line" prefix.
namespace detail {
inline void append(std::string& s, const char* p) { s += p; }
inline void append(std::string& s, const std::string& p) { s += p; }
inline void append(std::string& s, std::string_view p) { s.append(p.data(), p.size()); }
template <class... A>
[[noreturn]] void fail(const A&... parts) {
  std::string s;
  (append(s, parts), ...);
  throw std::runtime_error(s);
}
}  // namespace detail
#define FFN_EXT_CHECK(cond, ...) \
  do { \
    if (!(cond)) ::ffn_ext::detail::fail(__VA_ARGS__); \
  } while (0)

// A shim call that must succeed (an error code becomes a RuntimeError naming the call).
#define FFN_EXT_SHIM(call) \
  do { \
    if ((call) != AOTI_TORCH_SUCCESS) ::ffn_ext::detail::fail("ffn_ext: ", #call, " failed"); \
  } while (0)

// ---- tensors through the C shims (no dispatcher round trips: docs/internals/stable-abi.md) ----
// The dtype as c10's enum value, read with aoti_torch_get_dtype: Tensor::scalar_type() throws at the 2.10 target
// for dtypes it cannot convert (float8_e8m0fnu: docs/internals/stable-abi.md).
inline ScalarType dtype_of(const Tensor& t) {
  int32_t code = 0;
  FFN_EXT_SHIM(aoti_torch_get_dtype(t.get(), &code));
  return static_cast<ScalarType>(code);
}
// A new tensor with the given sizes and strides, dtype (c10's enum value) on like's device.
Tensor empty_strided(const Tensor& like, const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                     ScalarType dtype);
std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes);
inline std::vector<int64_t> vec(torch::headeronly::IntHeaderOnlyArrayRef a) { return {a.begin(), a.end()}; }

// ---- input guards and output allocation (shapes.cpp) ----
// Every CUDA kernel starts with one of these: a guard of what the kernel needs (dense strided floating-point
// tensors of one dtype, device and shape; gate_up [..., 2*M]), naming the op and the argument. Outputs are freshly
// allocated: contiguous, or channels_last(_3d) when every input is (same_shape_format).
// `op` is the name messages give, e.g. "ffn_ext.swiglu".
Tensor alloc_unary(const char* op, const Tensor& x);  // gelu, silu, ...
Tensor alloc_unary_backward(const char* op, const Tensor& grad, const Tensor& x);
// name_backward_recompute: (grad * act'(x), act(x)), both of alloc_unary_backward's shape and format
std::tuple<Tensor, Tensor> alloc_unary_backward_recompute(const char* op, const Tensor& grad, const Tensor& x);
Tensor alloc_gated(const char* op, const Tensor& gate, const Tensor& up);  // swiglu, geglu, ...
std::tuple<Tensor, Tensor> alloc_gated_backward(const char* op, const Tensor& grad, const Tensor& gate,
                                                const Tensor& up);
// name_backward_recompute: (dgate, dup, h), all three of alloc_gated_backward's shape and format
std::tuple<Tensor, Tensor, Tensor> alloc_gated_backward_recompute(const char* op, const Tensor& grad,
                                                                  const Tensor& gate, const Tensor& up);
Tensor alloc_gated_packed(const char* op, const Tensor& gate_up);
Tensor alloc_gated_packed_backward(const char* op, const Tensor& grad, const Tensor& gate_up);

// A packed op's `layout` argument: "concat" ([gate | up]) or "interleaved" ([g0, u0, g1, u1, ...]); anything else
// is an error naming `layout`.
enum class Layout { kConcat, kInterleaved };
Layout parse_layout(const char* op, std::string_view layout);

// A gated op's keyword parameters (ops_table.h's P column), guarded before anything else: swiglu_clamped's `limit`
// must be > 0 (+inf is no clamp), `alpha` and `up_offset` finite.
inline void check_params(const char*, const math::NoParams&) {}
void check_params(const char* op, const math::ClampParams& p);
// A gated op's parameters as its kernels use them on tensors of `dtype`: swiglu_clamped's limit is rounded to
// float16 / bfloat16 for 16-bit tensors, as torch.clamp rounds a Scalar bound to the tensor's dtype.
inline math::NoParams for_dtype(const math::NoParams& p, ScalarType) { return p; }
math::ClampParams for_dtype(const math::ClampParams& p, ScalarType dtype);

// "torch.float32", ... (the names the messages give)
const char* dtype_name(ScalarType st);

}  // namespace ffn_ext
