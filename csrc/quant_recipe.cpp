// The quantizing ops' recipe and outputs (quant.h): parse_recipe (the recipe's guard) and alloc_quant (q and
// scale for h's shape, allocated through the C shim by dtype code, so float8_e8m0fnu scales work at the 2.10
// target). Compiled into libffn_ext_cuda.so through cuda/ops.cpp.
#include "quant.h"

#include <cmath>
#include <string>

namespace ffn_ext {
namespace quant {

Recipe parse_recipe(const char* op, FFN_EXT_QUANT_DECL) {
  // guards of what the kernels take; QuantRecipe (ffn_ext/quant.py) owns the rules and their messages
  Recipe r{};
  r.dtype = static_cast<ScalarType>(dtype);
  r.scale_dtype = static_cast<ScalarType>(scale_dtype);
  r.scaling = scaling == "tensor" ? Scaling::kTensor : scaling == "row" ? Scaling::kRow : Scaling::kGroup;
  r.group_size = group_size;
  r.pow2 = pow2_scales;
  r.column = scale_layout == "column";
  r.static_scale = static_scale;
  const bool ok =
      (r.dtype == ScalarType::Float8_e4m3fn || r.dtype == ScalarType::Float8_e5m2) &&
      (scaling == "tensor" || scaling == "row" || scaling == "group") &&
      (r.scaling != Scaling::kGroup || group_size == 32 || group_size == 64 || group_size == 128) &&
      (r.scale_dtype == ScalarType::Float || (r.scale_dtype == ScalarType::Float8_e8m0fnu && pow2_scales)) &&
      (scale_layout == "row" || (r.column && r.scaling != Scaling::kTensor)) &&
      (!static_scale || (r.scaling == Scaling::kTensor && std::isfinite(*static_scale) && *static_scale > 0));
  FFN_EXT_CHECK(ok, op, ": not a recipe of ffn_ext.QuantRecipe");
  return r;
}

std::pair<Tensor, Tensor> alloc_quant(const char* op, const Tensor& ref, const std::vector<int64_t>& h_sizes,
                                      const Recipe& r) {
  Tensor q = empty_strided(ref, h_sizes, contiguous_strides(h_sizes), r.dtype);
  if (r.scaling == Scaling::kTensor) return {q, empty_strided(ref, {}, {}, r.scale_dtype)};
  FFN_EXT_CHECK(!h_sizes.empty(), op, ": a row or group scaling needs h of at least 1 dimension");
  const int64_t k = h_sizes.back();
  int64_t n = 1;
  if (r.scaling == Scaling::kGroup) {
    FFN_EXT_CHECK(k % r.group_size == 0, op, ": `group_size` must divide the last dimension of h");
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
