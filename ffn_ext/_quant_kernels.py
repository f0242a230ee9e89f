"""The quantizing ops' Python kernels, from the table: fake (Meta), CPU, the CUDA composite and Autograd.

The native library holds their schemas (csrc/registration.cpp) and CUDA kernels (csrc/quant_ops.h); everything
else is here, as ffn_ext/_kernels.py does for the table's other ops. Every kernel starts as the CUDA kernels start
(csrc/quant_recipe.cpp, csrc/quant.h): the recipe's checks (parse_recipe), the unfused op's input checks
(_kernels.check), then (q, scale) allocated for h's shape (alloc_quant). The CPU kernel and the composite then
compute h with the unfused op through the dispatcher (so h is bit for bit what that op returns on the device) and
quantize it with quant.py's formula (reference_quantize: the only statement of the formula in ATen).

Registered from _kernels.register (its `hooks`), i.e. when ops adopts a native library, or at import if that
happened before: the package imports this module, ops never does (it is the layer below).
"""

from __future__ import annotations

import math

import torch

from . import _kernels, quant
from .quant import FP8_MAX, QuantRecipe, op_names, reference_quantize
from .table import OPS

__all__ = ["composite", "register"]

_FIRST_UNARY = next(n for n, s in OPS.items() if s.kind == "unary" and not s.backward)


def _unfused(name: str) -> str | None:
    """The unfused op a quantizing op quantizes the output of (swiglu_quant -> swiglu, swiglu_packed_quant ->
    swiglu_packed); None for quantize (h is x)."""
    return None if name == "quantize" else name[: -len("_quant")]


def _dtype_name(dtype) -> str:
    """c10's name of a dtype ("Char", "BFloat16", ...): what the C++ messages print (torch::headeronly::toString)."""
    if not isinstance(dtype, torch.dtype):
        return str(dtype)
    return torch.empty(0, dtype=dtype).type()[len("torch.") : -len("Tensor")]


def parse_recipe(op, dtype, scaling, group_size, pow2_scales, scale_dtype, scale_layout, static_scale) -> QuantRecipe:
    """The recipe of an op call's arguments, after the C++ parse_recipe's checks in its order, with its messages and
    exception types (QuantRecipe's own checks name the class, not the op)."""
    if dtype not in FP8_MAX:
        raise TypeError(f"{op}: `dtype` must be torch.float8_e4m3fn or torch.float8_e5m2, got {_dtype_name(dtype)}")
    if scaling not in ("tensor", "row", "group"):
        raise ValueError(f'{op}: `scaling` must be "tensor", "row" or "group", got "{scaling}"')
    if scaling == "group" and group_size not in (32, 64, 128):
        raise ValueError(
            f"{op}: `group_size` must be 32, 64 or 128 (elements per group along the last dim), got {group_size}"
        )
    if scale_dtype not in (torch.float32, torch.float8_e8m0fnu):
        raise TypeError(
            f"{op}: `scale_dtype` must be torch.float32 or torch.float8_e8m0fnu, got {_dtype_name(scale_dtype)}"
        )
    if scale_dtype != torch.float32 and not pow2_scales:
        raise ValueError(
            f"{op}: `scale_dtype`=torch.float8_e8m0fnu holds powers of two only: it needs pow2_scales=True"
        )
    if scale_layout not in ("row", "column"):
        raise ValueError(f'{op}: `scale_layout` must be "row" or "column", got "{scale_layout}"')
    if scale_layout == "column" and scaling == "tensor":
        raise ValueError(
            f'{op}: `scale_layout`="column" is for scaling="row" or "group"; a per-tensor scale has no layout'
        )
    if static_scale is not None:
        if scaling != "tensor":
            raise ValueError(f'{op}: `static_scale` is for scaling="tensor", got scaling="{scaling}"')
        if not (math.isfinite(static_scale) and static_scale > 0):
            raise ValueError(f"{op}: `static_scale` must be a finite number > 0, got {static_scale:f}")
    return QuantRecipe(dtype, scaling, group_size, pow2_scales, scale_dtype, scale_layout, static_scale)


def _check_inputs(name: str, args: tuple, kwargs: dict) -> list:
    """The unfused op's checks (_kernels.check; a quantize call's x is checked as a unary op's), with the quantizing
    op's name in the messages, as the C++ checks give it; returns h's shape."""
    unfused = _unfused(name) or _FIRST_UNARY
    spec = OPS[unfused]
    params, layout = _kernels.split_kwargs(unfused, kwargs)
    try:
        _kernels.check(unfused, args, params, layout)
    except (TypeError, ValueError, RuntimeError) as e:
        raise type(e)(str(e).replace(f"ffn_ext.{unfused}:", f"ffn_ext.{name}:", 1)) from None
    shape = list(args[0].shape)
    if spec.kind == "packed":
        shape[-1] = shape[-1] // 2
    return shape


