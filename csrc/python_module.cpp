// The pybind11 module ffn_ext._C. Importing it loads the library, which registers the ffn_ext ops with the
// dispatcher (registration.cpp). It adds what is not an op: the functional API's fast entry points and build
// information. (The tests' host math and emulated launches are an extension of their own, tests/native.py.)
#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <tuple>
#include <type_traits>

#include "ffn_ext.h"
#include "ops_table.h"

namespace ffn_ext {
namespace {

// ---- fast entry points of the functional API ----
// ffn_ext.gelu(x) and the other public functions (ffn_ext/ops.py) try these first. Each is a METH_FASTCALL
// function that takes plain tensors (then the op's scalar arguments) and calls the op through a typed dispatcher handle, as ATen's generated
// Python bindings do; torch.ops.ffn_ext.<op> makes a boxed call parsed against the schema, which costs more host
// time (benchmarks/host_overhead.py times both), and at decode sizes host time is what a call's latency is. Past
// the dispatcher everything is the same call: autograd, __torch_dispatch__ modes, fake tensors, errors, warnings.
// An entry returns NotImplemented, and the caller takes another path, when that path has more to do: an
// argument that is not a plain torch.Tensor (a subclass, an fx Proxy, not a tensor), an active
// __torch_function__ mode, a first argument on a device that ffn_ext has no kernels for, or a transform the
// ops' C++ autograd cannot serve (a torch.func transform, a forward-mode dual tensor: ops.py takes ATen's ops).
using TRef = const at::Tensor&;

// A trailing scalar argument of a fast entry (a gated op's parameter, a packed op's layout), converted from Python
// as the schema would: float from a Python float or int (not bool), str from a str; false if it is not one.
bool from_py(PyObject* o, double& v) {
  if (PyFloat_CheckExact(o)) {
    v = PyFloat_AS_DOUBLE(o);
    return true;
  }
  if (!PyLong_CheckExact(o)) return false;
  v = PyLong_AsDouble(o);
  return !(v == -1.0 && PyErr_Occurred());
}
bool from_py(PyObject* o, c10::string_view& v) {
  if (!PyUnicode_Check(o)) return false;
  Py_ssize_t n = 0;
  const char* p = PyUnicode_AsUTF8AndSize(o, &n);
  if (p == nullptr) return false;
  v = c10::string_view(p, static_cast<size_t>(n));
  return true;
}

// The fast entry of op Op: NT tensors, then the op's scalar arguments of types Extra (all positional, in schema
// order: ops.py passes every one).
template <const char* Op, int NT, class... Extra>
PyObject* fast_call(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  constexpr Py_ssize_t kArgs = NT + static_cast<Py_ssize_t>(sizeof...(Extra));
  if (nargs != kArgs || at::impl::torch_function_mode_enabled()) Py_RETURN_NOTIMPLEMENTED;
  // torch.func transforms include this key in the thread's dispatch keys while their layer stack is not empty
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode)) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  for (int i = 0; i < NT; ++i) {
    if (!THPVariable_CheckExact(args[i]) || THPVariable_Unpack(args[i])._fw_grad(0).defined()) {
      Py_RETURN_NOTIMPLEMENTED;
    }
  }
  std::tuple<Extra...> extra;
  const bool parsed = std::apply(
      [&](auto&... e) {
        Py_ssize_t k = NT;
        return (from_py(args[k++], e) && ...);
      },
      extra);
  if (!parsed) {
    PyErr_Clear();
    Py_RETURN_NOTIMPLEMENTED;  // torch.ops parses it and raises the schema's error
  }
  const at::Tensor& a = THPVariable_Unpack(args[0]);
  const auto dev = a.device().type();
  if (dev != c10::DeviceType::CUDA && dev != c10::DeviceType::CPU && dev != c10::DeviceType::Meta) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  using Sig = std::conditional_t<NT == 1, at::Tensor(TRef, Extra...), at::Tensor(TRef, TRef, Extra...)>;
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(Op, "").typed<Sig>();
  // With no gradient to record, the call starts below autograd: the ops' autograd is Python
  // (ffn_ext/_kernels.py), which would cost microseconds a call just to find nothing to record.
  bool record = false;
  if (at::GradMode::is_enabled()) {
    for (int i = 0; i < NT; ++i) record = record || THPVariable_Unpack(args[i]).requires_grad();
  }
  at::Tensor out;
  {
    pybind11::gil_scoped_release no_gil;
    std::optional<at::AutoDispatchBelowADInplaceOrView> below;
    if (!record) below.emplace();
    if constexpr (NT == 1) {
      out = std::apply([&](const auto&... e) { return op.call(a, e...); }, extra);
    } else {
      out = std::apply([&](const auto&... e) { return op.call(a, THPVariable_Unpack(args[1]), e...); }, extra);
    }
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

// _fast_<op> for every forward op of the table (ops_table.h): unary ops (x), gated ops (gate, up, params...) and
// packed gated ops (gate_up, params..., layout); a parameter set's C++ types are FFN_EXT_P_TYPES_<P>.
#define FFN_EXT_P_TYPES_NONE
#define FFN_EXT_P_TYPES_CLAMP , double, double, double
#define FFN_EXT_FAST_ACT(name, ...) constexpr char k_##name[] = "ffn_ext::" #name;
#define FFN_EXT_FAST_GATED(name, Gate, P) \
  constexpr char k_##name[] = "ffn_ext::" #name; \
  constexpr char k_##name##_packed[] = "ffn_ext::" #name "_packed";
FFN_EXT_ACTIVATIONS(FFN_EXT_FAST_ACT)
FFN_EXT_GATED(FFN_EXT_FAST_GATED)
#undef FFN_EXT_FAST_ACT
#undef FFN_EXT_FAST_GATED

constexpr const char* kFastDoc =
    "Fast entry point of the functional API (returns NotImplemented where torch.ops must serve the call).";
template <const char* Op, int NT, class... Extra>
PyMethodDef fast_def(const char* name) {
  return {name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_call<Op, NT, Extra...>)),
          METH_FASTCALL, kFastDoc};
}
PyMethodDef fast_methods[] = {
#define FFN_EXT_FAST_DEF_ACT(name, ...) fast_def<k_##name, 1>("_fast_" #name),
#define FFN_EXT_FAST_DEF_GATED(name, Gate, P) \
  fast_def<k_##name, 2 FFN_EXT_P_TYPES_##P>("_fast_" #name), \
      fast_def<k_##name##_packed, 1 FFN_EXT_P_TYPES_##P, c10::string_view>("_fast_" #name "_packed"),
    FFN_EXT_ACTIVATIONS(FFN_EXT_FAST_DEF_ACT) FFN_EXT_GATED(FFN_EXT_FAST_DEF_GATED)
#undef FFN_EXT_FAST_DEF_ACT
#undef FFN_EXT_FAST_DEF_GATED
        {nullptr, nullptr, 0, nullptr}};

}  // namespace
}  // namespace ffn_ext

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ffn_ext native library: importing it registers the torch.ops.ffn_ext ops";
  if (PyModule_AddFunctions(m.ptr(), ffn_ext::fast_methods) != 0) throw pybind11::error_already_set();
  m.def(
      "build_info",
      [] {
        pybind11::dict d;
        for (const auto& kv : ffn_ext::build_info()) d[kv.first.c_str()] = kv.second;
        return d;
      },
      "What this build contains: CUDA kernels or not, CUDA version, architectures, torch version built against.");
}
