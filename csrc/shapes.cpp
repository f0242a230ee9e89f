// Input checks and output allocation of the CUDA kernels, on int64 shapes (the stable API has no SymInt: fake
// tensors and symbolic shapes are the Python fake impls', which give the same messages). Compiled into
// libffn_ext_cuda.so through cuda/ops.cpp.
#include "ffn_ext.h"

#include <torch/headeronly/core/DeviceType.h>
#include <torch/headeronly/core/Layout.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace ffn_ext {

const char* dtype_name(ScalarType st) {
  switch (st) {
    case ScalarType::Double: return "torch.float64";
    case ScalarType::Float: return "torch.float32";
    case ScalarType::Half: return "torch.float16";
    case ScalarType::BFloat16: return "torch.bfloat16";
    case ScalarType::Long: return "torch.int64";
    case ScalarType::Int: return "torch.int32";
    case ScalarType::Short: return "torch.int16";
    case ScalarType::Char: return "torch.int8";
    case ScalarType::Byte: return "torch.uint8";
    case ScalarType::Bool: return "torch.bool";
    case ScalarType::ComplexFloat: return "torch.complex64";
    case ScalarType::ComplexDouble: return "torch.complex128";
    default: return torch::headeronly::toString(st);
  }
}

// "[3, 5]", built with std::to_string, not an ostream. On the H200 image (torch 2.11, g++ 13) the build linked a
// copy of libstdc++'s stream code into _C whose locale facets were never set up: any number streamed by this
// library into a message segfaulted in std::ostream::_M_insert<long> (cuda-gdb backtrace in
// benchmarks/results/2026-11-30_h200/), and with -static-libstdc++ here the numbers silently vanish. So this
// library's messages format numbers with std::to_string (tests/test_build.py links statically and checks them).
std::string shape_str(const std::vector<int64_t>& sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(sizes[i]);
  }
  return s + "]";
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> st(sizes.size());
  int64_t s = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    st[d] = s;
    s *= sizes[d] > 1 ? sizes[d] : 1;
  }
  return st;
}

Tensor empty_strided(const Tensor& like, const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                     ScalarType dtype) {
  int32_t dev_type = 0, dev_index = 0;
  FFN_EXT_SHIM(aoti_torch_get_device_type(like.get(), &dev_type));
  FFN_EXT_SHIM(aoti_torch_get_device_index(like.get(), &dev_index));
  AtenTensorHandle h = nullptr;
  FFN_EXT_SHIM(aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.data(), strides.data(),
                                        static_cast<int32_t>(dtype), dev_type, dev_index, &h));
  return Tensor(h);
}

