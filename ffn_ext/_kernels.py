"""The ffn_ext ops' Python halves, written from the table (ffn_ext/table.py): everything but the CUDA kernels.

The native library (ffn_ext._C, a JIT build, or libffn_ext_ops) registers the schemas and the CUDA kernels;
``register()`` adds, for every op of the table:

- its CPU kernel: the op's checks, then its ATen form (table.py), into outputs laid out as the CUDA kernels' are.
  In a build without CUDA kernels it serves CUDA tensors too, after a one-time warning;
- its fake (Meta) kernel: the same checks, and outputs of the real kernels' shapes, dtypes and strides, so fake
  tensors, torch.compile and export accept and reject what the kernels do;
- its autograd: a forward op's backward is its ``*_backward`` op; a ``*_backward`` op's own backward is the
  vector-Jacobian product of its ATen form (double backward); the recompute ops refuse to record a gradient.

So the table's ATen forms are the only ATen statement of each op, and the C++ holds kernels and checks only. The
checks raise what the C++ checks raise, with the same messages: TypeError (not a tensor, layout, dtype), ValueError
(shape, parameters), RuntimeError (device).
"""

from __future__ import annotations

import warnings

import torch

from . import _compat
from .table import LAYOUTS, OPS, check_params, join_packed, split_packed

__all__ = ["FLOAT_DTYPES", "check", "check_kinds", "check_extra", "compute", "register", "retyped", "split_kwargs"]

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------- checks
def _kind_error(op: str, name: str, t) -> Exception | None:
    if not isinstance(t, torch.Tensor):
        return TypeError(f"{op}: expected `{name}` to be a torch.Tensor, got {type(t).__name__}")
    if t.is_nested:
        return TypeError(f"{op}: `{name}` is a nested tensor; expected a dense strided tensor")
    if t.layout != torch.strided:
        return TypeError(f"{op}: expected `{name}` to be a dense strided tensor, got layout {t.layout}")
    if t.is_quantized:
        return TypeError(f"{op}: `{name}` is a quantized tensor; expected a floating-point tensor")
    return None


def check_kinds(op: str, names: tuple, args: tuple) -> None:
    """A TypeError naming the first of args that is not a dense strided tensor."""
    for name, t in zip(names, args):
        err = _kind_error(op, name, t)
        if err is not None:
            raise err from None


