"""What a module's code computes: a method (forward, an experts class's _apply_gate, a BERT layer's
feed_forward_chunk) is parsed with ast and run symbolically on the module instance; the value it returns is a tree
of the typed values below, which the forms (forms.py) match. No class name is consulted, so a class a transformers
release adds is recognised, and one it changes is read again from its new code.

The interpreter takes straight-line code: assignments (tuple unpacking included), calls of the module's own
attributes, the tensor methods and torch functions a gating uses (chunk, clamp, sigmoid, the table's activations by
torch's name), + - * and unary minus, the two halves of a packed projection ([gate | up] by chunk, interleaved by
[..., ::2]), and `if` statements whose test reads only the module's attributes (`if self.limit is not None:`): the
test is decided on the instance, and the attributes it read are kept as guards that the patched code checks on
every call. Anything else (loops, other calls, other methods, dtype casts) raises NotAForm inside, and evaluate()
says None: the module runs as it is. Any other exception is a bug of the interpreter and propagates."""

from __future__ import annotations

import ast
import inspect
import operator
import re
import textwrap
from dataclasses import dataclass
from typing import NamedTuple

from .common import MISSING, GateSpec


class NotAForm(Exception):
    """The code leaves the subset the interpreter reads: the expected "not recognised"."""


@dataclass(frozen=True)
class Named:
    """Code of a recognised shape that no ffn_ext op computes, with why."""

    reason: str


# ---------------------------------------------------------------- the values
class Value:
    """A symbolic value of the code (frozen dataclasses: equal when they compute the same thing)."""


@dataclass(frozen=True)
class In(Value):
    index: int  # the method's input after self


@dataclass(frozen=True)
class Attr(Value):
    name: str  # self.<name>


@dataclass(frozen=True)
class Const(Value):
    value: float | None


@dataclass(frozen=True)
class Call(Value):
    attr: str  # self.<attr>(*args)
    args: tuple[Value, ...]


@dataclass(frozen=True)
class Tup(Value):
    items: tuple[Value, ...]


@dataclass(frozen=True)
class Half(Value):
    of: Value
    index: int  # 0: the first half, 1: the second
    interleaved: bool = False  # of[..., index::2]


@dataclass(frozen=True)
class Mul(Value):
    factors: tuple[Value, ...]  # flattened, in a canonical order: a * b * c in any grouping


@dataclass(frozen=True)
class Add(Value):
    terms: tuple[Value, ...]  # in a canonical order


@dataclass(frozen=True)
class Clamp(Value):
    of: Value
    lo: Value
    hi: Value


@dataclass(frozen=True)
class Dropout(Value):
    of: Value
    p: str  # F.dropout(of, p=self.<p>, training=self.training)


@dataclass(frozen=True)
class Fn(Value):
    name: str  # "neg", "sigmoid", "chunk" (of.chunk(2, dim=-1), not yet unpacked), or a table activation by torch's
    of: Value  # function name: F.silu, F.gelu(approximate=...), F.relu


NONE = Const(None)


def _canonical(items) -> tuple:
    return tuple(sorted(items, key=repr))


def _mul(*factors: Value) -> Mul:
    flat: list[Value] = []
    for f in factors:
        flat.extend(f.factors if isinstance(f, Mul) else (f,))
    return Mul(_canonical(flat))


def _number(v: Value) -> float | None:
    """The number a literal is, else None."""
    return v.value if isinstance(v, Const) else None


def _add(a: Value, b: Value) -> Value:
    na, nb = _number(a), _number(b)
    if na is not None and nb is not None:
        return Const(na + nb)
    return Add(_canonical((a, b)))


def _neg(a: Value) -> Value:
    if isinstance(a, Const):
        if a.value is None:
            raise NotAForm
        return Const(-a.value)
    return Fn("neg", a)


# torch functions by their dotted names as written in transformers' code: "F." and "nn.functional." are torch's
_ACT_FUNCTIONS = {"silu", "gelu", "relu"}
_GELU_MODES = {"none": "gelu", "tanh": "gelu_tanh"}
_NAMESPACES = ("torch.nn.functional.", "nn.functional.", "F.", "torch.")
_TESTS = {ast.Is: operator.is_, ast.IsNot: operator.is_not, ast.Eq: operator.eq, ast.NotEq: operator.ne}


def _function_name(node: ast.expr) -> str | None:
    """'silu' for F.silu / nn.functional.silu / torch.nn.functional.silu / torch.silu; None if not such a name."""
    text = ast.unparse(node)
    for ns in _NAMESPACES:
        if text.startswith(ns) and "." not in text[len(ns) :]:
            return text[len(ns) :]
    return None


