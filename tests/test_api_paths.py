"""The functional API's call paths (ffn_ext/ops.py `_call`): plain tensors take the native library's fast entry
point (csrc/python_module.cpp `fast_call`), everything the entry declines takes torch.ops, and both give the same
results, errors, autograd and dispatch-mode behaviour.

A spy replaces each fast entry point, so every test knows which path served the call; a test of the torch.ops
path also checks that the entry point was offered the call and declined it.

Every forward op of the table has a fast entry point (csrc/python_module.cpp), gated ops with parameters
(swiglu_clamped) and the packed ops' layouts included: it takes the op's tensors, then its keyword arguments
positionally in schema order (ops._KEYWORDS: the parameters, then a packed op's layout; _extra below). A scalar of
the wrong type makes it decline, and torch.ops raises (or ops._check_extra, the ValueError naming the argument).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from optable import (
    DEVICES,
    FORWARD_OPS,
    N_INPUTS,
    PACKINGS,
    PARAM_OPS,
    RecordOps,
    api_call,
    call,
    is_packed,
    make_inputs,
    make_layout,
    op_kwargs,
    spec,
)
from torch.overrides import TorchFunctionMode

import ffn_ext
from ffn_ext import ops as api

pytestmark = pytest.mark.skipif(not api._fast, reason="no native library with fast entry points is loaded")


@pytest.fixture(autouse=True)
def _native_paths_only(monkeypatch):
    """These tests are about the native paths: plain CPU tensors would take the host path (the ATen expression,
    ops._on_host; tests/test_host_path.py) first, so it is off here."""
    monkeypatch.setattr(api, "_on_host", lambda args: False)


API = {name: N_INPUTS[name] for name in FORWARD_OPS}  # every forward op of the table has a fast entry point


def _args(name, device, dtype=torch.float32, requires_grad=False):
    shape = (3, 10) if is_packed(name) else (3, 5)
    return tuple(make_layout(shape, dtype, device).requires_grad_(requires_grad) for _ in range(API[name]))


def _extra(name, packing="concat", params=None):
    """The scalar arguments ops.py passes op `name`'s fast entry after its tensors: op_kwargs' values (the example
    parameters, the layout) in the order of ops._KEYWORDS."""
    kw = op_kwargs(name, packing if is_packed(name) else None, params)
    assert set(kw) == set(api._KEYWORDS[name]), (name, kw, api._KEYWORDS[name])
    return tuple(kw[k] for k in api._KEYWORDS[name])


def test_every_forward_op_has_a_fast_entry():
    assert sorted(api._fast) == sorted(FORWARD_OPS)
    assert PARAM_OPS and any(name in api._fast for name in PARAM_OPS)  # the gated ops with parameters too
    # its scalar arguments: the schema's keyword-only ones, in order (parameters, then layout)
    for name in FORWARD_OPS:
        schema = getattr(torch.ops.ffn_ext, name).default._schema
        assert api._KEYWORDS[name] == tuple(a.name for a in schema.arguments if a.kwarg_only), name


@pytest.mark.parametrize("name", [n for n in FORWARD_OPS if spec(n).params or is_packed(n)])
def test_parameters_and_layouts_take_the_fast_entry(monkeypatch, name):
    """A gated op with parameters, and a packed op in every layout: the fast entry serves the call, dispatching
    exactly the op, with torch.ops' result for the same keyword arguments."""
    spy = Spy(monkeypatch, name)
    for packing in PACKINGS if is_packed(name) else (None,):
        args = make_inputs(name, (3, 5), torch.float32, packing=packing or "concat")
        with RecordOps() as rec:
            out = api_call(name, packing)(*args)
        assert rec.ops == [f"ffn_ext.{name}.default"], rec.ops
        assert torch.equal(out, call(name, packing)(*args))
    assert spy.results == ["served"] * (len(PACKINGS) if is_packed(name) else 1), spy.results
    if is_packed(name) and not spec(name).params:  # the default layout, passed or not
        spy.results.clear()
        (gu,) = _args(name, "cpu")
        assert torch.equal(api_call(name, "concat")(gu), api_call(name)(gu))
        assert spy.results == ["served", "served"]


