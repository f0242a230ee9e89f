// The quantizing ops (FP8 outputs with their scales): the recipe as schema arguments, its checks and the outputs'
// allocation (ffn_ext/quant.py documents the formula; quant_recipe.cpp implements these, shapes.cpp the input
// checks). Ops, from the table (ops_table.h): <gated>_quant(gate, up, *, recipe, params) and
// <gated>_packed_quant(gate_up, *, recipe, params, layout) for every gated op, and quantize(x, *, recipe); each
// returns (q, scale). The ATen formula (CPU, and float64 on CUDA) is Python's (ffn_ext/quant.py), registered with
// the other ops' Python kernels (ffn_ext/_kernels.py).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ffn_ext.h"

// The recipe's schema arguments (ffn_ext/table.py QUANT_RECIPE_SCHEMA) as C++ parameters and their names (to pass
// them on). The ScalarType arguments arrive as c10's int32 enum codes: the stable conversion to ScalarType cannot
// take float8_e8m0fnu at the 2.10 target (docs/internals/stable-abi.md, "What the 2.10 target does not have").
#define FFN_EXT_QUANT_DECL \
  int32_t dtype, const std::string &scaling, int64_t group_size, bool pow2_scales, int32_t scale_dtype, \
      const std::string &scale_layout, std::optional<double> static_scale
#define FFN_EXT_QUANT_ARGS dtype, scaling, group_size, pow2_scales, scale_dtype, scale_layout, static_scale

namespace ffn_ext {
namespace quant {

enum class Scaling { kTensor, kRow, kGroup };

struct Recipe {
  ScalarType dtype;  // Float8_e4m3fn or Float8_e5m2
  Scaling scaling;
  int64_t group_size;                  // kGroup: 32, 64 or 128
  bool pow2;                           // scales rounded up to a power of two
  ScalarType scale_dtype;              // Float or Float8_e8m0fnu (pow2 only)
  bool column;                         // scale_layout "column": the rows' index varies fastest
  std::optional<double> static_scale;  // kTensor: given, finite and > 0
  float fp8_max() const { return dtype == ScalarType::Float8_e4m3fn ? 448.0f : 57344.0f; }
};

// The recipe from the schema arguments, guarded: a recipe QuantRecipe would refuse raises.
Recipe parse_recipe(const char* op, FFN_EXT_QUANT_DECL);

// Checks h's sizes against the recipe (group_size divides the last dim; at least 1 dim unless per tensor) and
// allocates (q, scale): q contiguous in the recipe's fp8 dtype, scale [] / [..., 1] / [..., K / group_size] in
// scale_dtype and scale_layout. `ref` gives the device.
std::pair<Tensor, Tensor> alloc_quant(const char* op, const Tensor& ref, const std::vector<int64_t>& h_sizes,
                                      const Recipe& r);

// The input checks of the unfused ops (shapes.cpp), for the quantizing ops that do not allocate their h.
void check_x(const char* op, const Tensor& x);
void check_gated(const char* op, const Tensor& gate, const Tensor& up);
int64_t check_packed(const char* op, const Tensor& gate_up);  // returns M of [..., 2M]
// The FP8 activation cache's ops (cache_ops.h): group_size (32, 64 or 128) divides gate's last dim M, returned; and
// the cached backward's (grad [..., M], q float8_e4m3fn [..., 2M], scale float32 [..., 2M / G] for such a G), which
// returns G.
int64_t check_cache_group(const char* op, const Tensor& gate, int64_t group);
int64_t check_cache(const char* op, const Tensor& grad, const Tensor& q, const Tensor& scale);

// The checks and allocation every kernel of an op starts with, for quantize, <gated>_quant and
// <gated>_packed_quant: the parameters, the inputs, then alloc_quant for h's shape.
inline std::pair<Tensor, Tensor> alloc_x(const char* op, const Recipe& r, const Tensor& x) {
  check_x(op, x);
  return alloc_quant(op, x, vec(x.sizes()), r);
}
template <class Prm>
std::pair<Tensor, Tensor> alloc_gated(const char* op, const Prm& prm, const Recipe& r, const Tensor& gate,
                                      const Tensor& up) {
  check_params(op, prm);
  check_gated(op, gate, up);
  return alloc_quant(op, gate, vec(gate.sizes()), r);
}
template <class Prm>
std::pair<Tensor, Tensor> alloc_packed(const char* op, const Prm& prm, const Recipe& r, const Tensor& gate_up,
                                       std::string_view layout) {
  check_params(op, prm);
  parse_layout(op, layout);
  const int64_t m = check_packed(op, gate_up);
  auto sizes = vec(gate_up.sizes());
  sizes.back() = m;
  return alloc_quant(op, gate_up, sizes, r);
}

}  // namespace quant
}  // namespace ffn_ext