def _self_attr(node) -> str | None:
    """'a' for self.a, else None."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


class _Interp:
    """Runs a function's body symbolically on `module`: its parameters after self are In(0), In(1), ..."""

    def __init__(self, module, params) -> None:
        self.module = module
        self.guards: dict[str, object] = {}  # attribute -> the value an `if` test read of it
        self.env: dict[str, Value] = {p: In(i) for i, p in enumerate(params)}

    # -- statements
    def run(self, body) -> Value | None:
        for st in body:
            if isinstance(st, ast.Pass) or (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant)):
                continue  # a docstring
            if isinstance(st, ast.Return):
                if st.value is None:
                    raise NotAForm
                return self.expr(st.value)
            if isinstance(st, ast.Assign):
                value = self.expr(st.value)
                for t in st.targets:
                    self.assign(t, value)
            elif isinstance(st, ast.AnnAssign) and st.value is not None:
                self.assign(st.target, self.expr(st.value))
            elif isinstance(st, ast.AugAssign) and isinstance(st.target, ast.Name):
                self.env[st.target.id] = self.binop(st.op, self.expr(st.target), self.expr(st.value))
            elif isinstance(st, ast.If):
                out = self.run(st.body if self.test(st.test) else st.orelse)
                if out is not None:
                    return out
            else:
                raise NotAForm
        return None

    def assign(self, target, value: Value) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] = value
        elif isinstance(target, ast.Tuple) and not any(isinstance(e, ast.Starred) for e in target.elts):
            for t, v in zip(target.elts, self.items(value, len(target.elts))):
                self.assign(t, v)
        else:
            raise NotAForm

    @staticmethod
    def items(value: Value, n: int) -> tuple[Value, ...]:
        if isinstance(value, Tup) and len(value.items) == n:
            return value.items
        if isinstance(value, Fn) and value.name == "chunk" and n == 2:
            return Half(value.of, 0), Half(value.of, 1)
        raise NotAForm

    # -- `if` tests, decided on the instance
    def test(self, node) -> bool:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return not self.test(node.operand)
        if isinstance(node, ast.BoolOp):
            values = (self.test(v) for v in node.values)
            return all(values) if isinstance(node.op, ast.And) else any(values)
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _TESTS:
            return bool(_TESTS[type(node.ops[0])](self.attr_value(node.left), self.constant(node.comparators[0])))
        return bool(self.attr_value(node))

    def attr_value(self, node):
        name = _self_attr(node)
        if name is None:
            raise NotAForm
        value = getattr(self.module, name, MISSING)
        if value is MISSING or not isinstance(value, (bool, int, float, str, type(None))):
            raise NotAForm
        self.guards[name] = value
        return value

    @staticmethod
    def constant(node):
        """A literal: a number, None, a string, or a negative number."""
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, type(None))):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            if isinstance(node.operand.value, (int, float)) and not isinstance(node.operand.value, bool):
                return -node.operand.value
        raise NotAForm

    # -- expressions
    def expr(self, node) -> Value:
        if isinstance(node, ast.Name):
            if node.id not in self.env:
                raise NotAForm
            return self.env[node.id]
        if isinstance(node, ast.Constant):
            v = node.value
            if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)):
                return Const(v)
            raise NotAForm
        if isinstance(node, ast.Attribute):
            name = _self_attr(node)
            if name is None:
                raise NotAForm
            return Attr(name)
        if isinstance(node, ast.Tuple):
            return Tup(tuple(self.expr(e) for e in node.elts))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return _neg(self.expr(node.operand))
        if isinstance(node, ast.BinOp):
            return self.binop(node.op, self.expr(node.left), self.expr(node.right))
        if isinstance(node, ast.Subscript):
            return self.subscript(self.expr(node.value), node.slice)
        if isinstance(node, ast.Call):
            return self.call(node)
        raise NotAForm

    @staticmethod
    def binop(op, a: Value, b: Value) -> Value:
        if isinstance(op, ast.Mult):
            return _mul(a, b)
        if isinstance(op, ast.Add):
            return _add(a, b)
        if isinstance(op, ast.Sub):
            return _add(a, _neg(b))
        raise NotAForm

    def subscript(self, value: Value, index) -> Value:
        i = index.value if isinstance(index, ast.Constant) else None
        if type(i) is int and i in (0, 1):
            return self.items(value, 2)[i]
        if isinstance(index, ast.Tuple) and len(index.elts) == 2:  # t[..., ::2], t[..., 1::2]
            dots, s = index.elts
            if (
                isinstance(dots, ast.Constant)
                and dots.value is Ellipsis
                and isinstance(s, ast.Slice)
                and s.upper is None
            ):
                lower = self.constant(s.lower) if s.lower is not None else 0
                step = self.constant(s.step) if s.step is not None else None
                if step == 2 and lower in (0, 1):
                    return Half(value, lower, interleaved=True)
        raise NotAForm

    def call(self, node: ast.Call) -> Value:
        func = node.func
        kw = {k.arg: k.value for k in node.keywords}
        if None in kw or any(isinstance(a, ast.Starred) for a in node.args):
            raise NotAForm
        attr = _self_attr(func)
        if attr is not None:
            if kw:
                raise NotAForm
            return Call(attr, tuple(self.expr(a) for a in node.args))
        name = _function_name(func)
        if name is not None and not (isinstance(func, ast.Attribute) and self.is_local(func.value)):
            return self.function(name, [self.expr(a) for a in node.args], kw)
        if isinstance(func, ast.Attribute):  # a tensor method
            return self.function(func.attr, [self.expr(func.value)] + [self.expr(a) for a in node.args], kw)
        raise NotAForm

    def is_local(self, node) -> bool:
        """Whether `node` is a local variable (x.silu() is a method call, F.silu(x) a function)."""
        return isinstance(node, ast.Name) and node.id in self.env

    def function(self, name: str, args: list, kw: dict) -> Value:
        def arg(i, key, default=NONE):  # the i-th positional argument or the keyword `key`
            return args[i] if len(args) > i else self.expr(kw.pop(key)) if key in kw else default

        if not args:
            raise NotAForm
        if name == "chunk":  # t.chunk(2, dim=-1), torch.chunk(t, 2, -1)
            chunks, dim = arg(1, "chunks"), arg(2, "dim", Const(0))
            if chunks != Const(2) or dim != Const(-1) or kw or len(args) > 3:
                raise NotAForm
            return Fn("chunk", args[0])
        if name == "clamp":
            lo, hi = arg(1, "min"), arg(2, "max")
            if kw or len(args) > 3:
                raise NotAForm
            return Clamp(args[0], lo, hi)
        if name == "dropout" and len(args) == 1 and set(kw) == {"p", "training"}:
            p, training = self.expr(kw["p"]), self.expr(kw["training"])
            if not isinstance(p, Attr) or training != Attr("training"):
                raise NotAForm
            return Dropout(args[0], p.name)
        if name == "sigmoid" and len(args) == 1 and not kw:
            return Fn("sigmoid", args[0])
        if name in _ACT_FUNCTIONS and len(args) == 1:
            approximate = kw.pop("approximate", None)
            if kw:
                raise NotAForm
            if approximate is None:
                return Fn(name, args[0])
            entry = _GELU_MODES.get(self.constant(approximate)) if name == "gelu" else None
            if entry is None:
                raise NotAForm
            return Fn(entry, args[0])
        raise NotAForm