class Spy:
    """Wraps ops._fast[name]: records what each call returned (a tensor, NotImplemented) or raised."""

    def __init__(self, monkeypatch, name):
        self.results = []
        real = api._fast[name]

        def spy(*args):
            try:
                out = real(*args)
            except Exception as e:
                self.results.append(type(e))
                raise
            self.results.append("declined" if out is NotImplemented else "served")
            return out

        monkeypatch.setitem(api._fast, name, spy)


@pytest.mark.parametrize("device", DEVICES + ["meta"])
@pytest.mark.parametrize("name", API)
def test_plain_tensors_take_the_fast_entry_and_match_torch_ops(monkeypatch, name, device):
    spy = Spy(monkeypatch, name)
    for dtype in (torch.float32, torch.bfloat16):
        args = _args(name, device, dtype)
        out = api_call(name)(*args)
        want = call(name)(*args)
        assert out.shape == want.shape and out.dtype == dtype and out.device == want.device
        if device != "meta":
            assert torch.equal(out, want)
    assert spy.results == ["served", "served"]


def test_keyword_arguments_take_the_fast_entry(monkeypatch):
    spy = Spy(monkeypatch, "swiglu")
    gate, up = _args("swiglu", "cpu")
    torch.testing.assert_close(ffn_ext.swiglu(up=up, gate=gate), F.silu(gate) * up)
    assert spy.results == ["served"]


@pytest.mark.parametrize("name", API)
def test_fast_entry_declines_what_torch_ops_must_serve(name):
    fast = api._fast[name]
    args, extra = _args(name, "cpu"), _extra(name)

    class Sub(torch.Tensor):
        pass

    assert isinstance(fast(*args, *extra), torch.Tensor)
    assert fast(*args, *extra, args[0]) is NotImplemented  # wrong number of arguments: torch.ops raises the error
    assert fast(*args[:-1], *extra) is NotImplemented
    assert fast(*(a.as_subclass(Sub) for a in args), *extra) is NotImplemented
    assert fast(*([1.0] * len(args)), *extra) is NotImplemented
    with TorchFunctionMode():
        assert fast(*args, *extra) is NotImplemented
    if extra:  # a scalar of the wrong type (a str parameter, a float layout), or one missing
        for k in range(len(extra)):
            wrong = list(extra)
            wrong[k] = 1.5 if isinstance(wrong[k], str) else "7"
            assert fast(*args, *wrong) is NotImplemented, (name, wrong)
        assert fast(*args, *extra[:-1]) is NotImplemented
        assert fast(*args) is NotImplemented


def test_autograd_through_the_fast_entry(monkeypatch):
    spy = Spy(monkeypatch, "swiglu")
    gate, up = _args("swiglu", "cpu", torch.float64, requires_grad=True)
    out = ffn_ext.swiglu(gate, up)
    assert out.grad_fn is not None and spy.results == ["served"]
    assert torch.autograd.gradcheck(ffn_ext.swiglu, (gate, up))
    with torch.no_grad():
        assert ffn_ext.swiglu(gate, up).grad_fn is None


def test_torch_dispatch_mode_sees_the_op_through_the_fast_entry(monkeypatch):
    spy = Spy(monkeypatch, "gelu")
    (x,) = _args("gelu", "cpu")
    with RecordOps() as rec:
        out = ffn_ext.gelu(x)
    assert spy.results == ["served"]
    assert "ffn_ext.gelu.default" in rec.ops, rec.ops
    torch.testing.assert_close(out, F.gelu(x))


