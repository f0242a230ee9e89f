// Input checks and output allocation of the CUDA kernels (and of the quantizing ops' Meta kernels, over SymInts).
// The CPU and fake kernels make the same checks, with the same messages, in Python (ffn_ext/_kernels.py).
#include "ffn_ext.h"

#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cmath>
#include <functional>
#include <initializer_list>
#include <string>

namespace ffn_ext {
namespace {
const char* dtype_name(at::ScalarType st) {
  switch (st) {
    case at::kDouble: return "torch.float64";
    case at::kFloat: return "torch.float32";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: return c10::toString(st);
  }
}

// "[3, 5]", built with std::to_string, not an ostream. On the H200 image (torch 2.11, g++ 13) the build linked a
// copy of libstdc++'s stream code into _C whose locale facets were never set up: any number streamed by this
// library into a message segfaulted in std::ostream::_M_insert<long> (cuda-gdb backtrace in
// benchmarks/results/2026-11-30_h200/), and with -static-libstdc++ here the numbers silently vanish. So this
// library's messages format numbers with std::to_string (tests/test_build.py links statically and checks them).
std::string shape_str(c10::SymIntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ", ";
    const auto v = sizes[i].maybe_as_int();
    s += v ? std::to_string(*v) : sizes[i].toSymNode()->str();
  }
  return s + "]";
}

void check_input(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.defined(), op, ": `", name, "` is an undefined tensor");
  TORCH_CHECK_TYPE(!t.is_nested(), op, ": `", name, "` is a nested tensor; expected a dense strided tensor");
  TORCH_CHECK_TYPE(t.layout() == at::kStrided, op, ": expected `", name, "` to be a dense strided tensor, got layout ",
                   t.layout());
  TORCH_CHECK_TYPE(!t.is_quantized(), op, ": `", name, "` is a quantized tensor; expected a floating-point tensor");
  const auto st = t.scalar_type();
  TORCH_CHECK_TYPE(st == at::kDouble || st == at::kFloat || st == at::kHalf || st == at::kBFloat16, op, ": expected `",
                   name, "` to have dtype float64, float32, float16 or bfloat16, got ", dtype_name(st));
}

void check_like(const char* op, const char* name, const at::Tensor& t, const char* ref_name, const at::Tensor& ref) {
  check_input(op, name, t);
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), op, ": expected `", name, "` to have the dtype of `", ref_name,
                   "` (", dtype_name(ref.scalar_type()), "), got ", dtype_name(t.scalar_type()));
  TORCH_CHECK(t.device() == ref.device(), op, ": expected `", name, "` to be on the device of `", ref_name, "` (",
              ref.device(), "), got ", t.device());
  TORCH_CHECK_VALUE(t.sym_sizes() == ref.sym_sizes(), op, ": expected `", name, "` to have the shape of `", ref_name,
                    "` ", shape_str(ref.sym_sizes()), ", got ", shape_str(t.sym_sizes()));
}

// Validates gate_up for the packed ops and returns its half width M.
c10::SymInt check_packed(const char* op, const at::Tensor& gate_up) {
  check_input(op, "gate_up", gate_up);
  TORCH_CHECK_VALUE(gate_up.dim() >= 1, op, ": expected `gate_up` to have at least 1 dimension ([..., 2*M]), got a ",
                    "0-dim tensor");
  const c10::SymInt& last = gate_up.sym_size(-1);
  TORCH_CHECK_VALUE(last % 2 == 0, op, ": expected the last dimension of `gate_up` to be even ([..., 2*M]), got ",
                    "shape ", shape_str(gate_up.sym_sizes()));
  return last / 2;
}

// t's sizes with the last one replaced.
std::vector<c10::SymInt> with_last(const at::Tensor& t, const c10::SymInt& last) {
  std::vector<c10::SymInt> sizes(t.sym_sizes().begin(), t.sym_sizes().end());
  sizes.back() = last;
  return sizes;
}

at::Tensor empty_like_sizes(const at::Tensor& ref, c10::SymIntArrayRef sizes,
                            at::MemoryFormat format = at::MemoryFormat::Contiguous) {
  return at::empty_symint(sizes, ref.options().memory_format(format));
}

// The memory format of a same-shape op's outputs: channels_last (4-D) or channels_last_3d (5-D) when every input
// is dense in it and not plainly contiguous, as ATen's pointwise ops keep it; else contiguous. The CUDA launcher
// then runs one long row over the storage (row_ops.h run_same_shape), the CPU kernels' ATen *_out calls take any
// strides. The fake kernels (ffn_ext/_kernels.py _format) decide the same way, so fake tensors get the real outputs'
// strides.
at::MemoryFormat same_shape_format(std::initializer_list<std::reference_wrapper<const at::Tensor>> ins) {
  const at::Tensor& first = ins.begin()->get();
  const auto fmt = first.dim() == 4   ? at::MemoryFormat::ChannelsLast
                   : first.dim() == 5 ? at::MemoryFormat::ChannelsLast3d
                                      : at::MemoryFormat::Contiguous;
  if (fmt == at::MemoryFormat::Contiguous) return fmt;
  for (const at::Tensor& t : ins) {
    if (t.dim() != first.dim() || t.is_contiguous() || !t.is_contiguous(fmt)) return at::MemoryFormat::Contiguous;
  }
  return fmt;
}
}  // namespace

