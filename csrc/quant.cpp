// The quantizing ops (quant.h): schemas from the table, the recipe's checks, and the Meta, CPU and Autograd
// kernels. The CPU kernels compute h with ffn_ext's own unfused op (through the dispatcher, so h is bit for bit
// what that op returns on the device) and quantize it with the ATen composite of ffn_ext/quant.py's formula.
// The CUDA kernels are in cuda/quant_part*.cu (registered by cuda/ops.cpp). Kept in one file of its own, a TORCH_LIBRARY_FRAGMENT next to
// registration.cpp's TORCH_LIBRARY, so that the table's other users need no change for it.
#include "quant.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cfloat>
#include <string>

#include "ffn_ext.h"
#include "ops_table.h"

namespace ffn_ext {
namespace quant {

constexpr double kAmaxFloor = 1e-12;  // as float32 (quant.py AMAX_FLOOR)

Recipe parse_recipe(const char* op, FFN_EXT_QUANT_DECL) {
  Recipe r{};
  TORCH_CHECK_TYPE(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2, op,
                   ": `dtype` must be torch.float8_e4m3fn or torch.float8_e5m2, got ", c10::toString(dtype));
  r.dtype = dtype;
  if (scaling == "tensor")
    r.scaling = Scaling::kTensor;
  else if (scaling == "row")
    r.scaling = Scaling::kRow;
  else if (scaling == "group")
    r.scaling = Scaling::kGroup;
  else
    TORCH_CHECK_VALUE(false, op, ": `scaling` must be \"tensor\", \"row\" or \"group\", got \"", std::string(scaling),
                      "\"");
  TORCH_CHECK_VALUE(r.scaling != Scaling::kGroup || group_size == 32 || group_size == 64 || group_size == 128, op,
                    ": `group_size` must be 32, 64 or 128 (elements per group along the last dim), got ",
                    std::to_string(group_size));
  r.group_size = group_size;
  r.pow2 = pow2_scales;
  TORCH_CHECK_TYPE(scale_dtype == at::kFloat || scale_dtype == at::kFloat8_e8m0fnu, op,
                   ": `scale_dtype` must be torch.float32 or torch.float8_e8m0fnu, got ", c10::toString(scale_dtype));
  TORCH_CHECK_VALUE(scale_dtype == at::kFloat || pow2_scales, op,
                    ": `scale_dtype`=torch.float8_e8m0fnu holds powers of two only: it needs pow2_scales=True");
  r.scale_dtype = scale_dtype;
  TORCH_CHECK_VALUE(scale_layout == "row" || scale_layout == "column", op,
                    ": `scale_layout` must be \"row\" or \"column\", got \"", std::string(scale_layout), "\"");
  r.column = scale_layout == "column";
  TORCH_CHECK_VALUE(!r.column || r.scaling != Scaling::kTensor, op,
                    ": `scale_layout`=\"column\" is for scaling=\"row\" or \"group\"; a per-tensor scale has no ",
                    "layout");
  if (static_scale) {
    TORCH_CHECK_VALUE(r.scaling == Scaling::kTensor, op, ": `static_scale` is for scaling=\"tensor\", got scaling=\"",
                      std::string(scaling), "\"");
    TORCH_CHECK_VALUE(std::isfinite(*static_scale) && *static_scale > 0, op,
                      ": `static_scale` must be a finite number > 0, got ", std::to_string(*static_scale));
  }
  r.static_scale = static_scale;
  return r;
}

std::pair<at::Tensor, at::Tensor> alloc_quant(const char* op, const at::Tensor& ref, c10::SymIntArrayRef h_sizes,
                                              const Recipe& r) {
  auto q = at::empty_symint(h_sizes, ref.options().dtype(r.dtype));
  const auto sopt = ref.options().dtype(r.scale_dtype);
  if (r.scaling == Scaling::kTensor) return {q, at::empty({}, sopt)};
  TORCH_CHECK_VALUE(!h_sizes.empty(), op, ": scaling=\"", r.scaling == Scaling::kRow ? "row" : "group",
                    "\" needs h with at least 1 dimension ([..., K]), got a 0-dim tensor");
  const c10::SymInt& k = h_sizes.back();
  c10::SymInt n = 1;
  if (r.scaling == Scaling::kGroup) {
    TORCH_CHECK_VALUE(k % r.group_size == 0, op, ": `group_size`=", std::to_string(r.group_size),
                      " must divide the last dimension of h, got ",
                      k.maybe_as_int() ? std::to_string(*k.maybe_as_int()) : k.toSymNode()->str());
    n = k / r.group_size;
  }
  const int64_t d = static_cast<int64_t>(h_sizes.size());
  if (!r.column) {
    std::vector<c10::SymInt> sizes(h_sizes.begin(), h_sizes.end());
    sizes.back() = n;
    return {q, at::empty_symint(sizes, sopt)};
  }
  // column: allocated as [n, ...] and viewed as [..., n], so the rows' index varies fastest
  std::vector<c10::SymInt> sizes{n};
  sizes.insert(sizes.end(), h_sizes.begin(), h_sizes.end() - 1);
  std::vector<int64_t> perm;
  for (int64_t i = 1; i < d; ++i) perm.push_back(i);
  perm.push_back(0);
  return {q, at::empty_symint(sizes, sopt).permute(perm)};
}

void quantize_aten(const at::Tensor& h, const Recipe& r, const at::Tensor& q, const at::Tensor& scale) {
  const double fmax = r.fp8_max();
  const auto x = h.to(at::kFloat);
  at::Tensor s, groups;
  if (r.scaling == Scaling::kTensor) {
    if (r.static_scale) {
      s = at::scalar_tensor(*r.static_scale, x.options());
    } else {
      const auto amax = x.numel() ? x.abs().amax() : at::zeros({}, x.options());
      s = amax.clamp(kAmaxFloor, FLT_MAX) / fmax;
    }
    groups = x.reshape({1, -1});
  } else {
    const int64_t k = x.size(-1);
    const int64_t g = r.scaling == Scaling::kGroup ? r.group_size : k;
    const int64_t rows = k ? x.numel() / k : c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);
    groups = x.reshape({rows, g ? k / g : 1, g});
    const auto amax = g ? groups.abs().amax(-1) : at::zeros({rows, 1}, x.options());
    s = amax.clamp(kAmaxFloor, FLT_MAX) / fmax;
  }
  if (r.pow2) {  // 2^ceil(log2 s): the mantissa rounded up, exactly (s is positive and normal, or NaN)
    const auto up = at::bitwise_and(s.view(at::kInt) + 0x7FFFFF, 0x7F800000).view(at::kFloat);
    s = at::where(at::isnan(s), s, up);
  }
  const auto inv = at::reciprocal(s);
  const auto scaled = r.scaling == Scaling::kTensor ? groups * inv : groups * inv.unsqueeze(-1);
  const auto clamped = scaled.clamp(-fmax, fmax);
  const auto nan_code = at::scalar_tensor(0x7F, clamped.options().dtype(at::kByte));  // canonical NaN (quant.py)
  const auto codes = at::where(at::isnan(clamped), nan_code, clamped.to(r.dtype).view(at::kByte));
  q.copy_(codes.view(r.dtype).view(q.sizes()));
  scale.copy_(s.to(r.scale_dtype).view(scale.sizes()));
}

namespace {

using T = const at::Tensor&;
using Out = std::tuple<at::Tensor, at::Tensor>;

// Refuses inputs that require grad under grad mode (these ops are not differentiable), then runs the kernel
// below autograd: one boxed kernel for every quantizing op.
void no_grad_kernel(const c10::OperatorHandle& opr, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto& args = opr.schema().arguments();
  if (at::GradMode::is_enabled()) {
    for (size_t i = 0; i < args.size(); ++i) {
      const auto& v = (*stack)[stack->size() - args.size() + i];
      TORCH_CHECK(!(v.isTensor() && v.toTensor().defined() && v.toTensor().requires_grad()), "ffn_ext.",
                  opr.schema().name().substr(9), ": `", args[i].name(), "` requires grad; the quantizing ops are ",
                  "forward only (not differentiable): call them under torch.no_grad() or on detached tensors");
    }
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  opr.redispatchBoxed(ks & c10::after_ADInplaceOrView_keyset, stack);
}

// The unfused op's handle, looked up once: ffn_ext::<name> with the C++ signature Sig.
template <class Sig>
c10::TypedOperatorHandle<Sig> unfused(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

void impl_composite(torch::Library& m) {
#define FFN_EXT_QUANT_CPU(name, Gate, P) \
  m.impl(#name "_quant", [](T gate, T up, FFN_EXT_QUANT_DECL FFN_EXT_P_DECL_##P) -> Out { \
    const char* op = "ffn_ext." #name "_quant"; \
    const Recipe r = parse_recipe(op, FFN_EXT_QUANT_ARGS); \
    auto [q, s] = alloc_gated(op, FFN_EXT_P_MAKE_##P, r, gate, up); \
    static const auto h_op = unfused<at::Tensor(T, T FFN_EXT_P_DECL_##P)>("ffn_ext::" #name); \
    quantize_aten(h_op.call(gate, up FFN_EXT_P_ARGS_##P), r, q, s); \
    return {q, s}; \
  }); \
  m.impl(#name "_packed_quant", [](T gu, FFN_EXT_QUANT_DECL FFN_EXT_P_DECL_##P, c10::string_view layout) -> Out { \
    const char* op = "ffn_ext." #name "_packed_quant"; \
    const Recipe r = parse_recipe(op, FFN_EXT_QUANT_ARGS); \
    auto [q, s] = alloc_packed(op, FFN_EXT_P_MAKE_##P, r, gu, layout); \
    static const auto h_op = unfused<at::Tensor(T FFN_EXT_P_DECL_##P, c10::string_view)>("ffn_ext::" #name "_packed"); \
    quantize_aten(h_op.call(gu FFN_EXT_P_ARGS_##P, layout), r, q, s); \
    return {q, s}; \
  });
  FFN_EXT_GATED(FFN_EXT_QUANT_CPU)
#undef FFN_EXT_QUANT_CPU
  m.impl("quantize", [](T x, FFN_EXT_QUANT_DECL) -> Out {
    const Recipe r = parse_recipe("ffn_ext.quantize", FFN_EXT_QUANT_ARGS);
    auto [q, s] = alloc_x("ffn_ext.quantize", r, x);
    quantize_aten(x, r, q, s);
    return {q, s};
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ffn_ext, m) {
#define FFN_EXT_QUANT_DEF(name, Gate, P) \
  m.def(#name "_quant(Tensor gate, Tensor up, *, " FFN_EXT_QUANT_SCHEMA FFN_EXT_P_SCHEMA_##P ") -> (Tensor, Tensor)"); \
  m.def(#name "_packed_quant(Tensor gate_up, *, " FFN_EXT_QUANT_SCHEMA FFN_EXT_P_SCHEMA_##P \
        ", str layout=\"concat\") -> (Tensor, Tensor)");
  FFN_EXT_GATED(FFN_EXT_QUANT_DEF)  // [..., M] x2 -> q [..., M], scale; [..., 2M] -> q [..., M], scale
#undef FFN_EXT_QUANT_DEF
  m.def("quantize(Tensor x, *, " FFN_EXT_QUANT_SCHEMA ") -> (Tensor, Tensor)");  // [..., K] -> q [..., K], scale
}

TORCH_LIBRARY_IMPL(ffn_ext, Meta, m) {
#define FFN_EXT_QUANT_META(name, Gate, P) \
  m.impl(#name "_quant", [](T gate, T up, FFN_EXT_QUANT_DECL FFN_EXT_P_DECL_##P) -> Out { \
    const char* op = "ffn_ext." #name "_quant"; \
    auto [q, s] = alloc_gated(op, FFN_EXT_P_MAKE_##P, parse_recipe(op, FFN_EXT_QUANT_ARGS), gate, up); \
    return {q, s}; \
  }); \
  m.impl(#name "_packed_quant", [](T gu, FFN_EXT_QUANT_DECL FFN_EXT_P_DECL_##P, c10::string_view layout) -> Out { \
    const char* op = "ffn_ext." #name "_packed_quant"; \
    auto [q, s] = alloc_packed(op, FFN_EXT_P_MAKE_##P, parse_recipe(op, FFN_EXT_QUANT_ARGS), gu, layout); \
    return {q, s}; \
  });
  FFN_EXT_GATED(FFN_EXT_QUANT_META)
#undef FFN_EXT_QUANT_META
  m.impl("quantize", [](T x, FFN_EXT_QUANT_DECL) -> Out {
    auto [q, s] = alloc_x("ffn_ext.quantize", parse_recipe("ffn_ext.quantize", FFN_EXT_QUANT_ARGS), x);
    return {q, s};
  });
}

TORCH_LIBRARY_IMPL(ffn_ext, Autograd, m) {
#define FFN_EXT_QUANT_AUTOGRAD(name, Gate, P) \
  m.impl(#name "_quant", torch::CppFunction::makeFromBoxedFunction<&no_grad_kernel>()); \
  m.impl(#name "_packed_quant", torch::CppFunction::makeFromBoxedFunction<&no_grad_kernel>());
  FFN_EXT_GATED(FFN_EXT_QUANT_AUTOGRAD)
#undef FFN_EXT_QUANT_AUTOGRAD
  m.impl("quantize", torch::CppFunction::makeFromBoxedFunction<&no_grad_kernel>());
}

TORCH_LIBRARY_IMPL(ffn_ext, CPU, m) { impl_composite(m); }
#ifndef FFN_EXT_WITH_CUDA
// No CUDA kernels in this build: CUDA tensors take the composite (the unfused op warns once that the build has
// no CUDA kernels).
TORCH_LIBRARY_IMPL(ffn_ext, CUDA, m) { impl_composite(m); }
#endif

}  // namespace quant
}  // namespace ffn_ext