def _alloc(op: str, ref: torch.Tensor, h_shape: list, r: QuantRecipe):
    """(q, scale) as alloc_quant allocates them: q contiguous in the fp8 dtype; scale [] / [..., 1] /
    [..., K / group_size] in scale_dtype, the "column" layout allocated [n, ...] and viewed as [..., n] (the rows'
    index varies fastest)."""
    q = torch.empty(h_shape, dtype=r.dtype, device=ref.device)
    if r.scaling == "tensor":
        return q, torch.empty((), dtype=r.scale_dtype, device=ref.device)
    if not h_shape:
        raise ValueError(
            f'{op}: scaling="{r.scaling}" needs h with at least 1 dimension ([..., K]), got a 0-dim tensor'
        )
    k, n = h_shape[-1], 1
    if r.scaling == "group":
        if k % r.group_size != 0:
            raise ValueError(f"{op}: `group_size`={r.group_size} must divide the last dimension of h, got {k}")
        n = k // r.group_size
    if r.scale_layout == "row":
        return q, torch.empty((*h_shape[:-1], n), dtype=r.scale_dtype, device=ref.device)
    col = torch.empty((n, *h_shape[:-1]), dtype=r.scale_dtype, device=ref.device)
    return q, col.permute(*range(1, len(h_shape)), 0)


_RECIPE = ("dtype", "scaling", "group_size", "pow2_scales", "scale_dtype", "scale_layout", "static_scale")


def _prepare(name: str, args: tuple, kwargs: dict):
    """What every kernel of op `name` starts with: the recipe's checks, the inputs' checks, the outputs."""
    op = f"ffn_ext.{name}"
    recipe = parse_recipe(op, *(kwargs[k] for k in _RECIPE))
    h_shape = _check_inputs(name, args, kwargs)
    return recipe, _alloc(op, args[0], h_shape, recipe)


def _fake(name: str):
    def fake(*args, **kwargs):
        return _prepare(name, args, kwargs)[1]

    return fake


def composite(name: str):
    """Op `name` with ATen: h by the unfused op through the dispatcher (x itself for quantize), then quant.py's
    formula, written into the outputs the kernels allocate. The CPU kernel; the CUDA kernel where the CUDA library
    is not loaded; what the functional API calls for float64 CUDA inputs, which the CUDA kernels refuse."""
    unfused = _unfused(name)

    def kernel(*args, **kwargs):
        recipe, (q, scale) = _prepare(name, args, kwargs)
        if unfused is None:
            h = args[0]
        else:
            params, layout = _kernels.split_kwargs(unfused, kwargs)
            extra = params if layout is None else dict(params, layout=layout)
            h = getattr(torch.ops.ffn_ext, unfused).default(*args, **extra)
        hq, hs = reference_quantize(h, recipe, f"ffn_ext.{name}")
        return q.copy_(hq), scale.copy_(hs)

    return kernel


def _no_cuda_composite(name: str):
    kernel = composite(name)

    def cuda(*args, **kwargs):
        _kernels._warn_no_cuda_kernels()
        return kernel(*args, **kwargs)

    return cuda


def _autograd(name: str):
    """The Autograd kernel: refuses inputs that require grad under grad mode (the quantizing ops are not
    differentiable: a silent constant would be a wrong gradient), else runs the op below autograd."""
    arg_names = [a.name for a in getattr(torch.ops.ffn_ext, name).default._schema.arguments]

    def kernel(keyset, *args, **kwargs):
        if torch.is_grad_enabled():
            for arg, t in zip(arg_names, args):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    raise RuntimeError(
                        f"ffn_ext.{name}: `{arg}` requires grad; the quantizing ops are forward only (not "
                        "differentiable): call them under torch.no_grad() or on detached tensors"
                    )
        return _kernels._below(name, keyset, args, kwargs)

    return kernel


_libs: list = []  # the torch.library.Library: registrations last as long as it lives


def register() -> None:
    """Registers the quantizing ops' kernels once, when a native library has defined their schemas."""
    if _libs or not hasattr(torch.ops.ffn_ext, "quantize"):
        return
    # the CUDA library's own kernels, if it is loaded (asked before the composite takes the key)
    cuda_kernels = torch._C._dispatch_has_kernel_for_dispatch_key("ffn_ext::quantize", "CUDA")
    lib = torch.library.Library("ffn_ext", "IMPL")  # noqa: TOR901  # (not a new namespace: the schemas exist)
    _libs.append(lib)
    for name in op_names():
        torch.library.register_fake(f"ffn_ext::{name}", _fake(name), lib=lib)
        lib.impl(name, composite(name), "CPU")
        if not cuda_kernels:
            lib.impl(name, _no_cuda_composite(name), "CUDA")
        lib.impl(name, _autograd(name), "Autograd", with_keyset=True)


quant._composite = composite  # what the functional API calls for float64 CUDA inputs
_kernels.hooks.append(register)  # a native library adopted later (ffn_ext.jit.load)
if _kernels._libs:  # ... or already adopted (ffn_ext._C at the package's import)
    register()
