// The pybind11 module ffn_ext._C. Importing it loads the library, which registers the ffn_ext ops with the
// dispatcher (registration.cpp). It adds what is not an op: the functional API's fast entry points, build
// information, and the test paths of test_paths.cpp.
#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <type_traits>

#include "ffn_ext.h"
#include "ops_table.h"

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
using TRef = const at::Tensor&;

// Kind: 1 unary (x), 2 gated (gate, up), 3 packed (gate_up; layout "concat", the default the API's fast path
// serves).
template <const char* Op, int Kind>
PyObject* fast_call(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  constexpr int N = Kind == 2 ? 2 : 1;
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
  using Sig = std::conditional_t<Kind == 1, at::Tensor(TRef),
                                 std::conditional_t<Kind == 2, at::Tensor(TRef, TRef), at::Tensor(TRef, c10::string_view)>>;
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(Op, "").typed<Sig>();
  at::Tensor out;
  {
    pybind11::gil_scoped_release no_gil;
    if constexpr (Kind == 1) {
      out = op.call(a);
    } else if constexpr (Kind == 2) {
      out = op.call(a, THPVariable_Unpack(args[1]));
    } else {
      out = op.call(a, c10::string_view("concat"));
    }
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

// _fast_<op> for every forward op of the table (ops_table.h) without keyword parameters: unary and gated ops and
// the packed gated ops. Gated ops with parameters (swiglu_clamped) and calls with a non-default layout go through
// torch.ops (ops.py).
#define FFN_EXT_FAST_ACT(name, ...) constexpr char k_##name[] = "ffn_ext::" #name;
#define FFN_EXT_FAST_GATED(name, Gate, P) FFN_EXT_FAST_GATED_##P(name)
#define FFN_EXT_FAST_GATED_CLAMP(name)
#define FFN_EXT_FAST_GATED_NONE(name)             \
  constexpr char k_##name[] = "ffn_ext::" #name;  \
  constexpr char k_##name##_packed[] = "ffn_ext::" #name "_packed";
FFN_EXT_ACTIVATIONS(FFN_EXT_FAST_ACT)
FFN_EXT_GATED(FFN_EXT_FAST_GATED)
#undef FFN_EXT_FAST_ACT
#undef FFN_EXT_FAST_GATED
#undef FFN_EXT_FAST_GATED_NONE
#undef FFN_EXT_FAST_GATED_CLAMP

constexpr const char* kFastDoc =
    "Fast entry point of the functional API (returns NotImplemented where torch.ops must serve the call).";
template <const char* Op, int Kind>
PyMethodDef fast_def(const char* name) {
  return {name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_call<Op, Kind>)), METH_FASTCALL,
          kFastDoc};
}
PyMethodDef fast_methods[] = {
#define FFN_EXT_FAST_DEF_ACT(name, ...) fast_def<k_##name, 1>("_fast_" #name),
#define FFN_EXT_FAST_DEF_GATED(name, Gate, P) FFN_EXT_FAST_DEF_GATED_##P(name)
#define FFN_EXT_FAST_DEF_GATED_CLAMP(name)
#define FFN_EXT_FAST_DEF_GATED_NONE(name) \
  fast_def<k_##name, 2>("_fast_" #name), fast_def<k_##name##_packed, 3>("_fast_" #name "_packed"),
    FFN_EXT_ACTIVATIONS(FFN_EXT_FAST_DEF_ACT) FFN_EXT_GATED(FFN_EXT_FAST_DEF_GATED)
#undef FFN_EXT_FAST_DEF_ACT
#undef FFN_EXT_FAST_DEF_GATED
#undef FFN_EXT_FAST_DEF_GATED_NONE
#undef FFN_EXT_FAST_DEF_GATED_CLAMP
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

void add_test_paths(pybind11::module& m);  // test_paths.cpp
}  // namespace ffn_ext

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ffn_ext native library: importing it registers the torch.ops.ffn_ext ops";
  if (PyModule_AddFunctions(m.ptr(), ffn_ext::fast_methods) != 0) throw pybind11::error_already_set();
  m.def("build_info", [] {
    pybind11::dict d;
    for (const auto& kv : ffn_ext::build_info()) d[kv.first.c_str()] = kv.second;
    return d;
  }, "What this build contains: CUDA kernels or not, CUDA version, architectures, torch version built against.");
  ffn_ext::add_test_paths(m);
}
