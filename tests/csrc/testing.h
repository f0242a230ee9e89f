// Shared by the sources of the test-only extension ffn_ext_testing (tests/native.py builds it; not part of
// ffn_ext): the kernels' element math on the host (host_math.cpp), the row kernels' launch emulated
// (emulate_rows.cpp) and the quantizing kernels' launch emulated (emulate_quant.cpp).
//
// Two kinds of translation unit, which must not share torch headers (module.cpp says why):
//   module.cpp (with host_math.cpp)   the pybind11 module, on the full torch API (at::Tensor, its pybind casters);
//   emulate_rows.cpp, emulate_quant.cpp (with csrc/shapes.cpp, csrc/quant_recipe.cpp)   ffn_ext's CUDA glue
//                     (row_ops.h, quant_ops.h) on torch's stable API at the library's TORCH_TARGET_VERSION, as
//                     libffn_ext_cuda.so compiles it, with a host launcher in place of the CUDA one.
// Between them only C types and this header: tensors cross as AtenTensorHandles (the C shim's), each handed over
// with its ownership. So this header includes nothing of torch but the C shim's declarations and the header-only
// ScalarType, both the same in either kind of TU.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "ffn_math.h"

namespace ffn_ext {
// shapes.cpp (declared in ffn_ext.h too, which only the stable TUs include): swiglu_clamped's limit as its kernels
// use it on tensors of `dtype`.
math::ClampParams for_dtype(const math::ClampParams& p, torch::headeronly::ScalarType dtype);

namespace testing {

// A bad call of a test function itself (unknown op, wrong number of inputs or params, ...): a ValueError in
// Python (module.cpp). The ops' own guards, in the glue, throw what the CUDA kernels throw: a RuntimeError naming the
// op and the argument, which the functional API explains with its Python checks.
struct UsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
template <class... A>
[[noreturn]] void usage_error(const A&... parts) {
  std::string s;
  ((s += parts), ...);
  throw UsageError(s);
}

// A gated op's Params from the test functions' `params` list: [] or [limit, alpha, up_offset].
using Doubles = std::vector<double>;
template <class P> P params_from(const std::string& op, const Doubles& v);
template <> inline math::NoParams params_from(const std::string& op, const Doubles& v) {
  if (!v.empty()) usage_error(op, " takes no params, got ", std::to_string(v.size()));
  return {};
}
template <> inline math::ClampParams params_from(const std::string& op, const Doubles& v) {
  if (v.size() != 3)
    usage_error(op, " takes params [limit, alpha, up_offset], got ", std::to_string(v.size()), " values");
  return {v[0], v[1], v[2]};
}
// The Params as the kernels take them on tensors of `dtype` (ffn_ext.h's for_dtype).
inline math::NoParams params_for(const math::NoParams& p, torch::headeronly::ScalarType) { return p; }
inline math::ClampParams params_for(const math::ClampParams& p, torch::headeronly::ScalarType dtype) {
  return for_dtype(p, dtype);
}

// Tensors across the boundary: owned AtenTensorHandles. Inputs: the callee takes each handle's ownership (it wraps
// them in torch::stable::Tensor first thing); outputs: new handles, the caller's to delete.
using Handles = std::vector<AtenTensorHandle>;

// emulate_rows.cpp: op's CUDA kernel (row_ops.h's Kernels, as libffn_ext_cuda.so registers it) with its launch run
// on the host for a GPU of `sms` multiprocessors. Inputs: CPU tensors (module.cpp checks).
Handles emulate_cuda(const std::string& op, const Handles& in, int sms, const Doubles& params,
                     const std::string& layout);

// emulate_quant.cpp: an FP8 activation cache op's CUDA kernel (cache_ops.h's CacheKernels), launch run on the host.
Handles emulate_cache(const std::string& op, const Handles& in, const Doubles& params, int64_t group_size);
// emulate_quant.cpp: a quantizing op's CUDA kernel (quant_ops.h's QuantKernels) with its launches run on the host.
// dtype / scale_dtype: c10's ScalarType codes, as the schema passes them.
Handles emulate_quant(const std::string& op, const Handles& in, const Doubles& params, const std::string& layout,
                      int32_t dtype, const std::string& scaling, int64_t group_size, bool pow2, int32_t scale_dtype,
                      const std::string& scale_layout, std::optional<double> static_scale);

}  // namespace testing
}  // namespace ffn_ext
