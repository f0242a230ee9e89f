// The test-only functions of ffn_ext._C, for CI without a GPU: every op's element math (ffn_math.h) run on the host
// element by element (_host_math), and every op's whole CUDA launch (row_ops.h problem, rows.h launch shape and
// per-thread code) emulated on the host (_emulate_cuda). Both take their op list from ops_table.h.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/extension.h>

#include <cstring>
#include <map>
#include <string>

#include "ffn_ext.h"
#include "ffn_math.h"
#include "ops_table.h"
#include "row_ops.h"

namespace ffn_ext {
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

// A gated op's Params from the test paths' `params` list: [] or [limit, alpha, up_offset].
using Doubles = std::vector<double>;
template <class P> P params_from(const std::string& op, const Doubles& v);
template <> math::NoParams params_from(const std::string& op, const Doubles& v) {
  TORCH_CHECK_VALUE(v.empty(), op, " takes no params, got ", std::to_string(v.size()));
  return {};
}
template <> math::ClampParams params_from(const std::string& op, const Doubles& v) {
  TORCH_CHECK_VALUE(v.size() == 3, op, " takes params [limit, alpha, up_offset], got ", std::to_string(v.size()),
                    " values");
  return {v[0], v[1], v[2]};
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
     return host_apply(math::GatedFwd<G>(G(for_dtype(params_from<G::Params>(op, prm), dtype_of(in)))), in); \
   }}, \
      {#name "_backward", [](const std::string& op, const V& in, const Doubles& prm) { \
         using G = math::Gate; \
         return host_apply(math::GatedBwd<G>(G(for_dtype(params_from<G::Params>(op, prm), dtype_of(in)))), in); \
       }},
      FFN_EXT_ACTIVATIONS(FFN_EXT_HOST_ACT) FFN_EXT_GATED(FFN_EXT_HOST_GATED)
#undef FFN_EXT_HOST_ACT
#undef FFN_EXT_HOST_GATED
  };
  const auto it = ops.find(op);
  TORCH_CHECK_VALUE(it != ops.end(), "_host_math: unknown op '", op, "'");
  return it->second(op, inputs, params);
}

// The CUDA launch emulated on the host: the RowProblem the CUDA kernel would get (row_ops.h), run by rows.h's
// rows_thread for every block and thread of launch_shape's grid for `sms` multiprocessors, one after the other
// (threads share nothing, so the order does not matter). Every element the launch must write is first set to
// all-ones bytes (a NaN no arithmetic produces), so one that no thread writes shows.
struct HostEmulation {
  struct Guard {
    explicit Guard(c10::Device) {}
  };
  static inline thread_local int sms = 132;
  template <typename T, typename F>
  static void run(const F& f, const rows::RowProblem<F::NI, F::NO>& p) {
    constexpr int VEC = 16 / sizeof(T);
    if (p.rows == 0 || p.cols == 0) return;
    for (int o = 0; o < F::NO; ++o) {  // an interleaved pair of outputs: 2 cols from the first's pointer
      if (rows::in_pair(F::kPairOut, o) && o != F::kPairOut) continue;
      for (int64_t r = 0; r < p.rows; ++r) {
        std::memset(static_cast<T*>(p.out[o]) + r * p.out_stride[o], 0xff,
                    rows::step(F::kPairOut, o) * p.cols * sizeof(T));
      }
    }
    const rows::LaunchShape s = rows::launch_shape(p.rows, p.cols, VEC, sms);
    for (int64_t by = 0; by < s.grid_y; ++by) {
      for (int64_t bx = 0; bx < s.grid_x; ++bx) {
        for (int t = 0; t < s.threads; ++t) rows::rows_thread<T, F, VEC>(p, f, {bx, by, s.grid_y, t, s.threads});
      }
    }
  }
};