def test_torch_function_mode_and_subclasses_see_the_call(monkeypatch):
    class Log(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.funcs = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.funcs.append(func)
            return func(*args, **(kwargs or {}))

    class Tagged(torch.Tensor):
        seen = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.seen.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    spy = Spy(monkeypatch, "swiglu_packed")
    (gu,) = _args("swiglu_packed", "cpu")
    with Log() as log:
        out = ffn_ext.swiglu_packed(gu)
    assert torch.ops.ffn_ext.swiglu_packed.default in log.funcs, log.funcs
    out_sub = ffn_ext.swiglu_packed(gu.as_subclass(Tagged))
    assert torch.ops.ffn_ext.swiglu_packed.default in Tagged.seen and type(out_sub) is Tagged
    assert spy.results == ["declined", "declined"]
    torch.testing.assert_close(out, out_sub.as_subclass(torch.Tensor))


@pytest.mark.parametrize(
    "case, exc, pattern",
    [
        (
            "dtype",
            TypeError,
            r"ffn_ext\.gelu: expected `x` to have dtype float64, float32, float16 or bfloat16, "
            r"got torch\.int64",
        ),
        ("shape", ValueError, r"ffn_ext\.swiglu: expected `up` to have the shape of `gate`"),
        (
            "sparse",
            TypeError,
            r"ffn_ext\.gelu: expected `x` to be a dense strided tensor, got layout torch\.sparse_coo",
        ),
        ("limit", ValueError, r"ffn_ext\.swiglu_clamped: `limit` must be > 0"),
        ("alpha", ValueError, r"ffn_ext\.swiglu_clamped_packed: `alpha` must be finite"),
        ("layout", ValueError, r'ffn_ext\.swiglu_packed: `layout` must be "concat" or "interleaved", got "bogus"'),
        ("limit-str", ValueError, r"ffn_ext\.swiglu_clamped: `limit` must be > 0, got '7'"),
        ("layout-int", ValueError, r'ffn_ext\.geglu_packed: `layout` must be "concat" or "interleaved", got "1"'),
    ],
)
def test_errors_through_the_fast_entry(monkeypatch, case, exc, pattern):
    # The entry raises the op's own error (dtype, shape, a parameter's or the layout's value), or declines (a scalar
    # of the wrong type) or the dispatcher fails, and _call raises the clear error.
    name = {
        "shape": "swiglu",
        "limit": "swiglu_clamped",
        "limit-str": "swiglu_clamped",
        "alpha": "swiglu_clamped_packed",
        "layout": "swiglu_packed",
        "layout-int": "geglu_packed",
    }.get(case, "gelu")
    spy = Spy(monkeypatch, name)
    x = torch.randn(3, 4)
    call = {
        "dtype": lambda: ffn_ext.gelu(torch.arange(6)),
        "shape": lambda: ffn_ext.swiglu(x, torch.randn(3, 5)),
        "sparse": lambda: ffn_ext.gelu(x.to_sparse()),
        "limit": lambda: ffn_ext.swiglu_clamped(x, x, limit=0.0),
        "alpha": lambda: ffn_ext.swiglu_clamped_packed(x, limit=7.0, alpha=float("nan")),
        "layout": lambda: ffn_ext.swiglu_packed(x, layout="bogus"),
        "limit-str": lambda: ffn_ext.swiglu_clamped(x, x, limit="7"),
        "layout-int": lambda: ffn_ext.geglu_packed(x, layout=1),
    }[case]
    with pytest.raises(exc, match=pattern):
        call()
    assert len(spy.results) == 1 and spy.results[0] in (TypeError, ValueError, NotImplementedError, "declined"), (
        spy.results
    )


def test_compile_takes_the_torch_ops_path(monkeypatch):
    # Under torch.compile the entry point is never called: dynamo traces the torch.ops call into the graph.
    spy = Spy(monkeypatch, "silu")
    (x,) = _args("silu", "cpu")
    compiled = torch.compile(lambda t: ffn_ext.silu(t) * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), F.silu(x) * 2)
    assert spy.results == []
    torch._dynamo.reset()