// ---- per-op checks + allocation ----
at::Tensor alloc_unary(const char* op, const at::Tensor& x) {
  check_input(op, "x", x);
  return empty_like_sizes(x, x.sym_sizes(), same_shape_format({x}));
}

at::Tensor alloc_unary_backward(const char* op, const at::Tensor& grad, const at::Tensor& x) {
  check_input(op, "x", x);
  check_like(op, "grad", grad, "x", x);
  return empty_like_sizes(x, x.sym_sizes(), same_shape_format({grad, x}));
}

std::tuple<at::Tensor, at::Tensor> alloc_unary_backward_recompute(const char* op, const at::Tensor& grad,
                                                                  const at::Tensor& x) {
  check_input(op, "x", x);
  check_like(op, "grad", grad, "x", x);
  const auto fmt = same_shape_format({grad, x});
  return {empty_like_sizes(x, x.sym_sizes(), fmt), empty_like_sizes(x, x.sym_sizes(), fmt)};
}

at::Tensor alloc_gated(const char* op, const at::Tensor& gate, const at::Tensor& up) {
  check_input(op, "gate", gate);
  check_like(op, "up", up, "gate", gate);
  return empty_like_sizes(gate, gate.sym_sizes(), same_shape_format({gate, up}));
}

std::tuple<at::Tensor, at::Tensor> alloc_gated_backward(const char* op, const at::Tensor& grad, const at::Tensor& gate,
                                                        const at::Tensor& up) {
  check_input(op, "gate", gate);
  check_like(op, "up", up, "gate", gate);
  check_like(op, "grad", grad, "gate", gate);
  const auto fmt = same_shape_format({grad, gate, up});
  return {empty_like_sizes(gate, gate.sym_sizes(), fmt), empty_like_sizes(gate, gate.sym_sizes(), fmt)};
}

at::Tensor alloc_gated_packed(const char* op, const at::Tensor& gate_up) {
  const auto m = check_packed(op, gate_up);
  return empty_like_sizes(gate_up, with_last(gate_up, m));
}

at::Tensor alloc_gated_packed_backward(const char* op, const at::Tensor& grad, const at::Tensor& gate_up) {
  const auto m = check_packed(op, gate_up);
  check_input(op, "grad", grad);
  // grad must look like the forward output: gate_up's shape with the last dimension halved.
  const auto out_sizes = with_last(gate_up, m);
  TORCH_CHECK_TYPE(grad.scalar_type() == gate_up.scalar_type(), op,
                   ": expected `grad` to have the dtype of `gate_up` (", dtype_name(gate_up.scalar_type()), "), got ",
                   dtype_name(grad.scalar_type()));
  TORCH_CHECK(grad.device() == gate_up.device(), op, ": expected `grad` to be on the device of `gate_up` (",
              gate_up.device(), "), got ", grad.device());
  TORCH_CHECK_VALUE(grad.sym_sizes() == c10::SymIntArrayRef(out_sizes), op,
                    ": expected `grad` to have the forward output's shape ", shape_str(out_sizes),
                    " (gate_up's with the last dimension halved), got ", shape_str(grad.sym_sizes()));
  return empty_like_sizes(gate_up, gate_up.sym_sizes());
}

Layout parse_layout(const char* op, c10::string_view layout) {
  if (layout == "concat") return Layout::kConcat;
  if (layout == "interleaved") return Layout::kInterleaved;
  TORCH_CHECK_VALUE(false, op, ": `layout` must be \"concat\" or \"interleaved\", got \"", std::string(layout), "\"");
}

math::ClampParams for_dtype(const math::ClampParams& p, at::ScalarType dtype) {
  math::ClampParams q = p;
  if (dtype == at::kHalf) q.limit = static_cast<double>(static_cast<c10::Half>(p.limit));
  if (dtype == at::kBFloat16) q.limit = static_cast<double>(static_cast<c10::BFloat16>(p.limit));
  return q;
}

void check_params(const char* op, const math::ClampParams& p) {
  // !(x > 0) also rejects NaN
  TORCH_CHECK_VALUE(p.limit > 0, op, ": `limit` must be > 0, got ", std::to_string(p.limit));
  TORCH_CHECK_VALUE(std::isfinite(p.alpha), op, ": `alpha` must be finite, got ", std::to_string(p.alpha));
  TORCH_CHECK_VALUE(std::isfinite(p.up_offset), op, ": `up_offset` must be finite, got ", std::to_string(p.up_offset));
}

}  // namespace ffn_ext

// ---- the quantizing ops' input checks (quant.h): the unfused ops' own, without their allocation ----
#include "quant.h"

namespace ffn_ext {
namespace quant {
void check_x(const char* op, const at::Tensor& x) { check_input(op, "x", x); }
void check_gated(const char* op, const at::Tensor& gate, const at::Tensor& up) {
  check_input(op, "gate", gate);
  check_like(op, "up", up, "gate", gate);
}
c10::SymInt check_packed(const char* op, const at::Tensor& gate_up) { return ffn_ext::check_packed(op, gate_up); }
}  // namespace quant
}  // namespace ffn_ext
