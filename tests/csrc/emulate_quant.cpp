// ffn_ext_testing's _emulate_quant: the quantizing kernels' launches emulated on the host (quant_kernel.h's per-lane
// and per-thread code, block by block, through quant_ops.h's QuantOps as on the device).
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "quant_ops.h"
#include "testing.h"

namespace ffn_ext {
namespace testing {
namespace {
struct HostQuant {
  struct Guard {
    explicit Guard(const c10::Device&) {}
  };
  // The outputs poisoned first (q bytes 0xA5, scales 12345.0f or e8m0 0x5A: values the formula never gives for
  // these tests' data), so that an element or scale the emulated kernels never write fails the comparison.
  template <typename T, class F, bool Pair>
  static void run(const quant::QuantProblem& p, const F& f) {
    std::memset(p.q, 0xA5, static_cast<size_t>(p.rows * p.cols));
    const int64_t per_row =
        p.scaling == quant::QScaling::kGroup ? p.cols / (quant::kLaneElems * quant::kGroupChunks * p.lanes) : 1;
    const int64_t rows = p.scaling == quant::QScaling::kTensor ? 1 : p.rows;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < per_row; ++g) {
        const int64_t at = r * p.scale_row + g * p.scale_col;
        if (p.e8m0) {
          static_cast<uint8_t*>(p.scale)[at] = 0x5A;
        } else {
          static_cast<float*>(p.scale)[at] = 12345.0f;
        }
      }
    }
    quant::emulate<T, F, Pair>(p, f);
  }
};

std::vector<at::Tensor> emulate_quant(const std::string& op, const std::vector<at::Tensor>& in, const Doubles& params,
                                      const std::string& layout, const std::string& format, int64_t group_size,
                                      bool pow2, bool e8m0, bool column, const std::string& scaling,
                                      std::optional<double> static_scale) {
  using Q = quant::QuantOps<HostQuant>;
  const auto r =
      quant::parse_recipe(op.c_str(), format == "e5m2" ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn, scaling, group_size,
                          pow2, e8m0 ? at::kFloat8_e8m0fnu : at::kFloat, column ? "column" : "row", static_scale);
  for (const auto& t : in) TORCH_CHECK_VALUE(t.device().is_cpu(), "_emulate_quant: inputs must be CPU tensors");
  const auto no_composite = []() -> at::Tensor {
    TORCH_CHECK(false, "_emulate_quant: this recipe and dtype run the composite, not the kernel");
  };
  std::tuple<at::Tensor, at::Tensor> out;
  if (op == "quantize") {
    TORCH_CHECK_VALUE(in.size() == 1, "_emulate_quant: quantize takes 1 input");
    out = Q::quantize(r, in[0]);
  }
#define FFN_EXT_EMU_QUANT(name, Gate, P) \
  else if (op == #name "_quant") { \
    TORCH_CHECK_VALUE(in.size() == 2, "_emulate_quant: " #name "_quant takes 2 inputs"); \
    out = \
        Q::gated<math::Gate>(op.c_str(), params_from<math::Gate::Params>(op, params), r, in[0], in[1], no_composite); \
  } \
  else if (op == #name "_packed_quant") { \
    TORCH_CHECK_VALUE(in.size() == 1, "_emulate_quant: " #name "_packed_quant takes 1 input"); \
    out = Q::packed<math::Gate>(op.c_str(), params_from<math::Gate::Params>(op, params), r, in[0], layout, \
                                no_composite); \
  }
  FFN_EXT_GATED(FFN_EXT_EMU_QUANT)
#undef FFN_EXT_EMU_QUANT
  else TORCH_CHECK_VALUE(false, "_emulate_quant: unknown op '", op, "'");
  return {std::get<0>(out), std::get<1>(out)};
}
}  // namespace

void add_quant_emulation(pybind11::module& m) {
  m.def("_emulate_quant", &emulate_quant, pybind11::arg("op"), pybind11::arg("inputs"),
        pybind11::arg("params") = Doubles{}, pybind11::arg("layout") = "concat", pybind11::arg("format") = "e4m3fn",
        pybind11::arg("group_size") = 128, pybind11::arg("pow2") = false, pybind11::arg("e8m0") = false,
        pybind11::arg("column") = false, pybind11::arg("scaling") = "group",
        pybind11::arg("static_scale") = std::optional<double>{},
        "A quantizing op's CUDA launches (quant_kernel.h's per-lane and per-thread code: the group, row "
        "and tensor kernels, block by block and thread by thread) emulated on the host with CPU tensors.");
}
}  // namespace testing
}  // namespace ffn_ext