def _source(fn) -> ast.FunctionDef | None:
    """The function's parsed definition (None where its source cannot be read: built in, made by exec)."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    if code not in _PARSED:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError, SyntaxError):
            tree = None
        node = tree.body[0] if tree is not None and tree.body else None
        _PARSED[code] = node if isinstance(node, ast.FunctionDef) else None
    return _PARSED[code]


_PARSED: dict = {}  # code object -> its FunctionDef (or None), parsed once per function


class Read(NamedTuple):
    """What a method returns, read from its code on an instance, and the (attribute, value) guards its `if` tests
    read."""

    value: Value
    guards: tuple


def evaluate(module, fn, n_inputs: int) -> Read | None:
    """fn(module, <n_inputs inputs>) read symbolically, or None when its code is not of the subset the interpreter
    reads or does not take exactly `n_inputs` inputs after self."""
    node = _source(fn)
    if node is None or node.decorator_list:
        return None
    a = node.args
    params = [p.arg for p in a.posonlyargs + a.args]
    if len(params) != n_inputs + 1 or a.vararg or a.kwarg or a.kwonlyargs or a.defaults:
        return None
    interp = _Interp(module, params[1:])
    try:
        value = interp.run(node.body)
    except NotAForm:
        return None
    return None if value is None else Read(value, tuple(interp.guards.items()))


def calls(fn, method: str) -> bool | None:
    """Whether fn's code calls <its first parameter>.<method>(...) anywhere; None where its source cannot be read."""
    node = _source(fn)
    if node is None or not (params := node.args.posonlyargs + node.args.args):
        return None
    return re.search(rf"(?<![\w.]){params[0].arg}\.{method}\(", ast.unparse(node)) is not None


