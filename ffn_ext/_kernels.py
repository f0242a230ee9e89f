"""The ffn_ext ops' Python halves, written from the table (ffn_ext/table.py): everything but the CUDA kernels.

The native library (ffn_ext._C, a JIT build, or libffn_ext_ops) registers the schemas and the CUDA kernels (without
one, ``define()`` registers the schemas here); ``register()`` adds, for every op of the table:

- its CPU kernel: the op's checks, then its ATen form (table.py), into outputs laid out as the CUDA kernels' are.
  This is the CPU's whole policy: on the CPU an op is PyTorch's own ops. Without CUDA kernels it serves CUDA
  tensors too, after a one-time warning;
- its fake (Meta) kernel: the same checks, and outputs of the real kernels' shapes, dtypes and strides;
- its autograd: two torch.autograd.Functions per differentiable op, of the same backward and jvp: one applied by
  the op's Autograd kernel (``FUNCTIONS``), and one in the form torch.func takes (``FUNC_FUNCTIONS``: forward
  without ctx, setup_context, a generated vmap rule), which the route applies under a transform. A forward op's
  backward is its ``*_backward`` op; a ``*_backward`` op's own derivatives are those of its forward op's ATen form
  (every order); every op's jvp is computed from its ATen form. The recompute ops (which serve backward passes)
  refuse to record. On the CPU the ops whose ATen autograd is their backward op's (OpSpec.aten_autograd: GELU,
  SiLU) record ATen's own autograd of their CPU kernel instead (``_cpu_autograd``): eager PyTorch's cost;
- its vmap batching rule (one call of the op for the whole batch).

The checks here own the user-facing rules, exception types and messages (``check``): the CPU and fake kernels run
them, and the functional API runs them to explain an error of a CUDA kernel, whose C++ guards keep only their own
invariants (csrc/shapes.cpp).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from . import _compat
from .table import LAYOUTS, OPS, SCHEMAS, bind_params, check_params

__all__ = [
    "CPU_KERNELS",
    "FLOAT_DTYPES",
    "FUNCTIONS",
    "KEYWORDS",
    "check",
    "check_kinds",
    "cpu_kernel",
    "eager",
    "route",
    "add_hook",
    "define",
    "register",
    "split_kwargs",
]

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_FLOATS = frozenset(FLOAT_DTYPES)
# op name -> its keyword-only scalar arguments, in schema order: a gated op's parameters, then a packed op's layout
KEYWORDS = {n: tuple(p.name for p in s.params) + (("layout",) if s.kind == "packed" else ()) for n, s in OPS.items()}


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
    """A TypeError naming the first of args that is not a dense strided tensor (the dispatcher sends sparse, nested
    and quantized tensors to keys without ffn_ext kernels, whose errors do not say why)."""
    for name, t in zip(names, args):
        err = _kind_error(op, name, t)
        if err is not None:
            raise err from None


def split_kwargs(name: str, kwargs: dict):
    """(params, layout) of a call of op `name` from its keyword arguments, the schema's defaults filled in (layout:
    None but for the packed ops); an unknown or missing one is a TypeError."""
    spec = OPS[name]
    packed = spec.kind == "packed"
    if spec.gated is None:  # an activation's ops: no keyword arguments
        if kwargs:
            raise TypeError(f"ffn_ext.{name}: unexpected keyword argument(s) {sorted(kwargs)}")
        return {}, None
    params = bind_params(f"ffn_ext.{name}", spec.gated, kwargs, ("layout",) if packed else ())
    return params, (kwargs.get("layout", "concat") if packed else None)


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


def check(name: str, args: tuple, params: dict, layout: str | None) -> None:
    """Every check op `name` makes of its tensors `args` (the dispatcher's keys, or check_kinds, vouch that they are
    tensors, not nested or quantized), its parameters and (packed ops) its layout, with the user-facing type and
    message: TypeError (dtype, layout), ValueError (shape, parameters, layout argument), RuntimeError (device)."""
    spec = OPS[name]
    op = f"ffn_ext.{name}"
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
            raise ValueError(f"{op}: expected `gate_up` to have at least 1 dimension ([..., 2*M]), got a 0-dim tensor")
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


def _plain(args: tuple) -> bool:
    """A CPU kernel's arguments are plainly valid: floating point, and (more than one) of one dtype and shape, all on
    the CPU. What check() would pass, in a few attribute reads, for dense strided tensors (what the dispatcher sends
    a CPU kernel, and what the route's fast path calls one with: eager); the kernels run check() where it is False."""
    a = args[0]
    if a.dtype not in _FLOATS:
        return False
    for t in args[1:]:
        if t.dtype is not a.dtype or t.shape != a.shape or not t.is_cpu:
            return False
    return True


# ---------------------------------------------------------------- the outputs' layout
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


def _fake(name: str):
    def fake(*args, **kwargs):
        check_kinds(f"ffn_ext.{name}", OPS[name].args, args)
        params, layout = split_kwargs(name, kwargs)
        check(name, args, params, layout)
        ref = args[-1]
        outs = tuple(
            torch.empty(shape, dtype=ref.dtype, device=ref.device, memory_format=fmt)
            for shape, fmt in _out_shapes(name, args)
        )
        return outs if len(outs) > 1 else outs[0]

    return fake


def _laid_out(name: str, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """out in the layout the fake kernel promised (ATen's pointwise ops keep an input's strides: a transposed view's,
    an interleaved pack's): as it is when contiguous, the common case."""
    return out if out.is_contiguous() else out.contiguous(memory_format=_out_shapes(name, args)[0][1])


def cpu_kernel(name: str):
    """Op `name`'s CPU kernel: its checks, then its ATen form, in the fake kernel's layout. The ops without
    parameters or layout run their form resolved once, after _plain's quick test (a decode step's activation costs
    microseconds: docs/performance.md)."""
    spec = OPS[name]
    if spec.kind == "packed" or spec.params:

        def kernel(*args, **kwargs):
            params, layout = split_kwargs(name, kwargs)
            check(name, args, params, layout)
            out = OPS[name].compute(args, params, layout)
            if isinstance(out, tuple):
                return tuple(_laid_out(name, args, o) for o in out)
            return _laid_out(name, args, out)

        return kernel
    act, act_backward = spec.act.aten, spec.act.aten_backward
    form: Callable
    if spec.recompute:

        def form(grad, x):
            return act_backward(grad, x), act(x)

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
                check(name, args, _NO_PARAMS, None)
            out = form(*args)
            return out if out.is_contiguous() else _laid_out(name, args, out)

        return one

    def two(*args):
        if not _plain(args):
            check(name, args, _NO_PARAMS, None)
        a, b = form(*args)
        return _laid_out(name, args, a), _laid_out(name, args, b)

    return two


_NO_PARAMS: dict = {}


_warned_no_cuda = False
_cuda_off: str | None = None  # why the CUDA kernels are off (the loader's reason), for the warning


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


def _no_cuda_kernel(name: str):
    kernel = cpu_kernel(name)

    def cuda(*args, **kwargs):
        warn_no_cuda_kernels()
        return kernel(*args, **kwargs)

    return cuda


# ---------------------------------------------------------------- the route
# One route for every call of an op from Python (the functional API, the Functions' own backward, the MLPs): the
# dispatcher op, which routes devices, autograd, modes and subclasses. Its one fast path, for plain tensors in eager
# mode (`eager`), does what the dispatcher would do without its hops (microseconds a call: a decode step on a GPU
# without CUDA graphs pays them per activation): on the CPU the CPU kernel, directly (under ATen's autograd where
# the op's CPU autograd is its form's: OpSpec.aten_autograd, `_cpu_autograd`); elsewhere, where something is to be
# recorded, the op's Function, and else the op below its Python autograd kernel. Under a torch.func transform the
# call starts at the op's Function: torch runs a Python autograd formula under torch.func only when it is applied
# from Python (pytorch/pytorch#168393), and its forward calls the op. While torch.compile traces a transform, the op
# is its ATen form: dynamo traces no Function with a custom jvp.
_is_compiling = torch.compiler.is_compiling
_below_autograd = torch._C._AutoDispatchBelowAutograd
_grad_enabled = torch.is_grad_enabled
_any_requires_grad = torch._C._any_requires_grad
_function_mode = torch._C._is_torch_function_mode_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_layer_depth = torch._C._functorch.get_dynamic_layer_stack_depth
_tracing = torch._C._get_tracing_state  # torch.jit.trace: records the dispatcher op
_fw_ad = torch.autograd.forward_ad  # its _current_level: >= 0 while a dual level is open
_Tensor, _STRIDED = torch.Tensor, torch.strided
_overloads: dict = {}  # op name -> torch.ops.ffn_ext.<name>.default, looked up once
CPU_KERNELS: dict = {}  # op name -> its CPU kernel (register fills it): what the dispatcher would call


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


def overload(name: str):
    """torch.ops.ffn_ext.<name>.default. Under torch.compile it is looked up, never cached: filling the cache while
    traced made dynamo guard on its contents, so every compiled function recompiled on its second call
    (tests/test_compile_export.py)."""
    if _is_compiling():
        return getattr(torch.ops.ffn_ext, name).default
    op = _overloads.get(name)
    if op is None:
        op = _overloads[name] = getattr(torch.ops.ffn_ext, name).default
    return op


def route(name: str, args: tuple, kwargs: dict):
    """Op `name` on tensors `args` with its keyword arguments, by the one route (above)."""
    if eager(args):
        if args[0].is_cpu:  # (another argument on another device: the CPU kernel's check names it)
            if name in ATEN_AUTOGRAD or not (_grad_enabled() and _any_requires_grad(*args)):
                return CPU_KERNELS[name](*args, **kwargs)
        elif not (_grad_enabled() and _any_requires_grad(*args)):
            with _below_autograd():
                return overload(name)(*args, **kwargs)
        function = FUNCTIONS.get(name)  # (none for the recompute ops: their autograd kernel refuses to record)
        if function is not None:
            return function.apply(*args, *(kwargs.get(k, DEFAULTS[name][k]) for k in KEYWORDS[name]))
    elif name in FUNCTIONS and _compat.functorch_active():
        if _is_compiling():  # dynamo traces no Function with a custom jvp: the ATen form, which it traces whole
            params, layout = split_kwargs(name, kwargs)
            check(name, args, params, layout)
            return OPS[name].compute(args, params, layout)
        return FUNC_FUNCTIONS[name].apply(*args, *(kwargs.get(k, DEFAULTS[name][k]) for k in KEYWORDS[name]))
    return overload(name)(*args, **kwargs)


# op name -> {keyword: default} (None: required; the op's own check names it)
DEFAULTS = {
    n: {**{p.name: p.default for p in s.params}, **({"layout": "concat"} if s.kind == "packed" else {})}
    for n, s in OPS.items()
}


# ---------------------------------------------------------------- autograd
def _tuple(t) -> tuple:
    return t if isinstance(t, tuple) else (t,)


def _aten_fn(name: str, params: dict, layout: str | None):
    """Op `name` as a function of its tensors from the ATen forms, differentiable to every order by torch.autograd
    and torch.func: a forward op's own form; a *_backward op (grad, *primals) -> the vjp of its forward op's form
    (ATen's own backward formulas are not all differentiable: silu_backward is not)."""
    spec = OPS[name]
    if not spec.backward:
        return lambda *ins: spec.compute(ins, params, layout)

    def forward(*ins):
        return OPS[spec.forward_name].compute(ins, params, layout)

    def backward_op(grad, *primals):
        outs = torch.func.vjp(forward, *primals)[1](grad)
        return outs if len(outs) > 1 else outs[0]

    return backward_op


def _jvp(fn, primals: tuple, tangents: tuple):
    """The Jacobian-vector product of fn at primals by reverse mode only (forward-mode AD does not nest, and this runs
    inside one): the vjp u -> J^T u is linear in u, so the vjp of that map at u = 0 for the cotangent t is J t."""
    out, vjp_fn = torch.func.vjp(fn, *primals)[:2]
    outs = _tuple(out)
    zeros = tuple(torch.zeros_like(o) for o in outs)
    vjp_vjp = torch.func.vjp(lambda *us: vjp_fn(us if len(us) > 1 else us[0]), *zeros)[1]
    js = vjp_vjp(tangents)
    return js if len(js) > 1 else js[0]


def _functions(name: str) -> tuple[Any, Any]:
    """Op `name`'s two autograd.Functions, of the same backward and jvp: apply(*tensors, *its keyword arguments in
    schema order) runs the op and records them. The first, forward(ctx, ...), serves the Autograd kernel (recorded
    gradients, forward-mode tangents); the second, forward without ctx and setup_context, is the form torch.func
    takes (with a generated vmap rule: the op's batching rule runs under it), applied by the route under a
    transform. Two, because torch's apply of the second form costs about 20 us more a call (it binds the arguments
    with inspect.signature). backward is a forward op's *_backward op (through the route, so differentiable in
    turn) and a *_backward op's vjp of its ATen form; jvp is the ATen form's."""
    spec = OPS[name]
    n, keys = len(spec.args), KEYWORDS[name]

    def run(args):  # the dispatcher op (not route, which under torch.func would apply the Function again)
        ins, kwargs = args[:n], dict(zip(keys, args[n:]))
        if eager(ins):  # (grad mode is off in a Function's forward: the fast path's kernel below autograd)
            return route(name, ins, kwargs)
        return overload(name)(*ins, **kwargs)

    def save(ctx, args):
        ctx.extra = args[n:]
        ctx.save_for_backward(*args[:n])
        ctx.save_for_forward(*args[:n])

    def backward(ctx, *grads):
        tensors, kwargs = ctx.saved_tensors, dict(zip(keys, ctx.extra))
        if not spec.backward:
            grads_in = _tuple(route(name + "_backward", (grads[0], *tensors), kwargs))
        else:
            params, layout = split_kwargs(name, kwargs)
            fn = _aten_fn(name, params, layout)
            grads_in = torch.func.vjp(fn, *tensors)[1](grads if len(grads) > 1 else grads[0])
        needs = ctx.needs_input_grad
        return (*(g if needs[i] else None for i, g in enumerate(grads_in)), *(None,) * len(keys))

    def jvp(ctx, *tangents):
        params, layout = split_kwargs(name, dict(zip(keys, ctx.extra)))
        primals = ctx.saved_tensors
        tangents = tuple(torch.zeros_like(p) if t is None else t for p, t in zip(primals, tangents[:n]))
        return _jvp(_aten_fn(name, params, layout), primals, tangents)

    def forward_ctx(ctx, *args):
        save(ctx, args)
        return run(args)

    common = {"backward": staticmethod(backward), "jvp": staticmethod(jvp)}
    recorded = type(f"ffn_ext_{name}", (torch.autograd.Function,), {"forward": staticmethod(forward_ctx), **common})
    transformed = type(
        f"ffn_ext_{name}_func",
        (torch.autograd.Function,),
        {
            "forward": staticmethod(lambda *args: run(args)),
            "setup_context": staticmethod(lambda ctx, inputs, output: save(ctx, inputs)),
            "generate_vmap_rule": True,
            **common,
        },
    )
    return recorded, transformed


# differentiable op name -> its autograd.Functions (_functions; register fills them): the Autograd kernel's, and
# torch.func's (the route applies it under a transform)
FUNCTIONS: dict[str, Any] = {}
FUNC_FUNCTIONS: dict[str, Any] = {}


def _records(args: tuple) -> bool:
    """Something is to be recorded: a gradient (grad mode on, an input requires grad) or a forward-mode tangent."""
    return (_grad_enabled() and _any_requires_grad(*args)) or (_fw_ad._current_level >= 0 and _compat.has_tangent(args))


# the ops whose CPU autograd is ATen's, of their CPU kernel's form (OpSpec.aten_autograd)
ATEN_AUTOGRAD = frozenset(n for n, s in OPS.items() if s.aten_autograd)


def _cpu_autograd(name: str):
    """Op `name`'s AutogradCPU kernel, for the ops of ATEN_AUTOGRAD: on plain tensors its CPU kernel, whose ATen ops
    record their own autograd (C++ nodes, every order, forward mode; what ATen's own act(gate) * up costs), also
    under torch.func. Anything else takes the Autograd kernel, then the dispatcher: tensor subclasses (DTensor,
    FakeTensor while torch.compile traces) and dispatch modes, so that their rules for the op apply and they see it
    (a compiled graph keeps it); sparse, nested and quantized tensors, which have no ffn_ext kernel."""
    kernel, general = CPU_KERNELS[name], _autograd(name)

    def autograd_cpu(keyset, *args, **kwargs):
        if _dispatch_modes():
            return general(keyset, *args, **kwargs)
        for t in args:
            if type(t) is not _Tensor or t.layout is not _STRIDED or t.is_nested or t.dtype not in _FLOATS:
                return general(keyset, *args, **kwargs)
        return kernel(*args, **kwargs)

    return autograd_cpu


def _autograd(name: str):
    """Op `name`'s Autograd kernel: its Function where something is to be recorded (a gradient, or a forward-mode
    tangent), else the kernel below autograd. The recompute ops have no Function: where a gradient would be
    recorded they raise, rather than return results autograd would silently treat as constants."""
    spec = OPS[name]
    keys, n = KEYWORDS[name], len(spec.args)
    op = getattr(torch.ops.ffn_ext, name).default  # (the schema exists when this registers)
    after_autograd = torch._C._after_autograd_keyset

    def kernel(keyset, *args, **kwargs):
        if _records(args):
            if not spec.differentiable:
                raise RuntimeError(
                    f"ffn_ext::{name} has no autograd formula (it serves a backward pass); call it under "
                    "torch.no_grad() or with inputs that do not require grad, or differentiate "
                    f"ffn_ext::{spec.forward_name}_backward instead"
                )
            if _layer_depth():
                raise RuntimeError(
                    f"torch.ops.ffn_ext.{name} under a torch.func transform (grad, jvp, ...): torch runs a Python "
                    "autograd formula under torch.func only when it is applied from Python, not from the "
                    f"dispatcher: call the functional API (ffn_ext.*, ffn_ext.ops.call_op({name!r}, ...)), which does"
                )
            return FUNCTIONS[name].apply(*args[:n], *(kwargs.get(k, DEFAULTS[name][k]) for k in keys))
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & after_autograd, *args, **kwargs)

    return kernel


# ---------------------------------------------------------------- vmap
def _batch_rule(name: str):
    """The vmap batching rule of op `name`, for every op of the table: the ops are elementwise over the leading
    dimensions (a packed op pairs elements along the last one only), so batching is free: move each input's batch
    dimension to the front (an unbatched input is expanded, no copy), which keeps a packed tensor's last dimension
    last, and call the op once on the whole batch. Outputs are batched at dim 0."""
    op = overload(name)
    n_out = OPS[name].n_outputs

    def rule(info, in_dims, *args, **kwargs):
        b = info.batch_size
        args = [t.movedim(d, 0) if d is not None else t.expand(b, *t.shape) for t, d in zip(args, in_dims)]
        return op(*args, **kwargs), (0 if n_out == 1 else (0,) * n_out)

    return rule


# ---------------------------------------------------------------- registration
_libs: list = []  # the torch.library.Library registering the kernels: registrations last as long as it lives
_hooks: list = []  # the quantizing ops' register (ffn_ext.quant, a module this one does not import)
_cuda_kernels = False
_defined: list = []  # the Library that defined the schemas, where no native library did


def add_hook(hook) -> None:
    """hook(lib, cuda_kernels) registers more ops' kernels on register's Library: now if register has run, else
    when it does."""
    _hooks.append(hook)
    if _libs:
        hook(_libs[0], _cuda_kernels)


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
    FUNCTIONS.clear()
    FUNC_FUNCTIONS.clear()
    CPU_KERNELS.clear()
    _overloads.clear()


def register(cuda_kernels: bool, cuda_off: str | None = None) -> None:
    """Registers the Python kernels and autograd of every op of the table (and the hooks'), once the schemas exist.
    cuda_kernels: whether the native library has CUDA kernels; without, the CPU kernels serve CUDA tensors, and
    warn once, giving `cuda_off` (why they are off) when known."""
    global _cuda_off, _cuda_kernels
    if _libs:
        return
    _cuda_off, _cuda_kernels = cuda_off, cuda_kernels
    lib = torch.library.Library("ffn_ext", "IMPL")  # noqa: TOR901  # (not a new namespace: the schemas exist)
    _libs.append(lib)
    for name, spec in OPS.items():
        torch.library.register_fake(f"ffn_ext::{name}", _fake(name), lib=lib)
        CPU_KERNELS[name] = cpu_kernel(name)
        lib.impl(name, CPU_KERNELS[name], "CPU")
        if not cuda_kernels:
            lib.impl(name, _no_cuda_kernel(name), "CUDA")
        if spec.differentiable:
            FUNCTIONS[name], FUNC_FUNCTIONS[name] = _functions(name)
        lib.impl(name, _autograd(name), "Autograd", with_keyset=True)
        if name in ATEN_AUTOGRAD:
            lib.impl(name, _cpu_autograd(name), "AutogradCPU", with_keyset=True)
        torch.library.register_vmap(f"ffn_ext::{name}", _batch_rule(name), lib=lib)
    for hook in _hooks:
        hook(lib, cuda_kernels)
