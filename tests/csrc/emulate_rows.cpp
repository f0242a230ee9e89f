// ffn_ext_testing's _emulate_cuda: every row op's whole CUDA launch (row_ops.h problem, rows.h launch shape and
// per-thread code) emulated on the host, its op list from the op table (ops_table.h). A translation unit of its
// own (module.cpp says why).
//
// Compiled at -O1 (this file only): its every-op-every-dtype instantiations spend most of their compile time in
// the optimiser (docs/building.md has the figures), and the tests that run it (the CUDA stand-in, the launcher
// emulation) take tensors of a few thousand elements.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O1")
#endif
#include <ATen/core/Tensor.h>

#include <cstring>
#include <map>
#include <string>

#include "ffn_ext.h"
#include "ffn_math.h"
#include "ops_table.h"
#include "row_ops.h"
#include "testing.h"

namespace ffn_ext {
namespace testing {
namespace {

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

void add_row_emulation(pybind11::module& m) {
  m.def("_emulate_cuda", &emulate_cuda, pybind11::arg("op"), pybind11::arg("inputs"), pybind11::arg("sms") = 132,
        pybind11::arg("params") = Doubles{}, pybind11::arg("layout") = "concat",
        "op's CUDA launch (row_ops.h problem, rows.h launch shape and per-thread code) emulated on the "
        "host with CPU tensors, for a GPU with `sms` multiprocessors.");
}

}  // namespace testing
}  // namespace ffn_ext
