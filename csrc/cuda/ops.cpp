// libffn_ext_cuda.so's glue: the CUDA kernels of every ffn_ext op registered with STABLE_TORCH_LIBRARY_IMPL(ffn_ext,
// CUDA), on PyTorch's stable ABI (-DTORCH_TARGET_VERSION=0x020a000000000000): the row ops (../row_ops.h's
// problems, run by the kernels of kernels_part<i>.cu through launch_rows.h) and the quantizing ops
// (../quant_ops.h's QuantProblems, run by quant_part<i>.cu through launch_quant.h), on the current stream under a
// guard for the output's device. A library of its own, not part of _C: it needs libtorch_cuda and libcudart.so of
// one CUDA major, and _C must load without them (docs/internals/stable-abi.md). ffn_ext/_loader.py loads it
// with torch.ops.load_library when the running torch's CUDA major matches. One g++ translation unit with the
// checks (../shapes.cpp) and the recipe (../quant_recipe.cpp): on 2 cores a build is bound by total CPU time.
#include <cuda_runtime.h>

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/macros.h>

#include <atomic>
#include <string>

#include "../cache_ops.h"
#include "../quant_ops.h"
#include "../quant_recipe.cpp"
#include "../row_ops.h"
#include "../shapes.cpp"
#include "launch_quant.h"
#include "launch_rows.h"

namespace ffn_ext {
namespace cuda {
std::string compiled_cuda_version();  // kernels.cu
std::string compiled_arch_list();

namespace {

// The current device's multiprocessor count, queried once per device (a cudaDeviceGetAttribute per launch showed
// in host time).
int sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};
  int dev = 0;
  STD_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= 0 && dev < kMaxDevices) {
    const int known = cache[dev].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int sms = 0;
  STD_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (dev >= 0 && dev < kMaxDevices) cache[dev].store(sms, std::memory_order_relaxed);
  return sms;
}

// torch's current stream on the current device (set by the guard), through the C shim (libtorch_cuda).
cudaStream_t current_stream() {
  int dev = 0;
  STD_CUDA_CHECK(cudaGetDevice(&dev));
  void* s = nullptr;
  FFN_EXT_SHIM(aoti_torch_get_current_cuda_stream(dev, &s));
  return static_cast<cudaStream_t>(s);
}

// The output's device made current for the op (torch's device guard through the shim).
struct Guard {
  explicit Guard(int32_t device_index) : g(static_cast<torch::stable::accelerator::DeviceIndex>(device_index)) {}
  torch::stable::accelerator::DeviceGuard g;
};

// Ops<CudaLauncher>: the problems of ../row_ops.h run as CUDA kernels on the current stream.
struct CudaLauncher {
  using Guard = cuda::Guard;
  template <typename T, typename F>
  static void run(const F& f, const rows::RowProblem<F::NI, F::NO>& p) {
    if (p.rows == 0 || p.cols == 0) return;
    STD_CUDA_CHECK(launch_rows<T>(f, p, current_stream(), sm_count()));
  }
};

// QuantOps<CudaQuant>: the quantizing problems of ../quant_ops.h.
struct CudaQuant {
  using Guard = cuda::Guard;
  template <typename T, class F, bool Pair>
  static void run(const quant::QuantProblem& p, const F& f) {
    const int sms = sm_count();
    int dev = 0;
    STD_CUDA_CHECK(cudaGetDevice(&dev));
    Tensor parts;  // freed at return: the caching allocator reuses it only after this stream's kernels
    float* parts_ptr = nullptr;
    if (p.scaling == quant::QScaling::kTensor && !p.has_static) {
      const std::vector<int64_t> n{quant::tensor_blocks(p, sms)}, one{1};
      AtenTensorHandle h = nullptr;
      FFN_EXT_SHIM(aoti_torch_empty_strided(1, n.data(), one.data(), static_cast<int32_t>(ScalarType::Float),
                                            static_cast<int32_t>(torch::headeronly::DeviceType::CUDA), dev, &h));
      parts = Tensor(h);
      parts_ptr = static_cast<float*>(parts.data_ptr());
    }
    STD_CUDA_CHECK((quant::launch_quant<T, F, Pair>(p, f, current_stream(), sms, parts_ptr)));
  }
};

// CacheOps<CudaCache>: the FP8 activation cache's problems (../cache_ops.h).
struct CudaCache {
  using Guard = cuda::Guard;
  template <typename T, class Gate>
  static void cache(const quant::CacheProblem& p, const Gate& gate) {
    STD_CUDA_CHECK((quant::launch_cache<T, Gate>(p, gate, current_stream(), sm_count())));
  }
  template <typename T, class Gate>
  static void cached_backward(const quant::CacheProblem& p, const Gate& gate) {
    STD_CUDA_CHECK((quant::launch_cached_backward<T, Gate>(p, gate, current_stream(), sm_count())));
  }
};

}  // namespace
}  // namespace cuda
}  // namespace ffn_ext

// Every line of the table (impl_all's Parts = 1): the kernels of line i are in kernels_part<i % kCudaParts>.cu.
STABLE_TORCH_LIBRARY_IMPL(ffn_ext, CUDA, m) {
  ffn_ext::rows::impl_all<ffn_ext::cuda::CudaLauncher>(m);
  ffn_ext::quant::impl_quant_all<ffn_ext::cuda::CudaQuant>(m);
  ffn_ext::quant::impl_cache_all<ffn_ext::cuda::CudaCache>(m);
}

// What this library was built with, for ffn_ext/_loader.py (ctypes, without going through torch):
// "cuda_version=13.0;cuda_archs=900".
extern "C" __attribute__((visibility("default"))) const char* ffn_ext_cuda_build_info() {
  static const std::string info = "cuda_version=" + ffn_ext::cuda::compiled_cuda_version() +
                                  ";cuda_archs=" + ffn_ext::cuda::compiled_arch_list() +
                                  ";torch_built_against=" TORCH_VERSION ";torch_target=2.10";
  return info.c_str();
}
