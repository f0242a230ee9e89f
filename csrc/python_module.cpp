// The pybind11 module ffn_ext._C. Importing it loads the library, which registers the ffn_ext ops with the
// dispatcher (registration.cpp). It adds what is not an op: the functional API's fast entry points, build
// information and two test paths, the kernels' element math on the host and the whole CUDA launch emulated on
// the host.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <cstring>
#include <map>
#include <string>

#include "ffn_ext.h"
#include "ffn_math.h"
#include "row_ops.h"

namespace ffn_ext {
namespace {

// ---- fast entry points of the functional API ----
// ffn_ext.gelu(x) and the other public functions (ffn_ext/ops.py) try these first. Each is a METH_FASTCALL
// function that takes plain tensors and calls the op through a typed dispatcher handle, as ATen's generated
// Python bindings do; torch.ops.ffn_ext.<op> makes a boxed call parsed against the schema, which costs more host
// time (benchmarks/host_overhead.py times both), and at decode sizes host time is what a call's latency is. Past
// the dispatcher everything is the same call: autograd, __torch_dispatch__ modes, fake tensors, errors, warnings.
// An entry returns NotImplemented, and the caller takes another path, when that path has more to do: an
// argument that is not a plain torch.Tensor (a subclass, an fx Proxy, not a tensor), an active
// __torch_function__ mode, a first argument on a device that ffn_ext has no kernels for, or a transform the
// ops' C++ autograd cannot serve (a torch.func transform, a forward-mode dual tensor: ops.py takes ATen's ops).
constexpr const char* kFastOps[] = {"ffn_ext::gelu", "ffn_ext::silu", "ffn_ext::swiglu", "ffn_ext::swiglu_packed"};
using TRef = const at::Tensor&;

template <int K, int N>
PyObject* fast_call(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != N || at::impl::torch_function_mode_enabled()) Py_RETURN_NOTIMPLEMENTED;
  // torch.func transforms include this key in the thread's dispatch keys while their layer stack is not empty
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode)) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  for (int i = 0; i < N; ++i) {
    if (!THPVariable_CheckExact(args[i]) || THPVariable_Unpack(args[i])._fw_grad(0).defined()) {
      Py_RETURN_NOTIMPLEMENTED;
    }
  }
  const at::Tensor& a = THPVariable_Unpack(args[0]);
  const auto dev = a.device().type();
  if (dev != c10::DeviceType::CUDA && dev != c10::DeviceType::CPU && dev != c10::DeviceType::Meta) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  using Sig = std::conditional_t<N == 1, at::Tensor(TRef), at::Tensor(TRef, TRef)>;
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(kFastOps[K], "").typed<Sig>();
  at::Tensor out;
  {
    pybind11::gil_scoped_release no_gil;
    if constexpr (N == 1) {
      out = op.call(a);
    } else {
      out = op.call(a, THPVariable_Unpack(args[1]));
    }
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

template <int K, int N>
PyMethodDef fast_def(const char* name) {
  return {name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_call<K, N>)), METH_FASTCALL,
          "Fast entry point of the functional API (returns NotImplemented where torch.ops must serve the call)."};
}
PyMethodDef fast_methods[] = {
    fast_def<0, 1>("_fast_gelu"), fast_def<1, 1>("_fast_silu"), fast_def<2, 2>("_fast_swiglu"),
    fast_def<3, 1>("_fast_swiglu_packed"), {nullptr, nullptr, 0, nullptr}};

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
    for (int o = 0; o < F::NO; ++o) {
      for (int64_t r = 0; r < p.rows; ++r) {
        std::memset(static_cast<T*>(p.out[o]) + r * p.out_stride[o], 0xff, p.cols * sizeof(T));
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

std::vector<at::Tensor> emulate_cuda(const std::string& op, const std::vector<at::Tensor>& in, int sms) {
  using Emu = rows::Ops<HostEmulation>;
  using V = std::vector<at::Tensor>;
  struct Entry {
    size_t n_inputs;
    V (*run)(const V&);
  };
  static const std::map<std::string, Entry> ops = {
      {"gelu", {1, [](const V& a) -> V { return {Emu::gelu(a[0])}; }}},
      {"gelu_backward", {2, [](const V& a) -> V { return {Emu::gelu_backward(a[0], a[1])}; }}},
      {"silu", {1, [](const V& a) -> V { return {Emu::silu(a[0])}; }}},
      {"silu_backward", {2, [](const V& a) -> V { return {Emu::silu_backward(a[0], a[1])}; }}},
      {"swiglu", {2, [](const V& a) -> V { return {Emu::swiglu(a[0], a[1])}; }}},
      {"swiglu_backward", {3, [](const V& a) -> V {
         auto [dgate, dup] = Emu::swiglu_backward(a[0], a[1], a[2]);
         return {dgate, dup};
       }}},
      {"swiglu_packed", {1, [](const V& a) -> V { return {Emu::swiglu_packed(a[0])}; }}},
      {"swiglu_packed_backward", {2, [](const V& a) -> V { return {Emu::swiglu_packed_backward(a[0], a[1])}; }}},
  };
  const auto it = ops.find(op);
  TORCH_CHECK_VALUE(it != ops.end(), "_emulate_cuda: unknown op '", op, "'");
  TORCH_CHECK_VALUE(in.size() == it->second.n_inputs, "_emulate_cuda: ", op, " takes ",
                    std::to_string(it->second.n_inputs), " inputs, got ", std::to_string(in.size()));
  for (const auto& t : in) TORCH_CHECK_VALUE(t.device().is_cpu(), "_emulate_cuda: inputs must be CPU tensors");
  TORCH_CHECK_VALUE(sms > 0, "_emulate_cuda: sms must be positive");
  HostEmulation::sms = sms;
  return it->second.run(in);
}

}  // namespace
}  // namespace ffn_ext

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ffn_ext native library: importing it registers the torch.ops.ffn_ext ops";
  if (PyModule_AddFunctions(m.ptr(), ffn_ext::fast_methods) != 0) throw pybind11::error_already_set();
  m.def("build_info", [] {
    pybind11::dict d;
    for (const auto& kv : ffn_ext::build_info()) d[kv.first.c_str()] = kv.second;
    return d;
  }, "What this build contains: CUDA kernels or not, CUDA version, architectures, torch version built against.");
  m.def("_host_math", &ffn_ext::host_math, pybind11::arg("op"), pybind11::arg("inputs"),
        "Test path: the kernels' element math (ffn_math.h) run on the host, element by element.");
  m.def("_emulate_cuda", &ffn_ext::emulate_cuda, pybind11::arg("op"), pybind11::arg("inputs"),
        pybind11::arg("sms") = 132,
        "Test path: op's CUDA launch (row_ops.h problem, rows.h launch shape and per-thread code) emulated on the "
        "host with CPU tensors, for a GPU with `sms` multiprocessors.");
}
