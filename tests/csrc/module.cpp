// The test-only extension ffn_ext_testing: what the tests run on the host in place of the CUDA kernels, from the
// kernels' own headers. tests/native.py builds it (CI's .ci/env before the tests; a test run builds it when it is
// missing or older than its sources); the ffn_ext package and its wheel do not contain it.
//
// Two translation units, for a 2-core build: emulate_rows.cpp alone (its instantiations are the largest job), and
// this file with the rest: the module, host_math.cpp, emulate_quant.cpp and the library code they call
// (csrc/shapes.cpp: the ops' checks and output allocation; csrc/quant_recipe.cpp: the quantizing recipe), compiled
// here rather than taken from ffn_ext._C, whose symbols are not an interface. Neither registers an op.
#include "emulate_quant.cpp"
#include "host_math.cpp"
#include "quant_recipe.cpp"
#include "shapes.cpp"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() =
      "ffn_ext's test-only functions (tests/native.py): the kernels' element math and launches run on the host, "
      "on CPU tensors";
  ffn_ext::testing::add_host_math(m);
  ffn_ext::testing::add_row_emulation(m);
  ffn_ext::testing::add_quant_emulation(m);
}