def _check_dtype(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: expected `{name}` to have dtype float64, float32, float16 or bfloat16, got {t.dtype}")


def _check_like(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    _check_dtype(op, name, t)
    if t.dtype != ref.dtype:
        raise TypeError(f"{op}: expected `{name}` to have the dtype of `{ref_name}` ({ref.dtype}), got {t.dtype}")
    if t.device != ref.device:
        raise RuntimeError(
            f"{op}: expected `{name}` to be on the device of `{ref_name}` ({ref.device}), got {t.device}"
        )
    if t.shape != ref.shape:
        raise ValueError(
            f"{op}: expected `{name}` to have the shape of `{ref_name}` {list(ref.shape)}, got {list(t.shape)}"
        )


def check_extra(name: str, kwargs: dict) -> None:
    """The checks of a gated op's parameters and a packed op's layout."""
    spec, op = OPS[name], f"ffn_ext.{name}"
    if spec.gated is not None and spec.params:
        check_params(op, spec.gated, {p.name: kwargs.get(p.name, p.default) for p in spec.params})
    layout = kwargs.get("layout", "concat")
    if spec.kind == "packed" and layout not in LAYOUTS:
        raise ValueError(f'{op}: `layout` must be "concat" or "interleaved", got "{layout}"')


def check(name: str, args: tuple, params: dict, layout: str | None) -> None:
    """Every check op `name` makes of its tensors `args`, its parameters and (packed ops) its layout."""
    spec, op = OPS[name], f"ffn_ext.{name}"
    check_extra(name, dict(params, **({"layout": layout} if layout is not None else {})))
    check_kinds(op, spec.args, args)
    r = 1 if spec.backward else 0  # the argument the others are checked against: x, gate or gate_up
    ref_name, ref = spec.args[r], args[r]
    _check_dtype(op, ref_name, ref)
    if spec.kind == "packed":
        if ref.dim() == 0:
            raise ValueError(f"{op}: expected `gate_up` to have at least 1 dimension ([..., 2*M]), got a 0-dim tensor")
        if ref.shape[-1] % 2:
            raise ValueError(
                f"{op}: expected the last dimension of `gate_up` to be even ([..., 2*M]), got shape {list(ref.shape)}"
            )
        if spec.backward:
            grad, out_shape = args[0], [*ref.shape[:-1], ref.shape[-1] // 2]
            _check_dtype(op, "grad", grad)
            if grad.dtype != ref.dtype:
                raise TypeError(f"{op}: expected `grad` to have the dtype of `gate_up` ({ref.dtype}), got {grad.dtype}")
            if grad.device != ref.device:
                raise RuntimeError(
                    f"{op}: expected `grad` to be on the device of `gate_up` ({ref.device}), got {grad.device}"
                )
            if list(grad.shape) != out_shape:
                raise ValueError(
                    f"{op}: expected `grad` to have the forward output's shape {out_shape} "
                    f"(gate_up's with the last dimension halved), got {list(grad.shape)}"
                )
        return
    for k in [*range(r + 1, len(args)), *range(r)]:  # the C++ checks' order
        _check_like(op, spec.args[k], args[k], ref_name, ref)


# The C++ checks (the CUDA kernels') can raise only RuntimeError across torch's stable ABI: they tag the message
# with the type they mean, which the functional API restores (docs/internals/stable-abi.md, section 1.3).
_TAGS = {"[ValueError] ": ValueError, "[TypeError] ": TypeError}


def retyped(err: Exception) -> Exception | None:
    """The ValueError or TypeError a C++ check's tagged RuntimeError stands for, its tag stripped; else None."""
    if type(err) is not RuntimeError:
        return None
    msg = str(err)
    for tag, kind in _TAGS.items():
        i = msg.find(tag)
        if i != -1 and not msg[:i].strip():
            return kind(msg[i + len(tag) :])
    return None


# ---------------------------------------------------------------- the ATen forms
def compute(name: str, args: tuple, params: dict, layout: str | None):
    """Op `name` on checked inputs, with the table's ATen forms (differentiable ATen ops throughout)."""
    spec = OPS[name]
    if spec.kind == "packed":
        assert layout is not None  # a packed op's (split_kwargs fills in the default)
        if not spec.backward:
            return spec.gated.forward(*split_packed(args[0], layout), **params)
        grad, gate_up = args
        dgate, dup = spec.gated.backward(grad, *split_packed(gate_up, layout), **params)
        return join_packed(dgate, dup, layout)
    if spec.recompute:
        return spec.act.aten_backward(*args), spec.act.aten(args[1])
    if spec.kind == "unary":
        return spec.act.aten_backward(*args) if spec.backward else spec.act.aten(*args)
    if spec.backward:
        return spec.gated.backward(*args, **params)
    return spec.gated.forward(*args, **params)


def _format(ins: tuple) -> torch.memory_format:
    """The memory format of a same-shape op's outputs: channels_last (4-D) or channels_last_3d (5-D) when every
    input is dense in it and not plainly contiguous, as ATen's pointwise ops keep it; else contiguous. The CUDA
    launcher decides the same way (csrc/shapes.cpp), so every kernel's outputs have one layout."""
    d = ins[0].dim()
    fmt = torch.channels_last if d == 4 else torch.channels_last_3d if d == 5 else None
    if fmt is None:
        return torch.contiguous_format
    for t in ins:
        if t.dim() != d or t.is_contiguous() or not t.is_contiguous(memory_format=fmt):
            return torch.contiguous_format
    return fmt


def _out_shapes(name: str, args: tuple):
    """(shape, memory format) of each output of op `name`."""
    spec = OPS[name]
    if spec.kind == "packed":
        gu = args[-1]
        shape = gu.shape if spec.backward else (*gu.shape[:-1], gu.shape[-1] // 2)
        return [(shape, torch.contiguous_format)]
    fmt = _format(args)
    return [(args[-1].shape, fmt)] * spec.n_outputs


def split_kwargs(name: str, kwargs: dict):
    """(params, layout) of a call of op `name` from its keyword arguments, the schema's defaults filled in (layout:
    None but for the packed ops)."""
    spec = OPS[name]
    params = {p.name: kwargs.get(p.name, p.default) for p in spec.params}
    return params, (kwargs.get("layout", "concat") if spec.kind == "packed" else None)


def _fake(name: str):
    def fake(*args, **kwargs):
        params, layout = split_kwargs(name, kwargs)
        check(name, args, params, layout)
        ref = args[-1]
        outs = tuple(
            torch.empty(shape, dtype=ref.dtype, device=ref.device, memory_format=fmt)
            for shape, fmt in _out_shapes(name, args)
        )
        return outs if len(outs) > 1 else outs[0]

    return fake


_warned_no_cuda = False
_cuda_off: str | None = None  # why the CUDA kernels are off (the loader's reason), for the warning


def _warn_no_cuda_kernels() -> None:
    global _warned_no_cuda
    if not _warned_no_cuda:
        _warned_no_cuda = True
        why = _cuda_off or "ffn_ext was built without CUDA kernels (CPU-only build)"
        warnings.warn(
            f"ffn_ext's CUDA kernels are off ({why}); CUDA tensors use the ATen composite. For the fused kernels, "
            "build ffn_ext with a CUDA toolkit against a torch of the CUDA major you run.",
            stacklevel=2,
        )


def _aten_kernel(name: str, warn: bool = False):
    def kernel(*args, **kwargs):
        if warn:
            _warn_no_cuda_kernels()
        params, layout = split_kwargs(name, kwargs)
        check(name, args, params, layout)
        outs = compute(name, args, params, layout)
        outs = outs if isinstance(outs, tuple) else (outs,)
        # the layout the fake kernel promised (ATen keeps an input's strides, e.g. of a transposed view)
        outs = tuple(o.contiguous(memory_format=fmt) for o, (_, fmt) in zip(outs, _out_shapes(name, args)))
        return outs if len(outs) > 1 else outs[0]

    return kernel


# ---------------------------------------------------------------- autograd
def _op(name: str):
    return getattr(torch.ops.ffn_ext, name).default


def _below(name: str, keyset, args: tuple, kwargs: dict):
    """Op `name` past the autograd keys (its CPU, CUDA or fake kernel)."""
    with torch._C._AutoDispatchBelowAutograd():
        return _op(name).redispatch(keyset & torch._C._after_autograd_keyset, *args, **kwargs)


class _Function(torch.autograd.Function):
    """One recorded call of a differentiable op: the kernel below autograd, then the table's backward."""

    @staticmethod
    def forward(ctx, name, keyset, kwargs, *tensors):
        ctx.name, ctx.kwargs = name, kwargs
        ctx.save_for_backward(*tensors)
        return _below(name, keyset, tensors, kwargs)

    @staticmethod
    def backward(ctx, *grads):
        spec, needs = OPS[ctx.name], ctx.needs_input_grad[3:]
        fn = _backward_of_backward if spec.backward else _backward_of_forward
        grads_in = fn(ctx.name, ctx.saved_tensors, ctx.kwargs, grads)
        return (None, None, None, *(g if need else None for g, need in zip(grads_in, needs)))


def _backward_of_forward(name: str, saved: tuple, kwargs: dict, grads: tuple) -> tuple:
    """A forward op's input gradients: its *_backward op (differentiable in turn)."""
    out = _op(name + "_backward")(grads[0], *saved, **kwargs)
    return out if isinstance(out, tuple) else (out,)


def _vjp(fn, n: int, tensors: tuple) -> tuple:
    """The vector-Jacobian product of fn at tensors[:n] for the cotangents tensors[n:], differentiable in all of
    them (create_graph). The tensors must be independent leaves that require grad."""
    ins = tensors[:n]
    outs = fn(*ins)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = torch.autograd.grad(outs, ins, tensors[n:], create_graph=True, allow_unused=True)
    return tuple(torch.zeros_like(i) if g is None else g for g, i in zip(grads, ins))


class _Vjp(torch.autograd.Function):
    """_vjp(fn, n, tensors) as an autograd function of tensors whose backward is again a _Vjp, so that every order
    of derivative is ATen's. Each order differentiates on fresh leaves: the tensors may depend on one another (a
    double backward's grad depends on the forward's inputs), and differentiating through that dependency inside
    would count it twice and free the caller's graph."""

    @staticmethod
    def forward(ctx, fn, n, *tensors):
        ctx.fn, ctx.n = fn, n
        ctx.save_for_backward(*tensors)
        with torch.enable_grad():
            leaves = tuple(t.detach().requires_grad_() for t in tensors)
            return tuple(g.detach() for g in _vjp(fn, n, leaves))

    @staticmethod
    def backward(ctx, *cotangents):
        fn, n, tensors = ctx.fn, ctx.n, ctx.saved_tensors
        return (None, None, *_Vjp.apply(lambda *t: _vjp(fn, n, t), len(tensors), *tensors, *cotangents))


def _backward_of_backward(name: str, saved: tuple, kwargs: dict, cotangents: tuple) -> tuple:
    """A *_backward op's input gradients. The op is the vector-Jacobian product of its forward op's ATen form
    (ATen's own backward formulas are not all differentiable: silu_backward is not), so its derivatives are
    _Vjp's."""
    spec = OPS[name]
    grad, *primals = saved
    params, layout = split_kwargs(name, kwargs)

    def forward(*ins):
        return compute(spec.forward_name, ins, params, layout)

    n = len(primals)
    *d_primals, d_grad = _Vjp.apply(lambda *t: _vjp(forward, n, t), n + 1, *primals, grad, *cotangents)
    return (d_grad, *d_primals)


def _autograd(name: str):
    """Op `name`'s Autograd kernel: its _Function where a gradient is to be recorded, else the kernel below
    autograd. A forward-mode dual input raises: these ops have no jvp, and dropping the tangent would be a silent
    wrong derivative (the functional API routes dual tensors to ATen's ops). The ops without autograd formula (the
    recompute ops, which serve backward passes) raise where a gradient would be recorded, rather than return
    results that autograd silently treats as constants."""
    spec = OPS[name]

    def kernel(keyset, *args, **kwargs):
        record = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in args)
        tangent = _compat.has_tangent(args)
        if not spec.differentiable and (record or tangent):
            raise RuntimeError(
                f"ffn_ext::{name} has no autograd formula (it serves a backward pass); call it under torch.no_grad() "
                f"or with inputs that do not require grad, or differentiate ffn_ext::{spec.forward_name}_backward "
                "instead"
            )
        if tangent:
            raise RuntimeError(
                f"ffn_ext::{name}: forward-mode AD is not supported (jvp is not implemented); the functional API "
                "(ffn_ext.swiglu, ...) computes dual tensors with ATen's ops"
            )
        if record:
            return _Function.apply(name, keyset, kwargs, *args)
        return _below(name, keyset, args, kwargs)

    return kernel


# ---------------------------------------------------------------- registration
_libs: list = []  # the torch.library.Library objects: registrations last as long as these live
hooks: list = []  # register()s of the layers above (ffn_ext/_quant_kernels.py), run by register: no import


def register(cuda_kernels: bool, cuda_off: str | None = None) -> None:
    """Registers the Python kernels and autograd of every op of the table, once the native library has defined the
    schemas. cuda_kernels: whether that library has CUDA kernels; without, the ATen kernels serve CUDA tensors, and
    warn once, giving `cuda_off` (why they are off) when known."""
    global _cuda_off
    if _libs:
        return
    _cuda_off = cuda_off
    lib = torch.library.Library("ffn_ext", "IMPL")  # noqa: TOR901  # (not a new namespace: the schemas exist)
    _libs.append(lib)
    for name in OPS:
        torch.library.register_fake(f"ffn_ext::{name}", _fake(name), lib=lib)
        lib.impl(name, _aten_kernel(name), "CPU")
        if not cuda_kernels:
            lib.impl(name, _aten_kernel(name, warn=True), "CUDA")
        lib.impl(name, _autograd(name), "Autograd", with_keyset=True)
    for hook in hooks:
        hook()
