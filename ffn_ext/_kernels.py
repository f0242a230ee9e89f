"""The ffn_ext ops' Python halves, one ``Op`` object per op of the namespace (the table's and the quantizing ops):
everything but the CUDA kernels.

The native library (ffn_ext._C, a JIT build, or libffn_ext_ops) registers the schemas and the CUDA kernels (without
one, ``define()`` registers the schemas here); ``register()`` is a loop over the ops, each registering what it owns:

- its checks (``validate``): the user-facing rules, exception types and messages; the CPU and fake kernels run
  them, and a failed call runs them to explain a CUDA kernel's error, whose C++ guards keep only their own
  invariants (csrc/shapes.cpp);
- its CPU kernel: the checks, then its ATen form (table.py), into outputs laid out as the CUDA kernels' are. This is
  the CPU's whole policy: on the CPU an op is PyTorch's own ops. Without CUDA kernels it serves CUDA tensors too,
  after a one-time warning;
- its fake (Meta) kernel: the same checks, and outputs of the real kernels' shapes, dtypes and strides;
- its autograd: two torch.autograd.Functions per differentiable op, of the same backward and jvp: one applied by the
  op's Autograd kernel, one in the form torch.func takes (forward without ctx, setup_context, a generated vmap
  rule), applied under a transform. A forward op's backward is its ``*_backward`` op; a ``*_backward`` op's own
  derivatives are those of its forward op's ATen form (every order); every op's jvp is computed from its ATen form.
  The ops without a formula (the recompute ops, which serve backward passes, and the quantizing ops) refuse to
  record. On the CPU the ops whose ATen autograd is their backward op's (OpSpec.aten_autograd) record ATen's own
  autograd of their CPU kernel instead: eager PyTorch's cost;
- its vmap batching rule (one call of the op for the whole batch);
- its call by the one route (``Op.__call__``), which every call from Python takes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from . import _compat
from .table import (
    CACHE_GROUP_SIZES,
    CACHE_SCHEMAS,
    GATED_BY_NAME,
    LAYOUTS,
    OPS,
    QUANT_RECIPE_SCHEMA,
    QUANT_SCHEMAS,
    SCHEMAS,
    bind_params,
    check_params,
)

__all__ = ["FLOAT_DTYPES", "Op", "QuantOp", "CacheOp", "op", "eager", "define", "register", "undefine"]

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_FLOATS = frozenset(FLOAT_DTYPES)
_Tensor, _STRIDED = torch.Tensor, torch.strided


# ---------------------------------------------------------------- checks of tensors
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


def _dtype_error(op: str, name: str, t: torch.Tensor) -> TypeError:
    return TypeError(f"{op}: expected `{name}` to have dtype float64, float32, float16 or bfloat16, got {t.dtype}")


def _like_error(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor, shape: list) -> Exception:
    """The error of a tensor argument that does not match the one the others are checked against (dtype, device,
    shape: `shape`, the shape it must have)."""
    if t.dtype not in _FLOATS:
        return _dtype_error(op, name, t)
    if t.dtype != ref.dtype:
        return TypeError(f"{op}: expected `{name}` to have the dtype of `{ref_name}` ({ref.dtype}), got {t.dtype}")
    if t.device != ref.device:
        return RuntimeError(
            f"{op}: expected `{name}` to be on the device of `{ref_name}` ({ref.device}), got {t.device}"
        )
    if shape == list(ref.shape):
        return ValueError(f"{op}: expected `{name}` to have the shape of `{ref_name}` {shape}, got {list(t.shape)}")
    return ValueError(
        f"{op}: expected `{name}` to have the forward output's shape {shape} (gate_up's with the last dimension "
        f"halved), got {list(t.shape)}"
    )


def _plain(args: tuple) -> bool:
    """A CPU kernel's arguments are plainly valid: floating point, and (more than one) of one dtype and shape, all on
    the CPU. What the checks would pass, in a few attribute reads, for dense strided tensors (what the dispatcher
    sends a CPU kernel, and what the route's fast path calls one with); the kernels run the checks where it is
    False."""
    a = args[0]
    if a.dtype not in _FLOATS:
        return False
    for t in args[1:]:
        if t.dtype is not a.dtype or t.shape != a.shape or not t.is_cpu:
            return False
    return True


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


def _promoted(args: tuple) -> tuple | None:
    """args converted to their common dtype (torch.promote_types: float32 and bfloat16 -> float32) when they are
    floating-point tensors of different dtypes, as ATen's silu(gate) * up promotes (under autocast, a projection's
    bfloat16 output next to a float32 tensor): the op then computes once and rounds once, in that dtype. None
    otherwise (the checks then name what is wrong)."""
    for t in args:
        if not isinstance(t, torch.Tensor) or t.dtype not in _FLOATS:
            return None
    dtype = args[0].dtype
    if all(t.dtype is dtype for t in args):
        return None
    for t in args[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return tuple(t.to(dtype) for t in args)


# ---------------------------------------------------------------- the route's predicates
_is_compiling = torch.compiler.is_compiling
_below_autograd = torch._C._AutoDispatchBelowAutograd
_grad_enabled = torch.is_grad_enabled
_any_requires_grad = torch._C._any_requires_grad
_function_mode = torch._C._is_torch_function_mode_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_layer_depth = torch._C._functorch.get_dynamic_layer_stack_depth
_tracing = torch._C._get_tracing_state  # torch.jit.trace: records the dispatcher op
_fw_ad = torch.autograd.forward_ad  # its _current_level: >= 0 while a dual level is open


def eager(args: tuple) -> bool:
    """The fast path's one predicate: plain dense tensors, outside forward-mode AD, torch.func transforms,
    torch.compile's and torch.jit's tracing and torch function / dispatch modes. Under any of those the dispatcher
    op runs, and its autograd kernel decides."""
    if _is_compiling():  # first: dynamo cannot trace the checks below
        return False
    for t in args:
        if type(t) is not _Tensor or t.layout is not _STRIDED or t.is_nested:
            return False
    return _fw_ad._current_level < 0 and not (_layer_depth() or _function_mode() or _dispatch_modes() or _tracing())


def _records(args: tuple) -> bool:
    """Something is to be recorded: a gradient (grad mode on, an input requires grad) or a forward-mode tangent."""
    return (_grad_enabled() and _any_requires_grad(*args)) or (_fw_ad._current_level >= 0 and _compat.has_tangent(args))


def _tuple(t) -> tuple:
    return t if isinstance(t, tuple) else (t,)


def _jvp(fn, primals: tuple, tangents: tuple):
    """The Jacobian-vector product of fn at primals by reverse mode only (forward-mode AD does not nest, and this runs
    inside one): the vjp u -> J^T u is linear in u, so the vjp of that map at u = 0 for the cotangent t is J t."""
    out, vjp_fn = torch.func.vjp(fn, *primals)[:2]
    zeros = tuple(torch.zeros_like(o) for o in _tuple(out))
    vjp_vjp = torch.func.vjp(lambda *us: vjp_fn(us if len(us) > 1 else us[0]), *zeros)[1]
    js = vjp_vjp(tangents)
    return js if len(js) > 1 else js[0]


# ---------------------------------------------------------------- one op
_cuda_kernels = False  # the native library's CUDA kernels are loaded (register)
_cuda_off: str | None = None  # why the CUDA kernels are off (the loader's reason), for the warning
_warned_no_cuda = False
_dtensor_registrar: Callable[[], bool] | None = None  # ops._register_dtensor: True when it registered the strategies


def warn_no_cuda_kernels() -> None:
    """Warns once that CUDA tensors run PyTorch's ops (the CPU kernels' forms): the CUDA kernels are off."""
    global _warned_no_cuda
    if not _warned_no_cuda:
        _warned_no_cuda = True
        why = _cuda_off or "ffn_ext was built without CUDA kernels (CPU-only build)"
        warnings.warn(
            f"ffn_ext's CUDA kernels are off ({why}); CUDA tensors use the ATen composite. For the fused kernels, "
            "build ffn_ext with a CUDA toolkit against a torch of the CUDA major you run.",
            stacklevel=3,
        )


class Op:
    """torch.ops.ffn_ext.<name> from Python: a table op's checks, kernels, autograd, vmap rule and call (the module
    docstring). ``op(*tensors, **keywords)`` is the call every Python caller makes (the functional API, the
    Functions' own backward, the MLPs)."""

    def __init__(self, name: str) -> None:
        spec = self.spec = OPS[name]
        self.name, self.qualname, self.arg_names = name, f"ffn_ext.{name}", spec.args
        packed = spec.kind == "packed"
        # its keyword-only scalar arguments in schema order (a gated op's parameters, then a packed op's layout) and
        # their defaults (None: required; the checks name it)
        self.defaults = {**{p.name: p.default for p in spec.params}, **({"layout": "concat"} if packed else {})}
        self.keywords = tuple(self.defaults)
        self.aten_autograd = spec.aten_autograd  # on the CPU its autograd is ATen's, of its CPU kernel
        self.cpu = self._cpu_kernel()
        self.function = self.transform_function = None
        if spec.differentiable:
            self.function, self.transform_function = self._functions()
        self.overload: Any = None  # torch.ops.ffn_ext.<name>.default, and the eager call's kernels: set by register
        self.fast: tuple = ()

    # ------------------------------------------------------------ the route
    # One route for every call from Python: the dispatcher op, which routes devices, autograd, modes and subclasses,
    # with three exits. Eager (plain tensors, no mode or transform: `eager`), one fast call does what the dispatcher
    # would do without its hops (microseconds a call: a decode step on a GPU without CUDA graphs pays them per
    # activation), picked once per op and device by register: the CPU kernel; the op below its Python autograd
    # kernel; or, where something is to be recorded, the op's Function. Under a torch.func transform the call starts
    # at the op's Function: torch runs a Python autograd formula under torch.func only when it is applied from
    # Python (pytorch/pytorch#168393), and its forward calls the op. Everything else: the dispatcher op.
    def __call__(self, *args, **kwargs):
        try:
            if eager(args):
                return self.fast[args[0].is_cpu + 2 * (_grad_enabled() and _any_requires_grad(*args))](*args, **kwargs)
            if _is_compiling():  # torch 2.10's dynamo fails on the op's dtype error instead of tracing the except
                args = _promoted(args) or args
            if self.transform_function is not None and _compat.functorch_active():
                return self._transformed(args, kwargs)
            return self.overload(*args, **kwargs)
        except Exception as e:
            return self._failed(args, kwargs, e)

    def _failed(self, args: tuple, kwargs: dict, err: Exception):
        """A call that raised `err`: inputs of two float dtypes are promoted and run (the checks refused them), a
        DTensor call runs again once the sharding strategies are registered (never imported before it is needed);
        else the error of the first failing check (what a CUDA kernel's C++ guard or the dispatcher's "could not
        run" stands for), or `err` itself when every check passes."""
        promoted = _promoted(args)
        if promoted is not None:
            return self(*promoted, **kwargs)
        if _dtensor_registrar is not None and _compat.has_dtensor(args) and _dtensor_registrar():
            return self(*args, **kwargs)
        try:
            self.validate(args, kwargs, kinds=True)
        except (TypeError, ValueError, RuntimeError) as why:
            raise why from None
        raise err

    def _transformed(self, args: tuple, kwargs: dict):
        if _is_compiling():  # dynamo traces no Function with a custom jvp: the ATen form, which it traces whole
            return self.spec.compute(args, *self.validate(args, kwargs))
        assert self.transform_function is not None
        return self.transform_function.apply(*args, *self._scalars(kwargs))

    def _scalars(self, kwargs: dict) -> tuple:
        """The keyword arguments in schema order, the defaults filled in (a Function's apply takes them so)."""
        return tuple(kwargs.get(k, d) for k, d in self.defaults.items())

    def _kernels(self) -> tuple:
        """The eager call's kernel, indexed by (on the CPU) + 2 * (a gradient to record): the op below its Python
        autograd kernel or the CPU kernel; where a gradient is to be recorded, the Function (the CPU kernel on the
        CPU for the ops of ATen's autograd) or, without one, the dispatcher op, whose autograd kernel refuses."""
        overload, function = self.overload, self.function

        def below(*args, **kwargs):
            with _below_autograd():
                return overload(*args, **kwargs)

        record: Callable = overload
        if function is not None:

            def record(*args, **kwargs):
                return function.apply(*args, *self._scalars(kwargs))

        return below, self.cpu, record, (self.cpu if self.aten_autograd else record)

    # ------------------------------------------------------------ checks
    def validate(self, args: tuple, kwargs: dict, kinds: bool = False):
        """Every check of a call (kinds: that the tensors are dense strided tensors, which the dispatcher's keys
        vouch for in a kernel), with the user-facing type and message: TypeError (dtype, layout), ValueError
        (shape, parameters, layout argument), RuntimeError (device). Returns (params, layout): the gated op's
        parameters, all of them, and a packed op's layout (else None)."""
        spec, op = self.spec, self.qualname
        if kinds:
            for name, t in zip(self.arg_names, args):
                err = _kind_error(op, name, t)
                if err is not None:
                    raise err from None
        params: dict = {}
        if spec.gated is not None:
            params = bind_params(op, spec.gated, kwargs, ("layout",) if spec.kind == "packed" else ())
        elif kwargs:
            raise TypeError(f"{op}: unexpected keyword argument(s) {sorted(kwargs)}")
        layout = kwargs.get("layout", "concat") if spec.kind == "packed" else None
        if spec.params:
            check_params(op, spec.gated, params)
        r = 1 if spec.backward else 0  # the argument the others are checked against: x, gate or gate_up
        ref = args[r]
        if ref.dtype not in _FLOATS:
            raise _dtype_error(op, spec.args[r], ref)
        shape = list(ref.shape)
        if spec.kind == "packed":
            if layout not in LAYOUTS:
                raise ValueError(f'{op}: `layout` must be "concat" or "interleaved", got "{layout}"')
            if ref.dim() == 0:
                raise ValueError(
                    f"{op}: expected `gate_up` to have at least 1 dimension ([..., 2*M]), got a 0-dim tensor"
                )
            if shape[-1] % 2:
                raise ValueError(
                    f"{op}: expected the last dimension of `gate_up` to be even ([..., 2*M]), got shape {shape}"
                )
            shape[-1] //= 2  # grad's: the forward output's
        for k in [*range(r + 1, len(args)), *range(r)]:  # the order the C++ guards take them
            t = args[k]
            if t.layout is not _STRIDED:
                raise TypeError(f"{op}: expected `{spec.args[k]}` to be a dense strided tensor, got layout {t.layout}")
            if t.dtype is not ref.dtype or t.device != ref.device or list(t.shape) != shape:
                raise _like_error(op, spec.args[k], t, spec.args[r], ref, shape)
        return params, layout

    # ------------------------------------------------------------ kernels
    def _out_shapes(self, args: tuple) -> list:
        """(shape, memory format) of each output."""
        spec = self.spec
        if spec.kind == "packed":
            gu = args[-1]
            shape = gu.shape if spec.backward else (*gu.shape[:-1], gu.shape[-1] // 2)
            return [(shape, torch.contiguous_format)]
        return [(args[-1].shape, _format(args))] * spec.n_outputs

    def fake(self, *args, **kwargs):
        """The fake (Meta) kernel: the checks, and the outputs' shapes, dtypes and strides."""
        self.validate(args, kwargs, kinds=True)
        ref = args[-1]
        outs = tuple(
            torch.empty(shape, dtype=ref.dtype, device=ref.device, memory_format=fmt)
            for shape, fmt in self._out_shapes(args)
        )
        return outs if len(outs) > 1 else outs[0]

    def _laid_out(self, args: tuple, out: torch.Tensor) -> torch.Tensor:
        """out in the layout the fake kernel promised (ATen's pointwise ops keep an input's strides: a transposed
        view's, an interleaved pack's): as it is when contiguous, the common case."""
        return out if out.is_contiguous() else out.contiguous(memory_format=self._out_shapes(args)[0][1])

    def _cpu_kernel(self) -> Callable:
        """The CPU kernel: the checks, then the ATen form, in the fake kernel's layout. The ops without parameters or
        layout run their form resolved once, after _plain's quick test (a decode step's activation costs
        microseconds: docs/performance.md)."""
        spec, laid_out = self.spec, self._laid_out
        if spec.kind == "packed" or spec.params:

            def kernel(*args, **kwargs):
                out = spec.compute(args, *self.validate(args, kwargs))
                return tuple(laid_out(args, o) for o in out) if isinstance(out, tuple) else laid_out(args, out)

            return kernel
        act, act_backward = spec.act.aten, spec.act.aten_backward
        form: Callable
        if spec.recompute and spec.kind == "unary":

            def form(grad, x):
                return act_backward(grad, x), act(x)

        elif spec.recompute:

            def form(grad, gate, up):  # (dgate, dup, h): act(gate) made once, h written over it after dup
                a = act(gate)
                return act_backward(grad * up, gate), grad * a, a.mul_(up)

        elif spec.kind == "unary":
            form = act_backward if spec.backward else act
        elif spec.backward:

            def form(grad, gate, up):  # the table's Gated.backward without parameters, resolved once
                return act_backward(grad * up, gate), grad * act(gate)

        else:

            def form(gate, up):  # act(gate) * up
                return act(gate) * up

        if spec.n_outputs == 1:

            def one(*args):
                if not _plain(args):
                    self.validate(args, {})
                out = form(*args)
                return out if out.is_contiguous() else laid_out(args, out)

            return one

        def several(*args):
            if not _plain(args):
                self.validate(args, {})
            return tuple(laid_out(args, o) for o in form(*args))

        return several

    def _no_cuda_kernel(self) -> Callable:
        kernel = self.cpu

        def cuda(*args, **kwargs):
            warn_no_cuda_kernels()
            return kernel(*args, **kwargs)

        return cuda

    # ------------------------------------------------------------ autograd
    def _aten_fn(self, params: dict, layout: str | None):
        """The op as a function of its tensors from the ATen forms, differentiable to every order by torch.autograd
        and torch.func: a forward op's own form; a *_backward op (grad, *primals) -> the vjp of its forward op's form
        (ATen's own backward formulas are not all differentiable: silu_backward is not)."""
        spec = self.spec
        if not spec.backward:
            return lambda *ins: spec.compute(ins, params, layout)
        forward_spec = OPS[spec.forward_name]

        def backward_op(grad, *primals):
            outs = torch.func.vjp(lambda *ins: forward_spec.compute(ins, params, layout), *primals)[1](grad)
            return outs if len(outs) > 1 else outs[0]

        return backward_op

    def _functions(self) -> tuple[Any, Any]:
        """The op's two autograd.Functions, of the same backward and jvp: apply(*tensors, *its keyword arguments in
        schema order) runs the op and records them. The first, forward(ctx, ...), serves the Autograd kernel
        (recorded gradients, forward-mode tangents); the second, forward without ctx and setup_context, is the form
        torch.func takes (with a generated vmap rule: the op's batching rule runs under it). Two, because torch's
        apply of the second form costs about 20 us more a call (it binds the arguments with inspect.signature).
        backward is a forward op's *_backward op (by its route, so differentiable in turn) and a *_backward op's
        vjp of its ATen form; jvp is the ATen form's."""
        spec, n, keys = self.spec, len(self.arg_names), self.keywords

        def run(args):  # the kernel, never the Function again (grad mode is off in a Function's forward)
            ins, kwargs = args[:n], dict(zip(keys, args[n:]))
            return self.fast[ins[0].is_cpu](*ins, **kwargs) if eager(ins) else self.overload(*ins, **kwargs)

        def save(ctx, args):
            ctx.extra = args[n:]
            ctx.save_for_backward(*args[:n])
            ctx.save_for_forward(*args[:n])

        def backward(ctx, *grads):
            tensors, kwargs = ctx.saved_tensors, dict(zip(keys, ctx.extra))
            if not spec.backward:
                grads_in = _tuple(OP[self.name + "_backward"](grads[0], *tensors, **kwargs))
            else:
                fn = self._aten_fn(*self.validate(tensors, kwargs))
                grads_in = torch.func.vjp(fn, *tensors)[1](grads if len(grads) > 1 else grads[0])
            needs = ctx.needs_input_grad
            return (*(g if needs[i] else None for i, g in enumerate(grads_in)), *(None,) * len(keys))

        def jvp(ctx, *tangents):
            primals = ctx.saved_tensors
            fn = self._aten_fn(*self.validate(primals, dict(zip(keys, ctx.extra))))
            tangents = tuple(torch.zeros_like(p) if t is None else t for p, t in zip(primals, tangents[:n]))
            return _jvp(fn, primals, tangents)

        def forward_ctx(ctx, *args):
            save(ctx, args)
            return run(args)

        common = {"backward": staticmethod(backward), "jvp": staticmethod(jvp)}
        recorded = type(
            f"ffn_ext_{self.name}", (torch.autograd.Function,), {"forward": staticmethod(forward_ctx), **common}
        )
        transformed = type(
            f"ffn_ext_{self.name}_func",
            (torch.autograd.Function,),
            {
                "forward": staticmethod(lambda *args: run(args)),
                "setup_context": staticmethod(lambda ctx, inputs, output: save(ctx, inputs)),
                "generate_vmap_rule": True,
                **common,
            },
        )
        return recorded, transformed

    def _no_formula(self, args: tuple) -> RuntimeError:
        return RuntimeError(
            f"ffn_ext::{self.name} has no autograd formula (it serves a backward pass); call it under torch.no_grad() "
            f"or with inputs that do not require grad, or differentiate ffn_ext::{self.spec.forward_name}_backward "
            "instead"
        )

    def _autograd(self) -> Callable:
        """The Autograd kernel: the Function where something is to be recorded (a gradient, or a forward-mode
        tangent), else the kernel below autograd. Without a Function it raises there, rather than return results
        autograd would silently treat as constants."""
        op, after_autograd = self.overload, torch._C._after_autograd_keyset

        def kernel(keyset, *args, **kwargs):
            if _records(args):
                if self.function is None:
                    raise self._no_formula(args)
                if _layer_depth():
                    raise RuntimeError(
                        f"torch.ops.ffn_ext.{self.name} under a torch.func transform (grad, jvp, ...): torch runs a "
                        "Python autograd formula under torch.func only when it is applied from Python, not from the "
                        f"dispatcher: call the functional API (ffn_ext.*, ffn_ext.ops.call_op({self.name!r}, ...)), "
                        "which does"
                    )
                return self.function.apply(*args, *self._scalars(kwargs))
            with torch._C._AutoDispatchBelowAutograd():
                return op.redispatch(keyset & after_autograd, *args, **kwargs)

        return kernel

    def _autograd_cpu(self, general: Callable) -> Callable:
        """The AutogradCPU kernel of the ops of ATen's autograd: on plain tensors the CPU kernel, whose ATen ops
        record their own autograd (C++ nodes, every order, forward mode; what ATen's own act(gate) * up costs), also
        under torch.func. Anything else takes the Autograd kernel (`general`), then the dispatcher: tensor subclasses
        (DTensor, FakeTensor while torch.compile traces) and dispatch modes, so that their rules for the op apply and
        they see it (a compiled graph keeps it); sparse, nested and quantized tensors, which have no kernel."""
        kernel = self.cpu

        def autograd_cpu(keyset, *args, **kwargs):
            if _dispatch_modes():
                return general(keyset, *args, **kwargs)
            for t in args:
                if type(t) is not _Tensor or t.layout is not _STRIDED or t.is_nested or t.dtype not in _FLOATS:
                    return general(keyset, *args, **kwargs)
            return kernel(*args, **kwargs)

        return autograd_cpu

    # ------------------------------------------------------------ vmap
    def _batch_rule(self, info, in_dims, *args, **kwargs):
        """The vmap batching rule: the ops are elementwise over the leading dimensions (a packed op pairs elements
        along the last one only), so batching is free: move each input's batch dimension to the front (an
        unbatched input is expanded, no copy), which keeps a packed tensor's last dimension last, and call the op
        once on the whole batch. Outputs are batched at dim 0."""
        b = info.batch_size
        args = tuple(t.movedim(d, 0) if d is not None else t.expand(b, *t.shape) for t, d in zip(args, in_dims))
        n_out = self.spec.n_outputs
        return self.overload(*args, **kwargs), (0 if n_out == 1 else (0,) * n_out)

    # ------------------------------------------------------------ registration
    def register(self, lib, cuda_kernels: bool) -> None:
        """Registers the op's kernels, autograd and vmap rule on `lib` (cuda_kernels: the native library has its CUDA
        kernel; without, its CPU kernel serves CUDA tensors too)."""
        name = self.name
        self.overload = getattr(torch.ops.ffn_ext, name).default
        self.fast = self._kernels()
        torch.library.register_fake(f"ffn_ext::{name}", self.fake, lib=lib)
        lib.impl(name, self.cpu, "CPU")
        if not cuda_kernels:
            lib.impl(name, self._no_cuda_kernel(), "CUDA")
        general = self._autograd()
        lib.impl(name, general, "Autograd", with_keyset=True)
        if self.aten_autograd:
            lib.impl(name, self._autograd_cpu(general), "AutogradCPU", with_keyset=True)
        torch.library.register_vmap(f"ffn_ext::{name}", self._batch_rule, lib=lib)


class QuantOp(Op):
    """A quantizing op (<gated>_quant, <gated>_packed_quant, quantize: ffn_ext.quant): (q, scale) of the unfused op's
    output by a recipe (QuantRecipe's fields as keyword arguments). Forward only; its CPU kernel is the unfused op,
    then ffn_ext.quant's formula. `quant`: that module (add_quant)."""

    def __init__(self, name: str, quant) -> None:
        self.quant = quant
        # the unfused op, whose checks it makes (quantize's x is checked as a unary op's, and has no unfused op)
        self.unfused = None if name == "quantize" else name[: -len("_quant")]
        self.checked = OP[self.unfused or next(n for n, s in OPS.items() if s.kind == "unary")]
        self.spec = self.checked.spec
        self.name, self.qualname = name, f"ffn_ext.{name}"
        self.arg_names = self.spec.args
        self.defaults = {}  # (keyword arguments pass through as given)
        self.keywords = ()
        self.aten_autograd = False
        self.cpu = self._cpu_kernel()
        self.function = self.transform_function = None
        self.overload, self.fast = None, ()

    def __call__(self, *args, **kwargs):
        a = args[0] if args else None
        if isinstance(a, torch.Tensor) and a.is_cuda and a.dtype is torch.float64:
            return self.cpu(*args, **kwargs)  # the CUDA kernels take no float64: the op's ATen kernel
        return super().__call__(*args, **kwargs)

    def validate(self, args: tuple, kwargs: dict, kinds: bool = False):
        """Every check: the recipe (QuantRecipe's, named for the op), the inputs (the unfused op's, named for the
        op), and that the recipe fits h's shape. Returns (recipe, h's shape)."""
        op, q = self.qualname, self.quant
        try:
            recipe = q.QuantRecipe(*(kwargs[k] for k in _RECIPE))
        except (TypeError, ValueError) as e:
            raise type(e)(str(e).replace("QuantRecipe:", f"{op}:", 1)) from None
        checked = self.checked
        try:
            checked.validate(args, self._unfused_kwargs(kwargs), kinds=True)
        except (TypeError, ValueError, RuntimeError) as e:
            raise type(e)(str(e).replace(f"{checked.qualname}:", f"{op}:", 1)) from None
        shape = list(args[0].shape)
        if self.spec.kind == "packed":
            shape[-1] //= 2
        if recipe.scaling != "tensor":
            if not shape:
                raise ValueError(
                    f"{op}: scaling={recipe.scaling!r} needs h with at least 1 dimension ([..., K]), got a 0-dim tensor"
                )
            q.group_len(op, recipe, shape[-1])
        return recipe, shape

    def _unfused_kwargs(self, kwargs: dict) -> dict:
        """The unfused op's keyword arguments of a call (the dispatcher drops those at their default)."""
        return {k: kwargs[k] for k in self.checked.keywords if k in kwargs}

    @staticmethod
    def _alloc(ref: torch.Tensor, h_shape: list, r):
        """(q, scale) as the CUDA kernels allocate them: q contiguous in the fp8 dtype; scale [] / [..., 1] /
        [..., K / group_size] in scale_dtype, the "column" layout allocated [n, ...] and viewed as [..., n] (the
        rows' index varies fastest)."""
        q = torch.empty(h_shape, dtype=r.dtype, device=ref.device)
        if r.scaling == "tensor":
            return q, torch.empty((), dtype=r.scale_dtype, device=ref.device)
        n = h_shape[-1] // r.group_size if r.scaling == "group" else 1
        if r.scale_layout == "row":
            return q, torch.empty((*h_shape[:-1], n), dtype=r.scale_dtype, device=ref.device)
        col = torch.empty((n, *h_shape[:-1]), dtype=r.scale_dtype, device=ref.device)
        return q, col.permute(*range(1, len(h_shape)), 0)

    def fake(self, *args, **kwargs):
        recipe, shape = self.validate(args, kwargs)
        return self._alloc(args[0], shape, recipe)

    def _cpu_kernel(self) -> Callable:
        """h by the unfused op (x itself for quantize), then ffn_ext.quant's formula, written into the outputs the
        CUDA kernels allocate. Also the CUDA kernel where the CUDA library is not loaded, and for float64 inputs."""
        unfused = None if self.unfused is None else OP[self.unfused]

        def kernel(*args, **kwargs):
            recipe, shape = self.validate(args, kwargs)
            q, scale = self._alloc(args[0], shape, recipe)
            h = args[0] if unfused is None else unfused(*args, **self._unfused_kwargs(kwargs))
            hq, hs = self.quant.reference_quantize(h, recipe, self.qualname)
            return q.copy_(hq), scale.copy_(hs)

        return kernel

    def _no_formula(self, args: tuple) -> RuntimeError:
        arg = next((n for n, t in zip(self.arg_names, args) if isinstance(t, torch.Tensor) and t.requires_grad), None)
        what = f"`{arg}` requires grad" if arg else "an input has a forward-mode tangent"
        return RuntimeError(
            f"{self.qualname}: {what}; the quantizing ops are forward only (not differentiable): call them under "
            "torch.no_grad() or on detached tensors"
        )

    def _batch_rule(self, info, in_dims, *args, **kwargs):
        """Each sample quantized as if alone. Row and group scales belong to a row, and the ops take every leading
        dimension as rows, so one call on the batch (its dim moved to the front) is that; a static per-tensor scale
        is elementwise, the same for every sample; a dynamic per-tensor scale is a sample's own amax, so that recipe
        runs one call per sample (what torch's fallback would do, without its warning)."""
        b, op = info.batch_size, self.overload
        args = tuple(t.movedim(d, 0) if d is not None else t.expand(b, *t.shape) for t, d in zip(args, in_dims))
        if kwargs["scaling"] != "tensor":
            return op(*args, **kwargs), (0, 0)
        if kwargs["static_scale"] is not None:
            return op(*args, **kwargs), (0, None)
        outs = [op(*(a[i] for a in args), **kwargs) for i in range(b)]
        return (torch.stack([q for q, _ in outs]), torch.stack([s for _, s in outs])), (0, 0)


class CacheOp(QuantOp):
    """An FP8 activation cache op (table.CACHE_SCHEMAS): <gated>_cache(gate, up, *, group_size, params) -> (h, q,
    scale) and <gated>_cached_backward(grad, q, scale, *, params) -> (dgate, dup, h). Forward only (they serve
    ffn_ext.mlp's autograd); the CPU kernel is the gated op and ffn_ext.quant's formula (cache), or the cache read
    back and the gated op's backward and forward (cached_backward), the CUDA kernels' results to their rounding."""

    def __init__(self, name: str, quant) -> None:
        self.quant, self.backward = quant, name.endswith("_cached_backward")
        gated = name[: -len("_cached_backward")] if self.backward else name[: -len("_cache")]
        self.gated = GATED_BY_NAME[gated]
        self.checked = OP[gated]
        self.spec = self.checked.spec
        self.name, self.qualname = name, f"ffn_ext.{name}"
        self.arg_names = ("grad", "q", "scale") if self.backward else ("gate", "up")
        self.defaults, self.keywords, self.aten_autograd = {}, (), False
        self.cpu = self._cpu_kernel()
        self.function = self.transform_function = None
        self.overload, self.fast = None, ()

    def validate(self, args: tuple, kwargs: dict, kinds: bool = False):
        """Every check, named for the op. Returns (the gated op's parameters, the group size)."""
        op = self.qualname
        kwargs = dict(kwargs)
        if not self.backward:
            group = kwargs.pop("group_size", 128)
            checked = self.checked
            try:
                params, _ = checked.validate(args, kwargs, kinds=True)
            except (TypeError, ValueError, RuntimeError) as e:
                raise type(e)(str(e).replace(f"{checked.qualname}:", f"{op}:", 1)) from None
            if isinstance(group, bool) or group not in CACHE_GROUP_SIZES:
                raise ValueError(f"{op}: `group_size` must be one of {CACHE_GROUP_SIZES}, got {group!r}")
            gate = args[0]
            if gate.dim() == 0 or gate.shape[-1] % group:
                raise ValueError(
                    f"{op}: `group_size`={group} must divide the last dimension of `gate`, got shape {list(gate.shape)}"
                )
            return params, group
        for name, t in zip(self.arg_names, args):
            err = _kind_error(op, name, t)
            if err is not None:
                raise err from None
        params = bind_params(op, self.gated, kwargs)
        if self.gated.params:
            check_params(op, self.gated, params)
        grad, q, scale = args
        if grad.dtype not in _FLOATS:
            raise _dtype_error(op, "grad", grad)
        if grad.dim() == 0:
            raise ValueError(f"{op}: expected `grad` to have at least 1 dimension ([..., M]), got a 0-dim tensor")
        m = grad.shape[-1]
        lead = list(grad.shape[:-1])
        if q.dtype != torch.float8_e4m3fn or q.device != grad.device or list(q.shape) != lead + [2 * m]:
            raise ValueError(
                f"{op}: expected `q` to be a float8_e4m3fn tensor of shape {lead + [2 * m]} on {grad.device} "
                f"(`grad` [..., M], `q` [..., 2M]), got {q.dtype} {list(q.shape)} on {q.device}"
            )
        n = scale.shape[-1] if scale.dim() == grad.dim() else 0
        group = 2 * m // n if n and (2 * m) % n == 0 else 0
        if (
            scale.dtype != torch.float32
            or scale.device != grad.device
            or list(scale.shape) != lead + [n]
            or group not in CACHE_GROUP_SIZES
            or m % group
        ):
            raise ValueError(
                f"{op}: expected `scale` to be a float32 tensor of shape [..., 2M / G] on {grad.device}, G one of "
                f"{CACHE_GROUP_SIZES} dividing M={m}, got {scale.dtype} {list(scale.shape)} on {scale.device}"
            )
        return params, group

    def fake(self, *args, **kwargs):
        _, group = self.validate(args, kwargs)
        ref = args[0]
        if self.backward:
            return tuple(torch.empty(ref.shape, dtype=ref.dtype, device=ref.device) for _ in range(3))
        lead, m = ref.shape[:-1], ref.shape[-1]
        return (
            torch.empty(ref.shape, dtype=ref.dtype, device=ref.device),
            torch.empty((*lead, 2 * m), dtype=torch.float8_e4m3fn, device=ref.device),
            torch.empty((*lead, 2 * m // group), dtype=torch.float32, device=ref.device),
        )

    def _cpu_kernel(self) -> Callable:
        """The ATen formula: the gated op (its CPU kernel) and ffn_ext.quant's formula, or its reading back, by blocks
        of rows written into the outputs, so that the formula's temporaries are a block's (the CUDA kernels hold none):
        the MLPs' peak on the CPU stays below what reading the cache whole cost. Also the CUDA kernel where the CUDA
        library has none, and for float64 inputs."""
        fwd, bwd, quant = OP[self.gated.name], OP[self.gated.name + "_backward"], self.quant

        def cache(gate, up, **kwargs):
            params, group = self.validate((gate, up), kwargs)
            lead, m = gate.shape[:-1], gate.shape[-1]
            g, u = gate.reshape(-1, m), up.reshape(-1, m)
            n, k = g.shape[0], m // group
            h = gate.new_empty((n, m))
            q = gate.new_empty((n, 2 * m), dtype=torch.float8_e4m3fn)
            scale = gate.new_empty((n, 2 * k), dtype=torch.float32)
            recipe = quant.QuantRecipe(group_size=group)
            for s, e in _blocks(n):
                h[s:e] = fwd(g[s:e], u[s:e], **params)
                for j, t in enumerate((g[s:e], u[s:e])):  # each half alone: no group spans both
                    qb, sb = quant.reference_quantize(t, recipe, self.qualname)
                    q[s:e, j * m : (j + 1) * m] = qb
                    scale[s:e, j * k : (j + 1) * k] = sb
            return h.view(*lead, m), q.view(*lead, 2 * m), scale.view(*lead, 2 * k)

        def cached_backward(grad, q, scale, **kwargs):
            params, _ = self.validate((grad, q, scale), kwargs)
            m = grad.shape[-1]
            d, qr, sr = grad.reshape(-1, m), q.reshape(-1, 2 * m), scale.reshape(-1, scale.shape[-1])
            k = sr.shape[-1] // 2
            outs = [torch.empty(grad.shape, dtype=grad.dtype, device=grad.device) for _ in range(3)]
            dg, du, h = (o.view(-1, m) for o in outs)
            for s, e in _blocks(d.shape[0]):
                g, u = (
                    quant.dequantize(qr[s:e, j * m : (j + 1) * m], sr[s:e, j * k : (j + 1) * k], grad.dtype)
                    for j in (0, 1)
                )
                dg[s:e], du[s:e] = bwd(d[s:e], g, u, **params)
                h[s:e] = fwd(g, u, **params)
            return tuple(outs)

        return cached_backward if self.backward else cache

    def _batch_rule(self, info, in_dims, *args, **kwargs):
        """Row by row, so one call on the batch (its dim moved to the front) is each sample's."""
        b = info.batch_size
        args = tuple(t.movedim(d, 0) if d is not None else t.expand(b, *t.shape) for t, d in zip(args, in_dims))
        return self.overload(*args, **kwargs), (0, 0, 0)


def _blocks(rows: int):
    """(start, end) of the CPU cache kernels' blocks: 8 per call, of at least 128 rows."""
    step = max(128, -(-rows // 8))
    return ((s, min(s + step, rows)) for s in range(0, rows, step))


_RECIPE = tuple(f.split(" ")[-1] for f in QUANT_RECIPE_SCHEMA.split(", "))  # the recipe's schema arguments

OP: dict[str, Op] = {name: Op(name) for name in OPS}  # every op of the namespace by name (add_quant: the quant ops)


def op(name: str) -> Op:
    """The Op of torch.ops.ffn_ext.<name>."""
    return OP[name]


# ---------------------------------------------------------------- registration
_libs: list = []  # the torch.library.Library registering the kernels: registrations last as long as it lives
_defined: list = []  # the Library that defined the schemas, where no native library did


def define() -> None:
    """Defines every schema of the ffn_ext namespace from the table (table.SCHEMAS), where no native library did:
    the ops then run the Python kernels on every device."""
    if _defined:
        return
    lib = torch.library.Library("ffn_ext", "DEF")  # noqa: TOR901
    _defined.append(lib)
    for schema, pointwise in SCHEMAS:
        lib.define(schema, tags=(torch.Tag.pointwise,) if pointwise else ())


def undefine() -> None:
    """Drops what define() and register() registered (ffn_ext.jit.load, to register a native library instead)."""
    for lib in _libs + _defined:
        lib._destroy()
    _libs.clear()
    _defined.clear()
    for o in OP.values():
        o.overload, o.fast = None, ()


def register(cuda_kernels: bool, cuda_off: str | None = None, dtensor_registrar=None) -> None:
    """Registers every op's Python kernels and autograd, once the schemas exist. cuda_kernels: whether the native
    library has CUDA kernels; without, the CPU kernels serve CUDA tensors, and warn once, giving `cuda_off` (why they
    are off) when known. dtensor_registrar: registers the DTensor strategies when a DTensor first fails a call."""
    global _cuda_off, _cuda_kernels, _dtensor_registrar
    if _libs:
        return
    _cuda_off, _cuda_kernels, _dtensor_registrar = cuda_off, cuda_kernels, dtensor_registrar
    lib = torch.library.Library("ffn_ext", "IMPL")  # noqa: TOR901  # (not a new namespace: the schemas exist)
    _libs.append(lib)
    for o in OP.values():
        o.register(lib, _native_cuda(o) if isinstance(o, QuantOp) else cuda_kernels)


def _native_cuda(o: Op) -> bool:
    """The native library has this quantizing or cache op's CUDA kernel (it may have the table's without them)."""
    return _cuda_kernels and torch._C._dispatch_has_kernel_for_dispatch_key(f"ffn_ext::{o.name}", "CUDA")


def add_quant(quant) -> None:
    """The quantizing and FP8 cache ops join OP, made with ffn_ext.quant's recipe and formula (`quant`, which
    imports this module: it calls this), registered now if register() has run, else with the other ops."""
    for name in (*QUANT_SCHEMAS, *CACHE_SCHEMAS):
        if name not in OP:
            OP[name] = CacheOp(name, quant) if name in CACHE_SCHEMAS else QuantOp(name, quant)
            if _libs:
                OP[name].register(_libs[0], _native_cuda(OP[name]))
