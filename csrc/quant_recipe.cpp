// The quantizing ops' recipe and outputs (quant.h): parse_recipe (the recipe's checks), alloc_quant (q and scale
// for h's shape) and quantize_aten (the ATen composite of ffn_ext/quant.py's formula: the CPU kernels, and the
// device's for float64). No registration here (quant.cpp has it), so that the tests' host-code extension
// (tests/native.py) compiles this file into itself.
#include "quant.h"

#include <ATen/ATen.h>

#include <cfloat>
#include <cmath>
#include <string>

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

}  // namespace quant
}  // namespace ffn_ext
