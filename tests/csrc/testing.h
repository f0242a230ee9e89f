// Shared by the sources of the test-only extension ffn_ext_testing (tests/native.py builds it; not part of
// ffn_ext): the kernels' element math on the host (host_math.cpp), the row kernels' launch emulated
// (emulate_rows.cpp) and the quantizing kernels' launch emulated (emulate_quant.cpp). They compile ffn_ext's own
// headers (csrc/), and module.cpp compiles the library's checks and allocation (csrc/shapes.cpp,
// csrc/quant_recipe.cpp) into the extension, so that it uses no symbol of ffn_ext._C. The tensor and STL casters
// come from torch/csrc/utils/pybind.h, not torch/extension.h (which adds the whole C++ frontend, torch/all.h, to
// parse).
#pragma once

#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "ffn_math.h"

namespace ffn_ext {
namespace testing {

// A gated op's Params from the test functions' `params` list: [] or [limit, alpha, up_offset].
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

void add_host_math(pybind11::module& m);        // host_math.cpp: _host_math, _host_fp8, _host_quant_scale
void add_row_emulation(pybind11::module& m);    // emulate_rows.cpp: _emulate_cuda
void add_quant_emulation(pybind11::module& m);  // emulate_quant.cpp: _emulate_quant

}  // namespace testing
}  // namespace ffn_ext
