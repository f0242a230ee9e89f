// The quantizing ops' recipe and outputs (quant.h): parse_recipe (the recipe's checks) and alloc_quant (q and
// scale for h's shape, allocated through the C shim by dtype code, so float8_e8m0fnu scales work at the 2.10
// target). Compiled into libffn_ext_cuda.so through cuda/ops.cpp.
#include "quant.h"

#include <cmath>
#include <string>

namespace ffn_ext {
namespace quant {

Recipe parse_recipe(const char* op, FFN_EXT_QUANT_DECL) {
  Recipe r{};
  const auto dt = static_cast<ScalarType>(dtype), sdt = static_cast<ScalarType>(scale_dtype);
  FFN_EXT_CHECK_TYPE(dt == ScalarType::Float8_e4m3fn || dt == ScalarType::Float8_e5m2, op,
                     ": `dtype` must be torch.float8_e4m3fn or torch.float8_e5m2, got ",
                     torch::headeronly::toString(dt));
  r.dtype = dt;
  if (scaling == "tensor")
    r.scaling = Scaling::kTensor;
  else if (scaling == "row")
    r.scaling = Scaling::kRow;
  else if (scaling == "group")
    r.scaling = Scaling::kGroup;
  else
    detail::fail("[ValueError] ", op, ": `scaling` must be \"tensor\", \"row\" or \"group\", got \"", scaling, "\"");
  FFN_EXT_CHECK_VALUE(r.scaling != Scaling::kGroup || group_size == 32 || group_size == 64 || group_size == 128, op,
                      ": `group_size` must be 32, 64 or 128 (elements per group along the last dim), got ",
                      std::to_string(group_size));
  r.group_size = group_size;
  r.pow2 = pow2_scales;
  FFN_EXT_CHECK_TYPE(sdt == ScalarType::Float || sdt == ScalarType::Float8_e8m0fnu, op,
                     ": `scale_dtype` must be torch.float32 or torch.float8_e8m0fnu, got ",
                     torch::headeronly::toString(sdt));
  FFN_EXT_CHECK_VALUE(sdt == ScalarType::Float || pow2_scales, op,
                      ": `scale_dtype`=torch.float8_e8m0fnu holds powers of two only: it needs pow2_scales=True");
  r.scale_dtype = sdt;
  FFN_EXT_CHECK_VALUE(scale_layout == "row" || scale_layout == "column", op,
                      ": `scale_layout` must be \"row\" or \"column\", got \"", scale_layout, "\"");
  r.column = scale_layout == "column";
  FFN_EXT_CHECK_VALUE(!r.column || r.scaling != Scaling::kTensor, op,
                      ": `scale_layout`=\"column\" is for scaling=\"row\" or \"group\"; a per-tensor scale has no ",
                      "layout");
  if (static_scale) {
    FFN_EXT_CHECK_VALUE(r.scaling == Scaling::kTensor, op, ": `static_scale` is for scaling=\"tensor\", got scaling=\"",
                        scaling, "\"");
    FFN_EXT_CHECK_VALUE(std::isfinite(*static_scale) && *static_scale > 0, op,
                        ": `static_scale` must be a finite number > 0, got ", std::to_string(*static_scale));
  }
  r.static_scale = static_scale;
  return r;
}

std::pair<Tensor, Tensor> alloc_quant(const char* op, const Tensor& ref, const std::vector<int64_t>& h_sizes,
                                      const Recipe& r) {
  Tensor q = empty_strided(ref, h_sizes, contiguous_strides(h_sizes), r.dtype);
  if (r.scaling == Scaling::kTensor) return {q, empty_strided(ref, {}, {}, r.scale_dtype)};
  FFN_EXT_CHECK_VALUE(!h_sizes.empty(), op, ": scaling=\"", r.scaling == Scaling::kRow ? "row" : "group",
                      "\" needs h with at least 1 dimension ([..., K]), got a 0-dim tensor");
  const int64_t k = h_sizes.back();
  int64_t n = 1;
  if (r.scaling == Scaling::kGroup) {
    FFN_EXT_CHECK_VALUE(k % r.group_size == 0, op, ": `group_size`=", std::to_string(r.group_size),
                        " must divide the last dimension of h, got ", std::to_string(k));
    n = k / r.group_size;
  }
  std::vector<int64_t> sizes(h_sizes);
  sizes.back() = n;
  if (!r.column) return {q, empty_strided(ref, sizes, contiguous_strides(sizes), r.scale_dtype)};
  // column: the strides of a contiguous [n, ...] viewed as [..., n], so the rows' index varies fastest (what
  // at::empty({n, ...}).permute(1, ..., 0) gave)
  std::vector<int64_t> buf{n};
  buf.insert(buf.end(), h_sizes.begin(), h_sizes.end() - 1);
  const auto bst = contiguous_strides(buf);
  std::vector<int64_t> strides(bst.begin() + 1, bst.end());
  strides.push_back(bst[0]);
  return {q, empty_strided(ref, sizes, strides, r.scale_dtype)};
}

}  // namespace quant
}  // namespace ffn_ext
