// The stable translation units of ffn_ext_testing (emulate_rows.cpp, emulate_quant.cpp) include this first, so
// that ffn_ext's glue compiles here as libffn_ext_cuda.so compiles it: on torch's stable API at the library's
// target version, whose headers then leave out what newer torches add and refuse c10/ATen. tests/native.py passes
// the version as FFN_EXT_TESTING_TARGET_VERSION (ffn_ext/_build.py's TORCH_TARGET_VERSION, build.json's flag): not
// as TORCH_TARGET_VERSION itself, which would reach module.cpp, the pybind11 module on the full API.
#pragma once

#ifndef TORCH_TARGET_VERSION
#ifndef FFN_EXT_TESTING_TARGET_VERSION
#error "FFN_EXT_TESTING_TARGET_VERSION: tests/native.py passes ffn_ext's TORCH_TARGET_VERSION"
#endif
#define TORCH_TARGET_VERSION FFN_EXT_TESTING_TARGET_VERSION
#endif