namespace {
// "cuda:0", "cpu", as torch.device prints.
std::string device_str(const Tensor& t) {
  int32_t type = 0, index = -1;
  FFN_EXT_SHIM(aoti_torch_get_device_type(t.get(), &type));
  FFN_EXT_SHIM(aoti_torch_get_device_index(t.get(), &index));
  using torch::headeronly::DeviceType;
  std::string s;
  switch (static_cast<DeviceType>(type)) {
    case DeviceType::CPU: s = "cpu"; break;
    case DeviceType::CUDA: s = "cuda"; break;
    case DeviceType::Meta: s = "meta"; break;
    default: s = "device_type_" + std::to_string(type); break;
  }
  return index >= 0 ? s + ":" + std::to_string(index) : s;
}
bool same_device(const Tensor& a, const Tensor& b) {
  int32_t ta = 0, tb = 0, ia = 0, ib = 0;
  FFN_EXT_SHIM(aoti_torch_get_device_type(a.get(), &ta));
  FFN_EXT_SHIM(aoti_torch_get_device_type(b.get(), &tb));
  FFN_EXT_SHIM(aoti_torch_get_device_index(a.get(), &ia));
  FFN_EXT_SHIM(aoti_torch_get_device_index(b.get(), &ib));
  return ta == tb && ia == ib;
}

// Nested and quantized tensors never reach these kernels (their dispatch keys differ), so the stable API's lack of
// is_nested / is_quantized costs nothing here; the Python fake impls keep those checks.
void check_input(const char* op, const char* name, const Tensor& t) {
  FFN_EXT_CHECK_VALUE(t.defined(), op, ": `", name, "` is an undefined tensor");
  // the shim, not Tensor::layout(): torch 2.10's stable headers have no such method (2.10's shim has the call)
  int32_t layout = 0;
  FFN_EXT_SHIM(aoti_torch_get_layout(t.get(), &layout));
  FFN_EXT_CHECK_TYPE(layout == aoti_torch_layout_strided(), op, ": expected `", name,
                     "` to be a dense strided tensor, got layout ", std::to_string(layout));
  const auto st = dtype_of(t);
  FFN_EXT_CHECK_TYPE(
      st == ScalarType::Double || st == ScalarType::Float || st == ScalarType::Half || st == ScalarType::BFloat16, op,
      ": expected `", name, "` to have dtype float64, float32, float16 or bfloat16, got ", dtype_name(st));
}

void check_like(const char* op, const char* name, const Tensor& t, const char* ref_name, const Tensor& ref) {
  check_input(op, name, t);
  FFN_EXT_CHECK_TYPE(dtype_of(t) == dtype_of(ref), op, ": expected `", name, "` to have the dtype of `", ref_name,
                     "` (", dtype_name(dtype_of(ref)), "), got ", dtype_name(dtype_of(t)));
  FFN_EXT_CHECK(same_device(t, ref), op, ": expected `", name, "` to be on the device of `", ref_name, "` (",
                device_str(ref), "), got ", device_str(t));
  FFN_EXT_CHECK_VALUE(t.sizes().equals(ref.sizes()), op, ": expected `", name, "` to have the shape of `", ref_name,
                      "` ", shape_str(vec(ref.sizes())), ", got ", shape_str(vec(t.sizes())));
}

// Validates gate_up for the packed ops and returns its half width M.
int64_t check_packed(const char* op, const Tensor& gate_up) {
  check_input(op, "gate_up", gate_up);
  FFN_EXT_CHECK_VALUE(gate_up.dim() >= 1, op, ": expected `gate_up` to have at least 1 dimension ([..., 2*M]), got a ",
                      "0-dim tensor");
  const int64_t last = gate_up.size(-1);
  FFN_EXT_CHECK_VALUE(last % 2 == 0, op, ": expected the last dimension of `gate_up` to be even ([..., 2*M]), got ",
                      "shape ", shape_str(vec(gate_up.sizes())));
  return last / 2;
}

std::vector<int64_t> with_last(const Tensor& t, int64_t last) {
  auto sizes = vec(t.sizes());
  sizes.back() = last;
  return sizes;
}

// The memory format of a same-shape op's outputs: channels_last (4-D) or channels_last_3d (5-D) when every input
// is dense in it and not plainly contiguous, as ATen's pointwise ops keep it; else contiguous. The launcher then
// runs one long row over the storage (row_ops.h run_same_shape). The Python fake impls decide the same way.
enum class Format { kContiguous, kChannelsLast };

// Tensor::is_contiguous(memory_format) is not in the stable API: ATen's channels-last contiguity test (size-1
// dims skipped), dims in the order C, W, H, N (4-D) or C, W, H, D, N (5-D).
const std::vector<int>& channels_last_order(int64_t dim) {
  static const std::vector<int> k4{1, 3, 2, 0}, k5{1, 4, 3, 2, 0};
  return dim == 4 ? k4 : k5;
}
bool is_channels_last(const Tensor& t) {
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  int64_t expected = 1;
  for (int d : channels_last_order(t.dim())) {
    if (sizes[d] != 1) {
      if (strides[d] != expected) return false;
      expected *= sizes[d];
    }
  }
  return true;
}
// ATen's channels-last strides for sizes (get_channels_last_strides_2d / _3d: the sizes as they are, no max(1, .)).
std::vector<int64_t> channels_last_strides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> st(sizes.size());
  int64_t s = 1;
  for (int d : channels_last_order(static_cast<int64_t>(sizes.size()))) {
    st[d] = s;
    s *= sizes[d];
  }
  return st;
}

Format same_shape_format(std::initializer_list<const Tensor*> ins) {
  const Tensor& first = **ins.begin();
  if (first.dim() != 4 && first.dim() != 5) return Format::kContiguous;
  for (const Tensor* t : ins) {
    if (t->dim() != first.dim() || t->is_contiguous() || !is_channels_last(*t)) return Format::kContiguous;
  }
  return Format::kChannelsLast;
}

Tensor empty_format(const Tensor& like, const std::vector<int64_t>& sizes, Format fmt = Format::kContiguous) {
  return empty_strided(like, sizes,
                       fmt == Format::kChannelsLast ? channels_last_strides(sizes) : contiguous_strides(sizes),
                       dtype_of(like));
}
}  // namespace

// ---- per-op checks + allocation ----
Tensor alloc_unary(const char* op, const Tensor& x) {
  check_input(op, "x", x);
  return empty_format(x, vec(x.sizes()), same_shape_format({&x}));
}

Tensor alloc_unary_backward(const char* op, const Tensor& grad, const Tensor& x) {
  check_input(op, "x", x);
  check_like(op, "grad", grad, "x", x);
  return empty_format(x, vec(x.sizes()), same_shape_format({&grad, &x}));
}

