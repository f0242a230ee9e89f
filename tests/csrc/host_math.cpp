// ffn_ext_testing's element math on the host: every op's functors (csrc/ffn_math.h, the code the kernels run)
// applied element by element (_host_math), and the FP8 conversion and scale (_host_fp8, _host_quant_scale); the op
// list comes from the op table (ops_table.h). The kernels' whole launches emulated on the host are emulate_rows.cpp
// (_emulate_cuda) and emulate_quant.cpp (_emulate_quant). On the full torch API: part of module.cpp's translation
// unit, which includes no stable header (ffn_ext.h): the element math needs none of the glue.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <map>
#include <string>

#include "ffn_math.h"
#include "ops_table.h"
#include "testing.h"

namespace ffn_ext {
namespace testing {
namespace {

// Runs functor F element by element on the host, with the kernels' rounding: load storage -> opmath type,
// compute, store opmath -> storage once. Inputs: equal-shape CPU tensors of one floating dtype.
template <typename F>
std::vector<at::Tensor> host_apply(const F& f, const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK_VALUE(inputs.size() == F::NI, "_host_math: expected ", std::to_string(F::NI), " inputs, got ",
                    std::to_string(inputs.size()));
  std::vector<at::Tensor> ins, outs;
  for (const auto& t : inputs) {
    TORCH_CHECK_VALUE(
        t.device().is_cpu() && t.sizes() == inputs[0].sizes() && t.scalar_type() == inputs[0].scalar_type(),
        "_host_math: inputs must be CPU tensors of one shape and dtype");
    ins.push_back(t.contiguous());
  }
  for (int o = 0; o < F::NO; ++o) outs.push_back(at::empty_like(ins[0]));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, ins[0].scalar_type(), "ffn_ext_host_math", [&] {
    using A = at::opmath_type<scalar_t>;
    const int64_t n = ins[0].numel();
    for (int64_t j = 0; j < n; ++j) {
      A a[F::NI], r[F::NO];
      for (int i = 0; i < F::NI; ++i) a[i] = static_cast<A>(ins[i].data_ptr<scalar_t>()[j]);
      f.template apply<math::fast_math_for<scalar_t>()>(a, r);
      for (int o = 0; o < F::NO; ++o) outs[o].data_ptr<scalar_t>()[j] = static_cast<scalar_t>(r[o]);
    }
  });
  return outs;
}

// The storage dtype of a host_math call (its inputs' checked in host_apply), for the kernels' parameters (for_dtype).
at::ScalarType dtype_of(const std::vector<at::Tensor>& in) { return in.empty() ? at::kFloat : in[0].scalar_type(); }

// The functor of every op of the table whose inputs all have one shape (the packed ops run GatedFwd/GatedBwd too).
std::vector<at::Tensor> host_math(const std::string& op, const std::vector<at::Tensor>& inputs, const Doubles& params) {
  using V = std::vector<at::Tensor>;
  using Run = V (*)(const std::string&, const V&, const Doubles&);
  static const std::map<std::string, Run> ops = {
#define FFN_EXT_HOST_ACT(name, Act, ...) \
  {#name, \
   [](const std::string& op, const V& in, const Doubles& prm) { \
     params_from<math::NoParams>(op, prm); \
     return host_apply(math::UnaryFwd<math::Act>{}, in); \
   }}, \
      {#name "_backward", \
       [](const std::string& op, const V& in, const Doubles& prm) { \
         params_from<math::NoParams>(op, prm); \
         return host_apply(math::UnaryBwd<math::Act>{}, in); \
       }}, \
      {#name "_backward_recompute", [](const std::string& op, const V& in, const Doubles& prm) { \
         params_from<math::NoParams>(op, prm); \
         return host_apply(math::UnaryBwdRecompute<math::Act>{}, in); \
       }},
#define FFN_EXT_HOST_GATED(name, Gate, P) \
  {#name, \
   [](const std::string& op, const V& in, const Doubles& prm) { \
     using G = math::Gate; \
     return host_apply(math::GatedFwd<G>(G(params_for(params_from<G::Params>(op, prm), dtype_of(in)))), in); \
   }}, \
      {#name "_backward", \
       [](const std::string& op, const V& in, const Doubles& prm) { \
         using G = math::Gate; \
         return host_apply(math::GatedBwd<G>(G(params_for(params_from<G::Params>(op, prm), dtype_of(in)))), in); \
       }}, \
      {#name "_backward_recompute", [](const std::string& op, const V& in, const Doubles& prm) { \
         using G = math::Gate; \
         return host_apply(math::GatedBwdRecompute<G>(G(params_for(params_from<G::Params>(op, prm), dtype_of(in)))), \
                           in); \
       }},
      FFN_EXT_ACTIVATIONS(FFN_EXT_HOST_ACT) FFN_EXT_GATED(FFN_EXT_HOST_GATED)
#undef FFN_EXT_HOST_ACT
#undef FFN_EXT_HOST_GATED
  };
  const auto it = ops.find(op);
  TORCH_CHECK_VALUE(it != ops.end(), "_host_math: unknown op '", op, "'");
  return it->second(op, inputs, params);
}

// ---- the quantizing ops' element math on the host (ffn_math.h's FP8 section), for tests/test_quant_math.py ----
at::Tensor host_fp8(const at::Tensor& x, const std::string& format) {
  TORCH_CHECK_VALUE(format == "e4m3fn" || format == "e5m2", "_host_fp8: format must be e4m3fn or e5m2");
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat, "_host_fp8: x must be a float32 CPU tensor");
  const auto in = x.contiguous();
  auto out = at::empty(in.sizes(), in.options().dtype(at::kByte));
  const float* p = in.data_ptr<float>();
  uint8_t* o = out.data_ptr<uint8_t>();
  for (int64_t i = 0; i < in.numel(); ++i) o[i] = format == "e4m3fn" ? math::to_e4m3fn(p[i]) : math::to_e5m2(p[i]);
  return out;
}
at::Tensor host_quant_scale(const at::Tensor& amax, double fp8_max, bool pow2) {
  TORCH_CHECK_VALUE(amax.device().is_cpu() && amax.scalar_type() == at::kFloat,
                    "_host_quant_scale: amax must be a float32 CPU tensor");
  const auto in = amax.contiguous();
  auto out = at::empty_like(in);
  for (int64_t i = 0; i < in.numel(); ++i)
    out.data_ptr<float>()[i] = math::quant_scale(in.data_ptr<float>()[i], static_cast<float>(fp8_max), pow2);
  return out;
}
}  // namespace

void add_host_math(pybind11::module& m) {
  m.def(
      "_host_math",
      [](const std::string& op, const std::vector<at::Tensor>& inputs, const Doubles& params) {
        try {
          return host_math(op, inputs, params);
        } catch (const UsageError& e) {  // params_from's: a ValueError, as this function's own checks
          throw pybind11::value_error(e.what());
        }
      },
      pybind11::arg("op"), pybind11::arg("inputs"), pybind11::arg("params") = Doubles{},
      "The kernels' element math (ffn_math.h) run on the host, element by element.");
  m.def("_host_fp8", &host_fp8, pybind11::arg("x"), pybind11::arg("format"),
        "ffn_math.h's float -> fp8 conversion (codes as uint8) on the host.");
  m.def("_host_quant_scale", &host_quant_scale, pybind11::arg("amax"), pybind11::arg("fp8_max"), pybind11::arg("pow2"),
        "ffn_math.h's scale of a group from its amax, on the host.");
}
}  // namespace testing
}  // namespace ffn_ext
