// Forward and autograd through the dispatcher from C++, with nothing but <ffn_ext/ops.h> and ffn_ext::ops.
// Prints CONSUMER_OK; any mismatch exits 1 with the op's name.
#include <ffn_ext/ops.h>

#include <ATen/ATen.h>

#include <cstdio>

static int check(const at::Tensor& got, const at::Tensor& want, const char* what) {
  if (!at::allclose(got, want, 1e-12, 1e-12)) {
    std::printf("MISMATCH %s\n", what);
    return 1;
  }
  return 0;
}

int main() {
  at::manual_seed(0);
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor gate = at::randn({4, 33}, opts).requires_grad_(true);
  at::Tensor up = at::randn({4, 33}, opts).requires_grad_(true);
  int bad = 0;

  at::Tensor h = ffn_ext::swiglu(gate, up);
  bad += check(h, at::silu(gate) * up, "swiglu");
  h.sum().backward();  // the C++ autograd kernel of ffn_ext::swiglu (csrc/autograd.cpp)
  at::Tensor s = at::sigmoid(gate).detach();
  bad += check(gate.grad(), up.detach() * s * (1 + gate.detach() * (1 - s)), "swiglu dgate");
  bad += check(up.grad(), at::silu(gate.detach()), "swiglu dup");

  at::Tensor x = at::randn({3, 10}, opts);
  bad += check(ffn_ext::gelu(x), at::gelu(x), "gelu");
  bad += check(ffn_ext::gelu_tanh(x), at::gelu(x, "tanh"), "gelu_tanh");
  at::Tensor gu = at::randn({3, 20}, opts);
  bad += check(ffn_ext::swiglu_packed(gu), at::silu(gu.narrow(-1, 0, 10)) * gu.narrow(-1, 10, 10), "swiglu_packed");
  at::Tensor gi = gu.view({3, 10, 2});
  bad += check(ffn_ext::swiglu_packed(gu, "interleaved"), at::silu(gi.select(-1, 0)) * gi.select(-1, 1),
               "swiglu_packed interleaved");
  try {  // the ops' own checks reach C++ callers as c10::Error
    ffn_ext::swiglu(gate.detach(), up.detach().narrow(-1, 0, 3));
    std::printf("MISMATCH shape check did not throw\n");
    bad += 1;
  } catch (const c10::Error& e) {
    std::printf("error as expected: %.60s\n", e.what_without_backtrace());
  }
  if (bad == 0) std::printf("CONSUMER_OK\n");
  return bad == 0 ? 0 : 1;
}