std::tuple<Tensor, Tensor> alloc_unary_backward_recompute(const char* op, const Tensor& grad, const Tensor& x) {
  check_input(op, "x", x);
  check_like(op, "grad", grad, "x", x);
  const auto fmt = same_shape_format({&grad, &x});
  return {empty_format(x, vec(x.sizes()), fmt), empty_format(x, vec(x.sizes()), fmt)};
}

Tensor alloc_gated(const char* op, const Tensor& gate, const Tensor& up) {
  check_input(op, "gate", gate);
  check_like(op, "up", up, "gate", gate);
  return empty_format(gate, vec(gate.sizes()), same_shape_format({&gate, &up}));
}

std::tuple<Tensor, Tensor> alloc_gated_backward(const char* op, const Tensor& grad, const Tensor& gate,
                                                const Tensor& up) {
  check_input(op, "gate", gate);
  check_like(op, "up", up, "gate", gate);
  check_like(op, "grad", grad, "gate", gate);
  const auto fmt = same_shape_format({&grad, &gate, &up});
  return {empty_format(gate, vec(gate.sizes()), fmt), empty_format(gate, vec(gate.sizes()), fmt)};
}

Tensor alloc_gated_packed(const char* op, const Tensor& gate_up) {
  const int64_t m = check_packed(op, gate_up);
  return empty_format(gate_up, with_last(gate_up, m));
}

Tensor alloc_gated_packed_backward(const char* op, const Tensor& grad, const Tensor& gate_up) {
  const int64_t m = check_packed(op, gate_up);
  check_input(op, "grad", grad);
  // grad must look like the forward output: gate_up's shape with the last dimension halved.
  const auto out_sizes = with_last(gate_up, m);
  FFN_EXT_CHECK_TYPE(dtype_of(grad) == dtype_of(gate_up), op, ": expected `grad` to have the dtype of `gate_up` (",
                     dtype_name(dtype_of(gate_up)), "), got ", dtype_name(dtype_of(grad)));
  FFN_EXT_CHECK(same_device(grad, gate_up), op, ": expected `grad` to be on the device of `gate_up` (",
                device_str(gate_up), "), got ", device_str(grad));
  FFN_EXT_CHECK_VALUE(vec(grad.sizes()) == out_sizes, op, ": expected `grad` to have the forward output's shape ",
                      shape_str(out_sizes), " (gate_up's with the last dimension halved), got ",
                      shape_str(vec(grad.sizes())));
  return empty_format(gate_up, vec(gate_up.sizes()));
}

Layout parse_layout(const char* op, std::string_view layout) {
  if (layout == "concat") return Layout::kConcat;
  if (layout == "interleaved") return Layout::kInterleaved;
  detail::fail("[ValueError] ", op, ": `layout` must be \"concat\" or \"interleaved\", got \"", layout, "\"");
}

math::ClampParams for_dtype(const math::ClampParams& p, ScalarType dtype) {
  static const bool at_bound = [] {  // the running torch's: aoti_torch_abi_version() is its version, 0xMMmmpp...
    const uint64_t v = aoti_torch_abi_version();
    return math::clamp_grad_at_bound(static_cast<int>(v >> 56), static_cast<int>((v >> 48) & 0xFF));
  }();
  math::ClampParams q = p;
  q.grad_at_bound = at_bound;
  if (dtype == ScalarType::Half) q.limit = static_cast<double>(static_cast<torch::headeronly::Half>(p.limit));
  if (dtype == ScalarType::BFloat16) q.limit = static_cast<double>(static_cast<torch::headeronly::BFloat16>(p.limit));
  return q;
}

void check_params(const char* op, const math::ClampParams& p) {
  // !(x > 0) also rejects NaN
  FFN_EXT_CHECK_VALUE(p.limit > 0, op, ": `limit` must be > 0, got ", std::to_string(p.limit));
  FFN_EXT_CHECK_VALUE(std::isfinite(p.alpha), op, ": `alpha` must be finite, got ", std::to_string(p.alpha));
  FFN_EXT_CHECK_VALUE(std::isfinite(p.up_offset), op, ": `up_offset` must be finite, got ",
                      std::to_string(p.up_offset));
}

}  // namespace ffn_ext

// ---- the quantizing ops' input checks (quant.h): the unfused ops' own, without their allocation ----
#include "quant.h"

namespace ffn_ext {
namespace quant {
void check_x(const char* op, const Tensor& x) { check_input(op, "x", x); }
void check_gated(const char* op, const Tensor& gate, const Tensor& up) {
  check_input(op, "gate", gate);
  check_like(op, "up", up, "gate", gate);
}
int64_t check_packed(const char* op, const Tensor& gate_up) { return ffn_ext::check_packed(op, gate_up); }
}  // namespace quant
}  // namespace ffn_ext
