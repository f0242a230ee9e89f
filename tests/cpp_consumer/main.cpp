// A C++ program that uses ffn_ext through <ffn_ext/ops.h> and ffn_ext::ops, as a C++ extension used from Python
// does: libffn_ext_ops.so registers the schemas when the program loads; the CPU kernels and autograd are ffn_ext's
// Python, so the program embeds Python and imports ffn_ext (which adopts the ops the library registered). Then:
// every forward op and its backward op through the dispatcher on CPU tensors, against torch's ATen ops called
// through the dispatcher too; a shape error with the C++-visible message; a backward through autograd (Python's
// torch.autograd.grad over the same ops).
//
// Run with PYTHONPATH holding ffn_ext and torch (tests/test_build.py::test_cmake_build_cpu_only). Prints
// CONSUMER_OK; any mismatch exits 1 with the op's name.
#include <Python.h>

#include <ffn_ext/ops.h>
#include <torch/csrc/stable/ops.h>

#include <array>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

using torch::stable::Tensor;
namespace sd = torch::stable::detail;

namespace {

// An ATen op through the dispatcher (the stable API has no arithmetic of its own at the 2.10 target).
template <std::size_t N>
Tensor aten(const char* op, const char* overload, std::array<StableIValue, N> stack) {
  STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher(op, overload, stack.data(), TORCH_ABI_VERSION));
  return sd::to<Tensor>(stack[0]);
}
Tensor mul(const Tensor& a, const Tensor& b) { return aten<2>("aten::mul", "Tensor", {sd::from(a), sd::from(b)}); }
Tensor unary(const char* op, const Tensor& x) { return aten<1>(op, "", {sd::from(x)}); }
Tensor gelu(const Tensor& x, const std::string& approximate) {
  return aten<2>("aten::gelu", "", {sd::from(x), sd::from(approximate)});
}
Tensor last(Tensor x, int64_t start, int64_t length) { return torch::stable::narrow(x, -1, start, length); }
Tensor randn(std::vector<int64_t> shape) {  // float64, CPU
  std::array<StableIValue, 5> stack{sd::from(torch::headeronly::HeaderOnlyArrayRef<int64_t>(shape)),
                                    sd::from(std::optional(torch::headeronly::ScalarType::Double)),
                                    sd::from(std::nullopt), sd::from(std::nullopt), sd::from(std::nullopt)};
  STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher("aten::randn", "", stack.data(), TORCH_ABI_VERSION));
  return sd::to<Tensor>(stack[0]);
}
bool allclose(const Tensor& a, const Tensor& b) {
  std::array<StableIValue, 5> stack{sd::from(a), sd::from(b), sd::from(1e-12), sd::from(1e-12), sd::from(false)};
  STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher("aten::allclose", "", stack.data(), TORCH_ABI_VERSION));
  return sd::to<bool>(stack[0]);
}

int check(const Tensor& got, const Tensor& want, const char* what) {
  if (got.sizes().size() != want.sizes().size() || !allclose(got, want)) {
    std::printf("MISMATCH %s\n", what);
    return 1;
  }
  return 0;
}

// A backward through autograd: Python's torch.autograd.grad over the ffn_ext op (its Python-registered autograd).
const char* kAutograd = R"(
import torch, ffn_ext
g = torch.randn(4, 33, dtype=torch.float64, requires_grad=True)
u = torch.randn(4, 33, dtype=torch.float64, requires_grad=True)
dg, du = torch.autograd.grad(torch.ops.ffn_ext.swiglu(g, u).sum(), (g, u))
s = torch.sigmoid(g).detach()
torch.testing.assert_close(dg, u.detach() * s * (1 + g.detach() * (1 - s)))
torch.testing.assert_close(du, torch.nn.functional.silu(g.detach()))
)";

}  // namespace

int main() {
  Py_Initialize();
  PyObject* ffn = PyImport_ImportModule("ffn_ext");  // registers the CPU kernels and autograd
  if (ffn == nullptr) {
    PyErr_Print();
    std::printf("MISMATCH import ffn_ext failed\n");
    return 1;
  }
  Py_DECREF(ffn);
  int bad = 0;
  try {
    Tensor gate = randn({4, 33}), up = randn({4, 33}), grad = randn({4, 33});
    Tensor h = ffn_ext::swiglu(gate, up);
    bad += check(h, mul(unary("aten::silu", gate), up), "swiglu");
    auto [dgate, dup] = ffn_ext::swiglu_backward(grad, gate, up);
    bad += check(dup, mul(grad, unary("aten::silu", gate)), "swiglu_backward dup");
    bad += check(dgate, aten<3>("aten::silu_backward", "", {sd::from(mul(grad, up)), sd::from(gate)}),
                 "swiglu_backward dgate");

    Tensor x = randn({3, 10});
    bad += check(ffn_ext::gelu(x), gelu(x, "none"), "gelu");
    bad += check(ffn_ext::gelu_tanh(x), gelu(x, "tanh"), "gelu_tanh");
    bad += check(ffn_ext::silu_backward(grad, gate),
                 aten<3>("aten::silu_backward", "", {sd::from(grad), sd::from(gate)}), "silu_backward");
    Tensor gu = randn({3, 20});
    Tensor a = last(gu, 0, 10), b = last(gu, 10, 10);
    bad += check(ffn_ext::swiglu_packed(gu), mul(unary("aten::silu", a), b), "swiglu_packed");
    Tensor gi = torch::stable::view(gu, {3, 10, 2});  // interleaved: [g0, u0, g1, u1, ...]
    bad += check(ffn_ext::swiglu_packed(gu, "interleaved"),
                 mul(unary("aten::silu", torch::stable::select(gi, -1, 0)), torch::stable::select(gi, -1, 1)),
                 "swiglu_packed interleaved");
    Tensor gp = randn({3, 10});
    Tensor pb = ffn_ext::swiglu_packed_backward(gp, gu);  // [dgate | dup]
    auto [pdg, pdu] = ffn_ext::swiglu_backward(gp, a, b);
    bad += check(last(pb, 0, 10), pdg, "swiglu_packed_backward dgate");
    bad += check(last(pb, 10, 10), pdu, "swiglu_packed_backward dup");
    // swiglu_clamped with its defaults: limit only
    Tensor c = ffn_ext::swiglu_clamped(gate, up, 7.0);
    bad += check(c, ffn_ext::swiglu_clamped(gate, up, 7.0, 1.0, 0.0), "swiglu_clamped defaults");
  } catch (const std::exception& e) {
    std::printf("MISMATCH exception %s\n", e.what());
    bad += 1;
  }

  try {  // the ops' own checks reach C++ callers as std::runtime_error, with the message (torch >= 2.13)
    ffn_ext::swiglu(randn({4, 50}), randn({4, 3}));
    std::printf("MISMATCH shape check did not throw\n");
    bad += 1;
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    const std::string want = "ffn_ext.swiglu: expected `up` to have the shape of `gate` [4, 50], got [4, 3]";
    if (aoti_torch_abi_version() >= TORCH_VERSION_2_13_0 && what.find(want) == std::string::npos) {
      std::printf("MISMATCH shape error message: %s\n", what.c_str());
      bad += 1;
    } else {
      std::printf("error as expected: %.200s\n", what.c_str());
    }
  }

  if (PyRun_SimpleString(kAutograd) != 0) {
    std::printf("MISMATCH autograd through the dispatcher\n");
    bad += 1;
  }
  if (bad == 0) std::printf("CONSUMER_OK\n");
  std::fflush(stdout);
  Py_FinalizeEx();
  return bad == 0 ? 0 : 1;
}