def numbers_in(fn) -> list[float]:
    """The positive finite numbers written in fn's code (a literal clamp limit is a limit-like number too)."""
    node = _source(fn)
    if node is None:
        return []
    values = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)]
    found = {float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return sorted(v for v in found if 0 < v <= 1e4)


# ---------------------------------------------------------------- gatings: what the gated forms share
CLAMPS_AFTER = (
    "gatings that clamp the activation's output, clamp(act(gate), max=limit) * clamp(up, -limit, limit) "
    "(Step-3.7, Bailing-Hybrid with a limit): ffn_ext's clamped SwiGLU clamps the gate before the activation, "
    "and no ffn_ext op clamps after it"
)
UP_FIRST = (
    "packed gatings whose projection gives the up half first, h[..., :I] * act(h[..., I:]) (Moonshine's decoder "
    "MLPs): ffn_ext's packed ops take the gate half first"
)


@dataclass(frozen=True)
class Gated:
    """A gating one ffn_ext op computes (spec: its attributes, layout still the default), and its operands: the
    caller checks that they are the halves of one projection or two projections of the input."""

    spec: GateSpec
    gate: Value
    up: Value


def _act_of(v: Value) -> tuple[str | None, Value] | None:
    """(the activation's attribute, its argument) for self.act(arg); (None, arg) for F.silu(arg), SiLU written out;
    else None."""
    if isinstance(v, Call) and len(v.args) == 1:
        return v.attr, v.args[0]
    if isinstance(v, Fn) and v.name == "silu":
        return None, v.of
    return None


def _clamped_max(v: Value) -> str | None:
    """The limit's attribute L for clamp(t, max=self.L) (no lower bound), else None."""
    return v.hi.name if isinstance(v, Clamp) and v.lo == NONE and isinstance(v.hi, Attr) else None


def _clamped_to(v: Value, lim: str) -> bool:
    """Whether v is clamp(t, -self.lim, self.lim)."""
    return isinstance(v, Clamp) and v.lo == Fn("neg", Attr(lim)) and v.hi == Attr(lim)


def gating(v: Value) -> Gated | Named | None:
    """The gating a value computes when one ffn_ext op computes it, Named for a shape no ffn_ext op computes, else
    None."""
    if not isinstance(v, Mul):
        return None
    factors = v.factors
    if len(factors) == 2:
        for a, b in (factors, factors[::-1]):
            act = _act_of(a)
            if act is not None and not isinstance(act[1], Clamp):  # act(gate) * up
                return Gated(GateSpec(act=act[0]), act[1], b)
            lim = _clamped_max(a)
            if lim and isinstance(a, Clamp) and _act_of(a.of) and _clamped_to(b, lim):
                return Named(CLAMPS_AFTER)  # clamp(act(gate), max=L) * clamp(up, -L, L)
            lim = _clamped_max(act[1]) if act else None
            if act and lim and isinstance(act[1], Clamp) and isinstance(b, Clamp) and _clamped_to(b, lim):
                return Gated(GateSpec(act=act[0], limit=lim), act[1].of, b.of)  # DeepSeek-V4, GLM-5-Next
        return None
    # (clamp(up, -L, L) + c) * g * sigmoid(g * alpha), g = clamp(gate, max=L): GPT-OSS
    sig = [f for f in factors if isinstance(f, Fn) and f.name == "sigmoid"]
    off = [f for f in factors if isinstance(f, Add)]
    clamps = [f for f in factors if isinstance(f, Clamp)]
    if len(factors) != 3 or not (len(sig) == len(off) == len(clamps) == 1):
        return None
    g, inner, terms = clamps[0], sig[0].of, off[0].terms
    lim = _clamped_max(g)
    offsets = [n for n in map(_number, terms) if n is not None]
    ups = [t for t in terms if isinstance(t, Clamp)]
    if not (lim and isinstance(inner, Mul) and len(inner.factors) == 2 and g in inner.factors):
        return None
    other = inner.factors[1] if inner.factors[0] == g else inner.factors[0]
    alpha = other.name if isinstance(other, Attr) else _number(other)
    if len(offsets) == len(ups) == 1 and _clamped_to(ups[0], lim) and alpha is not None:
        return Gated(GateSpec(act=None, limit=lim, alpha=alpha, up_offset=float(offsets[0])), g.of, ups[0].of)
    return None


def halves(gate: Value, up: Value, of: Value | None = None) -> str | Named | None:
    """The layout when gate and up are the two halves of one value (`of`, when given), gate first: "concat" or
    "interleaved"; Named when up comes first; else None."""
    if not (isinstance(gate, Half) and isinstance(up, Half) and gate.of == up.of and (of is None or gate.of == of)):
        return None
    if gate.interleaved != up.interleaved:
        return None
    if (gate.index, up.index) == (0, 1):
        return "interleaved" if gate.interleaved else "concat"
    return Named(UP_FIRST)


def proj(v: Value, x: Value) -> str | None:
    """The attribute of a projection self.a(x), else None."""
    return v.attr if isinstance(v, Call) and v.args == (x,) else None
