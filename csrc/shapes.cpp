// Input guards and output allocation of the CUDA kernels, on int64 shapes (the stable API has no SymInt: fake
// tensors and symbolic shapes are the Python fake impls'). The guards keep the kernels' invariants; the user-facing
// checks and messages are Python's (ffn_ext/_kernels.py). Compiled into libffn_ext_cuda.so through cuda/ops.cpp.
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
bool same_device(const Tensor& a, const Tensor& b) {
  int32_t ta = 0, tb = 0, ia = 0, ib = 0;
  FFN_EXT_SHIM(aoti_torch_get_device_type(a.get(), &ta));
  FFN_EXT_SHIM(aoti_torch_get_device_type(b.get(), &tb));
  FFN_EXT_SHIM(aoti_torch_get_device_index(a.get(), &ia));
  FFN_EXT_SHIM(aoti_torch_get_device_index(b.get(), &ib));
  return ta == tb && ia == ib;
}

// Nested and quantized tensors never reach these kernels (their dispatch keys differ), so the stable API's lack of
// is_nested / is_quantized costs nothing here.
bool is_float(ScalarType st) {
  return st == ScalarType::Double || st == ScalarType::Float || st == ScalarType::Half || st == ScalarType::BFloat16;
}

void check_input(const char* op, const char* name, const Tensor& t) {
  // the shim, not Tensor::layout(): torch 2.10's stable headers have no such method (2.10's shim has the call)
  int32_t layout = 0;
  if (t.defined()) FFN_EXT_SHIM(aoti_torch_get_layout(t.get(), &layout));
  FFN_EXT_CHECK(t.defined() && layout == aoti_torch_layout_strided() && is_float(dtype_of(t)), op, ": `", name,
                "` must be a dense strided float64, float32, float16 or bfloat16 tensor");
}

void check_like(const char* op, const char* name, const Tensor& t, const char* ref_name, const Tensor& ref) {
  check_input(op, name, t);
  FFN_EXT_CHECK(dtype_of(t) == dtype_of(ref) && same_device(t, ref) && t.sizes().equals(ref.sizes()), op, ": `", name,
                "` must have the dtype, device and shape of `", ref_name, "`");
}

// Validates gate_up for the packed ops and returns its half width M.
int64_t check_packed(const char* op, const Tensor& gate_up) {
  check_input(op, "gate_up", gate_up);
  FFN_EXT_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, op, ": `gate_up` must be [..., 2*M]");
  return gate_up.size(-1) / 2;
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

std::tuple<Tensor, Tensor, Tensor> alloc_gated_backward_recompute(const char* op, const Tensor& grad,
                                                                  const Tensor& gate, const Tensor& up) {
  auto [dgate, dup] = alloc_gated_backward(op, grad, gate, up);
  return {dgate, dup, empty_format(gate, vec(gate.sizes()), same_shape_format({&grad, &gate, &up}))};
}

Tensor alloc_gated_packed(const char* op, const Tensor& gate_up) {
  const int64_t m = check_packed(op, gate_up);
  return empty_format(gate_up, with_last(gate_up, m));
}

Tensor alloc_gated_packed_backward(const char* op, const Tensor& grad, const Tensor& gate_up) {
  const int64_t m = check_packed(op, gate_up);
  check_input(op, "grad", grad);
  FFN_EXT_CHECK(
      dtype_of(grad) == dtype_of(gate_up) && same_device(grad, gate_up) && vec(grad.sizes()) == with_last(gate_up, m),
      op, ": `grad` must have the forward output's dtype, device and shape ([..., M] of `gate_up`'s)");
  return empty_format(gate_up, vec(gate_up.sizes()));
}

Layout parse_layout(const char* op, std::string_view layout) {
  if (layout == "concat") return Layout::kConcat;
  if (layout == "interleaved") return Layout::kInterleaved;
  detail::fail(op, ": `layout` must be \"concat\" or \"interleaved\"");
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
  FFN_EXT_CHECK(p.limit > 0 && std::isfinite(p.alpha) && std::isfinite(p.up_offset), op,
                ": `limit` must be > 0, `alpha` and `up_offset` finite");
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
int64_t check_cache_group(const char* op, const Tensor& gate, int64_t group) {
  FFN_EXT_CHECK(group == 32 || group == 64 || group == 128, op, ": `group_size` must be 32, 64 or 128");
  FFN_EXT_CHECK(gate.dim() >= 1 && gate.size(-1) % group == 0, op,
                ": `group_size` must divide the last dimension of `gate`");
  return gate.size(-1);
}
int64_t check_cache(const char* op, const Tensor& grad, const Tensor& q, const Tensor& scale) {
  check_input(op, "grad", grad);
  FFN_EXT_CHECK(grad.dim() >= 1, op, ": `grad` must have at least 1 dimension ([..., M])");
  const int64_t m = grad.size(-1);
  auto sizes = with_last(grad, 2 * m);
  FFN_EXT_CHECK(dtype_of(q) == ScalarType::Float8_e4m3fn && same_device(q, grad) && vec(q.sizes()) == sizes, op,
                ": `q` must be a float8_e4m3fn tensor [..., 2M] on `grad`'s device, `grad` [..., M]");
  const int64_t n = scale.dim() == grad.dim() ? scale.size(-1) : 0;
  const int64_t group = n > 0 && (2 * m) % n == 0 ? 2 * m / n : 0;
  sizes.back() = n;
  FFN_EXT_CHECK(dtype_of(scale) == ScalarType::Float && same_device(scale, grad) && vec(scale.sizes()) == sizes &&
                    (group == 32 || group == 64 || group == 128) && m % group == 0,
                op, ": `scale` must be a float32 tensor [..., 2M / G] on `grad`'s device, G 32, 64 or 128 dividing M");
  return group;
}
}  // namespace quant
}  // namespace ffn_ext
