// Shared by the test-only sources of ffn_ext._C (test_paths.cpp: the element math; test_paths_rows.cpp: the row
// kernels' launch emulated; test_paths_quant.cpp: the quantizing kernels' launch emulated). test_paths_rows.cpp
// is a translation unit of its own (its instantiations are the build's largest job: it must start early, beside
// the others); the other two are compiled with python_module.cpp (python_sources.cpp says why). The tensor and STL casters come from torch/csrc/utils/pybind.h, not torch/extension.h (which
// adds the whole C++ frontend, torch/all.h, to parse).
#pragma once

#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "ffn_math.h"

namespace ffn_ext {

// A gated op's Params from the test paths' `params` list: [] or [limit, alpha, up_offset].
using Doubles = std::vector<double>;
template <class P> P params_from(const std::string& op, const Doubles& v);
template <> inline math::NoParams params_from(const std::string& op, const Doubles& v) {
  TORCH_CHECK_VALUE(v.empty(), op, " takes no params, got ", std::to_string(v.size()));
  return {};
}
template <> inline math::ClampParams params_from(const std::string& op, const Doubles& v) {
  TORCH_CHECK_VALUE(v.size() == 3, op, " takes params [limit, alpha, up_offset], got ", std::to_string(v.size()),
                    " values");
  return {v[0], v[1], v[2]};
}

void add_row_emulation(pybind11::module& m);    // test_paths_rows.cpp: _emulate_cuda
void add_quant_emulation(pybind11::module& m);  // test_paths_quant.cpp: _emulate_quant

}  // namespace ffn_ext
