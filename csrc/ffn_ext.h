// Declarations shared by the ffn_ext sources. Map of the code:
//   ops_table.h        the table of ops: every activation and gated activation, one line each
//   registration.cpp   TORCH_LIBRARY(ffn_ext): every schema; build information
//   shapes.cpp         the input checks and output allocation every CUDA kernel starts with
//   (the CPU and fake kernels and autograd of the table's ops are Python: ffn_ext/_kernels.py)
//   ffn_math.h         the element math of every op (activations and op functors, __host__ __device__)
//   rows.h, row_ops.h  the launcher (per-thread code, launch shape) and tensors -> launcher problems
//   cuda/ops.cpp       the CUDA kernels' registration, all of it: row_ops.h's problems, launched through
//                      cuda/launch_rows.h, and quant_ops.h's, launched through cuda/launch_quant.h
//   cuda/kernels_part*.cu  the kernels (cuda/rows_launcher.cuh), torch-free; the table's lines are split across
//                      the parts (cuda/kernels_part.cuh); cuda/kernels.cu: build info
//   quant.h, quant.cpp, quant_recipe.cpp, quant_ops.h, quant_kernel.h  the FP8 quantizing ops (registration and
//                      CPU kernels; recipes, outputs and the ATen formula; the kernels' problems and per-lane code)
//   cuda/quant_part*.cu    their kernels (cuda/quant_kernels.cuh), torch-free, split across four parts
//   python_module.cpp  the pybind11 module ffn_ext._C (build info, the functional API's fast entry points)
//   library.cpp        what the build compiles of the files above: several to a translation unit (it says why)
// Not part of ffn_ext: the tests' host math and emulated launches of these headers (tests/csrc, tests/native.py).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ffn_math.h"

namespace ffn_ext {

// ---- input checks and output allocation (shapes.cpp) ----
// Every CUDA kernel starts with one of these; the CPU and fake kernels (ffn_ext/_kernels.py) make the same checks,
// so real and fake tensors accept and reject the same inputs. Errors (TypeError / ValueError / RuntimeError) name the op, the argument, what was
// expected and what was given. Outputs are always freshly allocated and contiguous.
// `op` is the name messages give, e.g. "ffn_ext.swiglu".
at::Tensor alloc_unary(const char* op, const at::Tensor& x);  // gelu, silu, ...
at::Tensor alloc_unary_backward(const char* op, const at::Tensor& grad, const at::Tensor& x);
// name_backward_recompute: (grad * act'(x), act(x)), both of alloc_unary_backward's shape and format
std::tuple<at::Tensor, at::Tensor> alloc_unary_backward_recompute(const char* op, const at::Tensor& grad,
                                                                  const at::Tensor& x);
at::Tensor alloc_gated(const char* op, const at::Tensor& gate, const at::Tensor& up);  // swiglu, geglu, ...
std::tuple<at::Tensor, at::Tensor> alloc_gated_backward(const char* op, const at::Tensor& grad, const at::Tensor& gate,
                                                        const at::Tensor& up);
at::Tensor alloc_gated_packed(const char* op, const at::Tensor& gate_up);
at::Tensor alloc_gated_packed_backward(const char* op, const at::Tensor& grad, const at::Tensor& gate_up);

// A packed op's `layout` argument: "concat" ([gate | up]) or "interleaved" ([g0, u0, g1, u1, ...]); anything else
// is a ValueError naming `layout`.
enum class Layout { kConcat, kInterleaved };
Layout parse_layout(const char* op, c10::string_view layout);

// A gated op's keyword parameters (ops_table.h's P column), checked before anything else: swiglu_clamped's `limit`
// must be > 0 (+inf is no clamp), `alpha` and `up_offset` finite; ValueErrors name the parameter.
inline void check_params(const char*, const math::NoParams&) {}
void check_params(const char* op, const math::ClampParams& p);
// A gated op's parameters as its kernels use them on tensors of `dtype`. torch.clamp rounds a Scalar bound to the
// tensor's dtype (and compares with it there), so swiglu_clamped's limit is rounded to float16 / bfloat16 for
// 16-bit tensors (for float32 the kernels' float math does it); alpha and up_offset stay as they are, as in ATen's
// scalar multiply and add, which compute in float.
inline math::NoParams for_dtype(const math::NoParams& p, at::ScalarType) { return p; }
math::ClampParams for_dtype(const math::ClampParams& p, at::ScalarType dtype);

// ---- what the build contains ----
std::vector<std::pair<std::string, std::string>> build_info();

#ifdef FFN_EXT_WITH_CUDA
namespace cuda {
// CUDA runtime version the kernels were compiled with, and the architectures (nvcc's __CUDA_ARCH_LIST__).
std::string compiled_cuda_version();
std::string compiled_arch_list();
}  // namespace cuda
#endif

}  // namespace ffn_ext
