// The quantizing ops (FP8 outputs with their scales): the recipe as schema arguments, its checks, the outputs'
// allocation and the ATen composite of the formula (ffn_ext/quant.py documents it; quant.cpp implements these).
// Ops, from the table (ops_table.h): <gated>_quant(gate, up, *, recipe, params) and <gated>_packed_quant(gate_up,
// *, recipe, params, layout) for every gated op, and quantize(x, *, recipe); each returns (q, scale).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <utility>
#include <vector>

#include "ffn_ext.h"

// The recipe's schema arguments, their C++ parameters and their names (to pass them on).
#define FFN_EXT_QUANT_SCHEMA \
  "ScalarType dtype, str scaling, int group_size, bool pow2_scales, ScalarType scale_dtype, str scale_layout, " \
  "float? static_scale"
#define FFN_EXT_QUANT_DECL \
  at::ScalarType dtype, c10::string_view scaling, int64_t group_size, bool pow2_scales, at::ScalarType scale_dtype, \
      c10::string_view scale_layout, std::optional<double> static_scale
#define FFN_EXT_QUANT_ARGS dtype, scaling, group_size, pow2_scales, scale_dtype, scale_layout, static_scale

namespace ffn_ext {
namespace quant {

enum class Scaling { kTensor, kRow, kGroup };

struct Recipe {
  at::ScalarType dtype;  // kFloat8_e4m3fn or kFloat8_e5m2
  Scaling scaling;
  int64_t group_size;                  // kGroup: 32, 64 or 128
  bool pow2;                           // scales rounded up to a power of two
  at::ScalarType scale_dtype;          // kFloat or kFloat8_e8m0fnu (pow2 only)
  bool column;                         // scale_layout "column": the rows' index varies fastest
  std::optional<double> static_scale;  // kTensor: given, finite and > 0
  float fp8_max() const { return dtype == at::kFloat8_e4m3fn ? 448.0f : 57344.0f; }
};

// The recipe from the schema arguments; a bad one is a ValueError / TypeError naming the argument.
Recipe parse_recipe(const char* op, FFN_EXT_QUANT_DECL);

// Checks h's sizes against the recipe (group_size divides the last dim; at least 1 dim unless per tensor) and
// allocates (q, scale): q contiguous in the recipe's fp8 dtype, scale [] / [..., 1] / [..., K / group_size] in
// scale_dtype and scale_layout. `ref` gives the device.
std::pair<at::Tensor, at::Tensor> alloc_quant(const char* op, const at::Tensor& ref, c10::SymIntArrayRef h_sizes,
                                              const Recipe& r);

// The formula with ATen ops into the allocated q and scale (the CPU kernels; the same ops as quant.py's reference).
void quantize_aten(const at::Tensor& h, const Recipe& r, const at::Tensor& q, const at::Tensor& scale);

// The input checks of the unfused ops (shapes.cpp), for the quantizing ops that do not allocate their h.
void check_x(const char* op, const at::Tensor& x);
void check_gated(const char* op, const at::Tensor& gate, const at::Tensor& up);
c10::SymInt check_packed(const char* op, const at::Tensor& gate_up);  // returns M of [..., 2M]

// The checks and allocation every kernel of an op starts with (the Meta kernels are exactly these), for quantize,
// <gated>_quant and <gated>_packed_quant: the parameters, the inputs, then alloc_quant for h's shape.
inline std::pair<at::Tensor, at::Tensor> alloc_x(const char* op, const Recipe& r, const at::Tensor& x) {
  check_x(op, x);
  return alloc_quant(op, x, x.sym_sizes(), r);
}
template <class Prm>
std::pair<at::Tensor, at::Tensor> alloc_gated(const char* op, const Prm& prm, const Recipe& r, const at::Tensor& gate,
                                              const at::Tensor& up) {
  check_params(op, prm);
  check_gated(op, gate, up);
  return alloc_quant(op, gate, gate.sym_sizes(), r);
}
template <class Prm>
std::pair<at::Tensor, at::Tensor> alloc_packed(const char* op, const Prm& prm, const Recipe& r,
                                               const at::Tensor& gate_up, c10::string_view layout) {
  check_params(op, prm);
  parse_layout(op, layout);
  const auto m = check_packed(op, gate_up);
  std::vector<c10::SymInt> sizes(gate_up.sym_sizes().begin(), gate_up.sym_sizes().end());
  sizes.back() = m;
  return alloc_quant(op, gate_up, sizes, r);
}

}  // namespace quant
}  // namespace ffn_ext