std::vector<at::Tensor> emulate_cuda(const std::string& op, const std::vector<at::Tensor>& in, int sms,
                                     const Doubles& params, const std::string& layout) {
  using Emu = rows::Ops<HostEmulation>;
  using V = std::vector<at::Tensor>;
  using S = const std::string&;
  struct Entry {
    size_t n_inputs;
    V (*run)(S, const V&, const Doubles&, S);
  };
  static const std::map<std::string, Entry> ops = {
#define FFN_EXT_EMU_ACT(name, Act, ...) \
  {#name, \
   {1, \
    [](S op, const V& a, const Doubles& prm, S) -> V { \
      params_from<math::NoParams>(op, prm); \
      return {Emu::unary<math::Act>(#name, a[0])}; \
    }}}, \
      {#name "_backward", \
       {2, \
        [](S op, const V& a, const Doubles& prm, S) -> V { \
          params_from<math::NoParams>(op, prm); \
          return {Emu::unary_backward<math::Act>(#name, a[0], a[1])}; \
        }}}, \
      {#name "_backward_recompute", {2, [](S op, const V& a, const Doubles& prm, S) -> V { \
                                       params_from<math::NoParams>(op, prm); \
                                       auto [d, h] = Emu::unary_backward_recompute<math::Act>(#name, a[0], a[1]); \
                                       return {d, h}; \
                                     }}},
#define FFN_EXT_EMU_GATED(name, Gate, P) \
  {#name, \
   {2, \
    [](S op, const V& a, const Doubles& prm, S) -> V { \
      return {Emu::gated<math::Gate>(#name, params_from<math::Gate::Params>(op, prm), a[0], a[1])}; \
    }}}, \
      {#name "_backward", \
       {3, \
        [](S op, const V& a, const Doubles& prm, S) -> V { \
          auto [dgate, dup] = \
              Emu::gated_backward<math::Gate>(#name, params_from<math::Gate::Params>(op, prm), a[0], a[1], a[2]); \
          return {dgate, dup}; \
        }}}, \
      {#name "_packed", \
       {1, \
        [](S op, const V& a, const Doubles& prm, S lay) -> V { \
          return {Emu::gated_packed<math::Gate>(#name, params_from<math::Gate::Params>(op, prm), a[0], lay)}; \
        }}}, \
      {#name "_packed_backward", {2, [](S op, const V& a, const Doubles& prm, S lay) -> V { \
                                    return {Emu::gated_packed_backward<math::Gate>( \
                                        #name, params_from<math::Gate::Params>(op, prm), a[0], a[1], lay)}; \
                                  }}},
      FFN_EXT_ACTIVATIONS(FFN_EXT_EMU_ACT) FFN_EXT_GATED(FFN_EXT_EMU_GATED)
#undef FFN_EXT_EMU_ACT
#undef FFN_EXT_EMU_GATED
  };
  const auto it = ops.find(op);
  TORCH_CHECK_VALUE(it != ops.end(), "_emulate_cuda: unknown op '", op, "'");
  TORCH_CHECK_VALUE(in.size() == it->second.n_inputs, "_emulate_cuda: ", op, " takes ",
                    std::to_string(it->second.n_inputs), " inputs, got ", std::to_string(in.size()));
  for (const auto& t : in) TORCH_CHECK_VALUE(t.device().is_cpu(), "_emulate_cuda: inputs must be CPU tensors");
  TORCH_CHECK_VALUE(sms > 0, "_emulate_cuda: sms must be positive");
  HostEmulation::sms = sms;
  return it->second.run(op, in, params, layout);
}

}  // namespace

void add_test_paths(pybind11::module& m) {
  m.def("_host_math", &host_math, pybind11::arg("op"), pybind11::arg("inputs"), pybind11::arg("params") = Doubles{},
        "Test path: the kernels' element math (ffn_math.h) run on the host, element by element.");
  m.def("_emulate_cuda", &emulate_cuda, pybind11::arg("op"), pybind11::arg("inputs"), pybind11::arg("sms") = 132,
        pybind11::arg("params") = Doubles{}, pybind11::arg("layout") = "concat",
        "Test path: op's CUDA launch (row_ops.h problem, rows.h launch shape and per-thread code) emulated on the "
        "host with CPU tensors, for a GPU with `sms` multiprocessors.");
}

}  // namespace ffn_ext

// ---- the quantizing ops' element math on the host (ffn_math.h's FP8 section), for tests/test_quant_math.py ----
namespace ffn_ext {
void add_quant_emulation(pybind11::module& m);  // below
namespace {
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

void add_quant_test_paths(pybind11::module& m) {
  m.def("_host_fp8", &host_fp8, pybind11::arg("x"), pybind11::arg("format"),
        "Test path: ffn_math.h's float -> fp8 conversion (codes as uint8) on the host.");
  m.def("_host_quant_scale", &host_quant_scale, pybind11::arg("amax"), pybind11::arg("fp8_max"), pybind11::arg("pow2"),
        "Test path: ffn_math.h's scale of a group from its amax, on the host.");
  add_quant_emulation(m);
}
}  // namespace ffn_ext

// ---- the quantizing kernels' launch emulated on the host (quant_kernel.h's per-lane code, group by group) ----
#include "quant_ops.h"

namespace ffn_ext {
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
    const int64_t per_row = p.scaling == quant::QScaling::kGroup ? p.cols / (quant::kLaneElems * p.lanes) : 1;
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
        "Test path: a quantizing op's CUDA launches (quant_kernel.h's per-lane and per-thread code: the group, row "
        "and tensor kernels, block by block and thread by thread) emulated on the host with CPU tensors.");
}
}  // namespace ffn_ext
