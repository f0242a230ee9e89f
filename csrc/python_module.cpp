// The pybind11 module ffn_ext._C. Importing it loads the library, which registers the ffn_ext ops with the
// dispatcher (registration.cpp). It adds only what is not an op: build information and the host-math test path.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/extension.h>

#include <string>

#include "ffn_ext.h"
#include "ffn_math.h"

namespace ffn_ext {
namespace {

// Runs functor F element by element on the host, with the kernels' rounding: load storage -> opmath type,
// compute, store opmath -> storage once. Inputs: equal-shape CPU tensors of one floating dtype.
template <typename F>
std::vector<at::Tensor> host_apply(const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK_VALUE(inputs.size() == F::NI, "_host_math: expected ", std::to_string(F::NI), " inputs, got ",
                    std::to_string(inputs.size()));
  std::vector<at::Tensor> ins, outs;
  for (const auto& t : inputs) {
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.sizes() == inputs[0].sizes() &&
                          t.scalar_type() == inputs[0].scalar_type(),
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
      F{}.template apply<math::fast_math_for<scalar_t>()>(a, r);
      for (int o = 0; o < F::NO; ++o) outs[o].data_ptr<scalar_t>()[j] = static_cast<scalar_t>(r[o]);
    }
  });
  return outs;
}

std::vector<at::Tensor> host_math(const std::string& op, const std::vector<at::Tensor>& inputs) {
  if (op == "gelu") return host_apply<math::GeluFwd>(inputs);
  if (op == "gelu_backward") return host_apply<math::GeluBwd>(inputs);
  if (op == "silu") return host_apply<math::SiluFwd>(inputs);
  if (op == "silu_backward") return host_apply<math::SiluBwd>(inputs);
  if (op == "swiglu") return host_apply<math::SwigluFwd>(inputs);
  if (op == "swiglu_backward") return host_apply<math::SwigluBwd>(inputs);
  TORCH_CHECK_VALUE(false, "_host_math: unknown op '", op, "'");
}

}  // namespace
}  // namespace ffn_ext

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ffn_ext native library: importing it registers the torch.ops.ffn_ext ops";
  m.def("build_info", [] {
    pybind11::dict d;
    for (const auto& kv : ffn_ext::build_info()) d[kv.first.c_str()] = kv.second;
    return d;
  }, "What this build contains: CUDA kernels or not, CUDA version, architectures, torch version built against.");
  m.def("_host_math", &ffn_ext::host_math, pybind11::arg("op"), pybind11::arg("inputs"),
        "Test path: the kernels' element math (ffn_math.h) run on the host, element by element.");
}
