// ffn_ext_testing's _emulate_cuda: every row op's CUDA kernel as libffn_ext_cuda.so registers it (row_ops.h's
// Kernels: the checks, output allocation and RowProblem of csrc/cuda/ops.cpp's glue, the very functions its
// STABLE_TORCH_LIBRARY_IMPL boxes) with a host launcher in place of the CUDA one: rows.h's launch shape and
// per-thread code run on the CPU. Its op list comes from the op table (ops_table.h). A translation unit of its own
// (module.cpp says why), on torch's stable API at the library's target version.
//
// Compiled at -O1 (this file only): its every-op-every-dtype instantiations spend most of their compile time in
// the optimiser (docs/building.md has the figures), and the tests that run it (the CUDA stand-in, the launcher
// emulation) take tensors of a few thousand elements.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O1")
#endif
#include "stable_target.h"  // first: the target version, before any torch header

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
  struct Guard {  // cuda/ops.cpp's Guard takes the output's device index; the host has one device
    explicit Guard(int32_t) {}
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

using K = rows::Kernels<HostEmulation>;
using V = std::vector<Tensor>;
using S = const std::string&;

// A gated op's schema parameters (ops_table.h's P column) from the params list, under the names the table's ARGS
// macro passes on: limit, alpha, up_offset (unused without parameters).
#define FFN_EXT_EMU_PARAMS(Gate) \
  params_from<math::Gate::Params>(op, prm); \
  [[maybe_unused]] const double limit = prm.size() > 0 ? prm[0] : 0.0, alpha = prm.size() > 1 ? prm[1] : 0.0, \
                                up_offset = prm.size() > 2 ? prm[2] : 0.0;

struct Entry {
  size_t n_inputs;
  V (*run)(S op, const V& a, const Doubles& prm, S layout);
};

const std::map<std::string, Entry>& table() {
  static const std::map<std::string, Entry> ops = {
#define FFN_EXT_EMU_ACT(name, Act, ...) \
  {#name, \
   {1, \
    [](S op, const V& a, const Doubles& prm, S) -> V { \
      params_from<math::NoParams>(op, prm); \
      return {K::name(a[0])}; \
    }}}, \
      {#name "_backward", \
       {2, \
        [](S op, const V& a, const Doubles& prm, S) -> V { \
          params_from<math::NoParams>(op, prm); \
          return {K::name##_backward(a[0], a[1])}; \
        }}}, \
      {#name "_backward_recompute", {2, [](S op, const V& a, const Doubles& prm, S) -> V { \
                                       params_from<math::NoParams>(op, prm); \
                                       auto [d, h] = K::name##_backward_recompute(a[0], a[1]); \
                                       return {d, h}; \
                                     }}},
#define FFN_EXT_EMU_GATED(name, Gate, P) \
  {#name, \
   {2, \
    [](S op, const V& a, const Doubles& prm, S) -> V { \
      FFN_EXT_EMU_PARAMS(Gate) \
      return {K::name(a[0], a[1] FFN_EXT_P_ARGS_##P)}; \
    }}}, \
      {#name "_backward", \
       {3, \
        [](S op, const V& a, const Doubles& prm, S) -> V { \
          FFN_EXT_EMU_PARAMS(Gate) \
          auto [dgate, dup] = K::name##_backward(a[0], a[1], a[2] FFN_EXT_P_ARGS_##P); \
          return {dgate, dup}; \
        }}}, \
      {#name "_backward_recompute", \
       {3, \
        [](S op, const V& a, const Doubles& prm, S) -> V { \
          FFN_EXT_EMU_PARAMS(Gate) \
          auto [dgate, dup, h] = K::name##_backward_recompute(a[0], a[1], a[2] FFN_EXT_P_ARGS_##P); \
          return {dgate, dup, h}; \
        }}}, \
      {#name "_packed", \
       {1, \
        [](S op, const V& a, const Doubles& prm, S lay) -> V { \
          FFN_EXT_EMU_PARAMS(Gate) \
          return {K::name##_packed(a[0] FFN_EXT_P_ARGS_##P, lay)}; \
        }}}, \
      {#name "_packed_backward", {2, [](S op, const V& a, const Doubles& prm, S lay) -> V { \
                                    FFN_EXT_EMU_PARAMS(Gate) \
                                    return {K::name##_packed_backward(a[0], a[1] FFN_EXT_P_ARGS_##P, lay)}; \
                                  }}},
      FFN_EXT_ACTIVATIONS(FFN_EXT_EMU_ACT) FFN_EXT_GATED(FFN_EXT_EMU_GATED)
#undef FFN_EXT_EMU_ACT
#undef FFN_EXT_EMU_GATED
  };
  return ops;
}
#undef FFN_EXT_EMU_PARAMS

}  // namespace

Handles emulate_cuda(const std::string& op, const Handles& in, int sms, const Doubles& params,
                     const std::string& layout) {
  V ins(in.begin(), in.end());  // owned from here on
  const auto it = table().find(op);
  if (it == table().end()) usage_error("_emulate_cuda: unknown op '", op, "'");
  if (ins.size() != it->second.n_inputs) {
    usage_error("_emulate_cuda: ", op, " takes ", std::to_string(it->second.n_inputs), " inputs, got ",
                std::to_string(ins.size()));
  }
  if (sms <= 0) usage_error("_emulate_cuda: sms must be positive");
  HostEmulation::sms = sms;
  Handles out;
  for (const Tensor& t : it->second.run(op, ins, params, layout)) {
    AtenTensorHandle h = nullptr;
    FFN_EXT_SHIM(aoti_torch_new_tensor_handle(t.get(), &h));
    out.push_back(h);
  }
  return out;
}

}  // namespace testing
}  // namespace ffn_ext
