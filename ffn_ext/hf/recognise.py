"""Which form a module computes, read from its code: the class's forward (or an experts class's _apply_gate, a BERT
layer's feed_forward_chunk) is parsed with ast and run symbolically on the module instance, then the value it returns
is matched to a form ffn_ext computes. No class name is consulted, so a class a transformers release adds is
recognised, and one it changes is read again from its new code.

The interpreter takes straight-line code: assignments (tuple unpacking included), calls of the module's own
attributes, the tensor methods and torch functions a gating uses (chunk, clamp, sigmoid, the table's activations by
torch's name), + - * and unary minus, the two halves of a packed projection ([gate | up] by chunk, interleaved by
[..., ::2]), and `if` statements whose test reads only the module's attributes (`if self.limit is not None:`): the
test is decided on the instance, and the attributes it read are kept as guards that the patched code checks on
every call. Anything else (loops, other calls, other methods, dtype casts) makes the code unrecognised: the module
runs as it is."""

from __future__ import annotations

import ast
import inspect
import operator
import textwrap
from typing import Any, NamedTuple

from .common import _MISSING, _Gate


class _Unknown(Exception):
    """The code leaves the subset the interpreter reads."""


class Form(NamedTuple):
    """What a piece of module code computes. kind: "gated" (down(g(act(gate(x))), up(x)): names (gate, up, down)),
    "packed" (out(g(h)) with h = proj(x): names (proj, out)), "classic" (fc2(act(fc1(x))), then `drop`: names
    (fc1, fc2, drop)), "pair" (a BERT-style layer: output(intermediate(x), x)), "gate" (an experts _apply_gate on the
    [S, 2I] projection). gate: the gating g, a _Gate whose act is the activation's attribute; guards: (attribute,
    value) pairs the code's `if` tests read, which must still hold when the patched code runs."""

    kind: str
    names: tuple = ()
    gate: _Gate | None = None
    guards: tuple = ()


class Named(NamedTuple):
    """Code of a recognised shape that no ffn_ext op computes, with why."""

    reason: str


_CLAMPS_AFTER = (
    "gatings that clamp the activation's output, clamp(act(gate), max=limit) * clamp(up, -limit, limit) "
    "(Step-3.7, Bailing-Hybrid with a limit): ffn_ext's clamped SwiGLU clamps the gate before the activation, "
    "and no ffn_ext op clamps after it"
)
_UP_FIRST = (
    "packed gatings whose projection gives the up half first, h[..., :I] * act(h[..., I:]) (Moonshine's decoder "
    "MLPs): ffn_ext's packed ops take the gate half first"
)
_DROPOUT_BETWEEN = (
    "packed gated MLPs with a dropout between the gating and the projection back (ModernBERT): ffn_ext's fused MLP "
    "has no dropout there"
)

# torch functions by their dotted names as written in transformers' code: "F." and "nn.functional." are torch's
_ACT_FUNCTIONS = {"silu": "silu", "gelu": "gelu", "relu": "relu"}
_NAMESPACES = ("torch.nn.functional.", "nn.functional.", "F.", "torch.")


def _function_name(node: ast.expr) -> str | None:
    """'silu' for F.silu / nn.functional.silu / torch.nn.functional.silu / torch.silu; None if not such a name."""
    text = ast.unparse(node)
    for ns in _NAMESPACES:
        if text.startswith(ns) and "." not in text[len(ns) :]:
            return text[len(ns) :]
    return None


def _mul(*factors):
    """A product as the multiset of its factors (flattened, in a canonical order): a * b * c in any grouping."""
    flat = []
    for f in factors:
        flat.extend(f[1] if f[0] == "mul" else (f,))
    return ("mul", tuple(sorted(flat, key=repr)))


def _add(a, b):
    if a[0] == "const" and b[0] == "const":
        return ("const", a[1] + b[1])
    return ("add", tuple(sorted((a, b), key=repr)))


def _neg(a):
    return ("const", -a[1]) if a[0] == "const" else ("neg", a)


class _Interp:
    """Runs a function's body symbolically: values are tuples ("in", i) for the i-th parameter after self, ("self",
    attr) for an attribute of the module, ("call", attr, args) for a call of one, and the operations above."""

    def __init__(self, module, params):
        self.module, self.guards = module, {}
        self.env: dict[str, Any] = {p: ("in", i) for i, p in enumerate(params)}

    # -- statements
    def run(self, body):
        for st in body:
            if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant):
                continue  # a docstring
            if isinstance(st, ast.Pass):
                continue
            if isinstance(st, ast.Return):
                if st.value is None:
                    raise _Unknown
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
                raise _Unknown
        return None

    def assign(self, target, value):
        if isinstance(target, ast.Name):
            self.env[target.id] = value
        elif isinstance(target, ast.Tuple) and not any(isinstance(e, ast.Starred) for e in target.elts):
            items = self.items(value, len(target.elts))
            for t, v in zip(target.elts, items):
                self.assign(t, v)
        else:
            raise _Unknown

    def items(self, value, n):
        if value[0] == "tuple" and len(value[1]) == n:
            return value[1]
        if value[0] == "chunk" and n == 2:
            return (("half", value[1], 0), ("half", value[1], 1))
        raise _Unknown

    # -- `if` tests, decided on the instance
    def test(self, node) -> bool:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return not self.test(node.operand)
        if isinstance(node, ast.BoolOp):
            values = (self.test(v) for v in node.values)
            return all(values) if isinstance(node.op, ast.And) else any(values)
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            left, right = self.attr_value(node.left), self.constant(node.comparators[0])
            ops = {ast.Is: operator.is_, ast.IsNot: operator.is_not, ast.Eq: operator.eq, ast.NotEq: operator.ne}
            op = ops.get(type(node.ops[0]))
            if op is None:
                raise _Unknown
            return bool(op(left, right))
        return bool(self.attr_value(node))

    def attr_value(self, node):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"):
            raise _Unknown
        value = getattr(self.module, node.attr, _MISSING)
        if value is _MISSING or not isinstance(value, (bool, int, float, str, type(None))):
            raise _Unknown
        self.guards[node.attr] = value
        return value

    @staticmethod
    def constant(node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            return -node.operand.value
        raise _Unknown

    # -- expressions
    def expr(self, node):
        if isinstance(node, ast.Name):
            if node.id not in self.env:
                raise _Unknown
            return self.env[node.id]
        if isinstance(node, ast.Constant):
            if isinstance(node.value, (int, float)) and not isinstance(node.value, bool) or node.value is None:
                return ("const", node.value)
            raise _Unknown
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                return ("self", node.attr)
            raise _Unknown
        if isinstance(node, ast.Tuple):
            return ("tuple", tuple(self.expr(e) for e in node.elts))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return _neg(self.expr(node.operand))
        if isinstance(node, ast.BinOp):
            return self.binop(node.op, self.expr(node.left), self.expr(node.right))
        if isinstance(node, ast.Subscript):
            return self.subscript(self.expr(node.value), node.slice)
        if isinstance(node, ast.Call):
            return self.call(node)
        raise _Unknown

    @staticmethod
    def binop(op, a, b):
        if isinstance(op, ast.Mult):
            return _mul(a, b)
        if isinstance(op, ast.Add):
            return _add(a, b)
        if isinstance(op, ast.Sub):
            return _add(a, _neg(b))
        raise _Unknown

    def subscript(self, value, index):
        if isinstance(index, ast.Constant) and isinstance(index.value, int) and index.value in (0, 1):
            return self.items(value, 2)[index.value]
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
                    return ("ihalf", value, lower)
        raise _Unknown

    def call(self, node: ast.Call):
        func = node.func
        kw = {k.arg: k.value for k in node.keywords}
        if None in kw:
            raise _Unknown
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            if kw or any(isinstance(a, ast.Starred) for a in node.args):
                raise _Unknown
            return ("call", func.attr, tuple(self.expr(a) for a in node.args))
        name = _function_name(func)
        if name is not None and not (isinstance(func, ast.Attribute) and self.is_value(func.value)):
            args = [self.expr(a) for a in node.args]
            return self.function(name, args, kw)
        if isinstance(func, ast.Attribute):  # a tensor method
            args = [self.expr(func.value)] + [self.expr(a) for a in node.args]
            return self.function(func.attr, args, kw)
        raise _Unknown

    def is_value(self, node) -> bool:
        """Whether `node` is a local variable (x.silu() is a method call, F.silu(x) a function)."""
        return isinstance(node, ast.Name) and node.id in self.env

    def function(self, name, args, kw):
        def arg(i, key, default=("const", None)):  # the i-th positional argument or the keyword `key`
            return args[i] if len(args) > i else self.expr(kw.pop(key)) if key in kw else default

        if name == "chunk":  # t.chunk(2, dim=-1), torch.chunk(t, 2, -1)
            chunks, dim = arg(1, "chunks"), arg(2, "dim", ("const", 0))
            if chunks != ("const", 2) or dim != ("const", -1) or kw or len(args) > 3:
                raise _Unknown
            return ("chunk", args[0])
        if name == "clamp":
            lo, hi = arg(1, "min"), arg(2, "max")
            if kw or len(args) > 3:
                raise _Unknown
            return ("clamp", args[0], lo, hi)
        if name == "dropout" and len(args) == 1 and set(kw) == {"p", "training"}:
            p, training = self.expr(kw["p"]), self.expr(kw["training"])
            if p[0] != "self" or training != ("self", "training"):
                raise _Unknown
            return ("dropout", args[0], p[1])
        if name == "sigmoid" and len(args) == 1 and not kw:
            return ("sigmoid", args[0])
        if name in _ACT_FUNCTIONS and len(args) == 1:
            approximate = kw.pop("approximate", None)
            if kw:
                raise _Unknown
            entry = _ACT_FUNCTIONS[name]
            if approximate is not None:
                mode = self.constant(approximate)
                entry = {"none": "gelu", "tanh": "gelu_tanh"}.get(mode) if name == "gelu" else None
                if entry is None:
                    raise _Unknown
            return ("act", entry, args[0])
        raise _Unknown


def _source(fn) -> ast.FunctionDef | None:
    """The function's parsed definition (None where its source cannot be read: built in, made by exec)."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    if code not in _PARSED:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError, SyntaxError, IndentationError):
            tree = None
        node = tree.body[0] if tree is not None and tree.body else None
        _PARSED[code] = node if isinstance(node, ast.FunctionDef) else None
    return _PARSED[code]


_PARSED: dict = {}  # code object -> its FunctionDef (or None), parsed once per function


def evaluate(module, fn, n_inputs: int):
    """(the value fn(module, inputs...) returns, as the interpreter's tuple; the guards) or None when the code is
    not of the subset the interpreter reads, or does not take exactly `n_inputs` inputs after self."""
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
    except (_Unknown, KeyError, TypeError, AttributeError):
        return None
    if value is None:
        return None
    return value, tuple(interp.guards.items())


# ---------------------------------------------------------------- matching values to forms
def _act_of(v):
    """(the activation's attribute, its argument) for self.act(arg); (None, arg) for F.silu(arg), SiLU written out
    (a _Gate's act=None); else None."""
    if v[0] == "call" and len(v[2]) == 1:
        return v[1], v[2][0]
    if v[0] == "act" and v[1] == "silu":
        return None, v[2]
    return None


def _clamped_max(v):
    """The limit's attribute L for clamp(t, max=self.L) (no lower bound), else None."""
    return v[3][1] if v[0] == "clamp" and v[2] == ("const", None) and v[3][0] == "self" else None


def _clamped_to(v, lim) -> bool:
    """Whether v is clamp(t, -self.lim, self.lim)."""
    return v[0] == "clamp" and v[2] == ("neg", ("self", lim)) and v[3] == ("self", lim)


def gating(v):
    """(_Gate-like dict, gate operand, up operand) for a value that is one gating ffn_ext computes, or Named for
    one of the shapes it names, else None. The operands are returned for the caller to check (the halves of one
    projection, or two projections of x)."""
    if v[0] != "mul":
        return None
    factors = v[1]
    if len(factors) == 2:
        for a, b in (factors, factors[::-1]):
            act = _act_of(a)
            if act is not None and act[1][0] != "clamp":  # act(gate) * up
                return dict(act=act[0]), act[1], b
            lim = _clamped_max(a)
            if lim and _act_of(a[1]) and _clamped_to(b, lim):  # clamp(act(gate), max=L) * clamp(up, -L, L)
                return Named(_CLAMPS_AFTER), _act_of(a[1])[1], b[1]
            lim = act and _clamped_max(act[1])
            if lim and _clamped_to(b, lim):  # act(clamp(gate, max=L)) * clamp(up, -L, L): DeepSeek-V4, GLM-5-Next
                return dict(act=act[0], limit=lim), act[1][1], b[1]
    # (clamp(up, -L, L) + c) * g * sigmoid(g * alpha), g = clamp(gate, max=L): GPT-OSS
    if len(factors) == 3:
        sig = [f for f in factors if f[0] == "sigmoid"]
        off = [f for f in factors if f[0] == "add"]
        clamps = [f for f in factors if f[0] == "clamp"]
        if len(sig) == 1 and len(off) == 1 and len(clamps) == 1:
            g, inner, terms = clamps[0], sig[0][1], off[0][1]
            lim = _clamped_max(g)
            const = [t for t in terms if t[0] == "const"]
            ups = [t for t in terms if t[0] == "clamp"]
            if lim and inner[0] == "mul" and len(inner[1]) == 2 and g in inner[1] and len(const) == len(ups) == 1:
                alpha = next(f for f in inner[1] if f != g) if inner[1][0] != inner[1][1] else None
                alpha_ok = alpha is not None and (alpha[0] == "self" or (alpha[0] == "const" and alpha[1] is not None))
                if alpha_ok and _clamped_to(ups[0], lim):
                    return dict(act=None, limit=lim, alpha=alpha[1], up_offset=float(const[0][1])), g[1], ups[0][1]
    return None


def _halves(gate, up, of):
    """The layout when gate and up are the two halves of the value `of` ([gate | up] or interleaved), gate first;
    Named when up comes first; else None."""
    if gate[0] == up[0] and gate[0] in ("half", "ihalf") and gate[1] == up[1] == of:
        if (gate[2], up[2]) == (0, 1):
            return "concat" if gate[0] == "half" else "interleaved"
        return Named(_UP_FIRST)
    return None


def _gate(spec: dict, layout: str = "concat") -> _Gate:
    return _Gate(**spec, layout=layout)


def _proj(v, x):
    """The attribute of a projection self.a(x), else None."""
    return v[1] if v[0] == "call" and v[2] == (x,) else None


def mlp_form(module):
    """The Form (or Named) of the module's forward(x), else None: gated, packed or classic."""
    found = evaluate(module, type(module).forward, 1)
    if found is None:
        return None
    v, guards = found
    x = ("in", 0)
    drop = ""
    if v[0] == "dropout":  # F.dropout(y, p=self.p, training=self.training) after the projection back
        v, drop = v[1], f"p:{v[2]}"
    if not (v[0] == "call" and len(v[2]) == 1):
        return None
    out, inner = v[1], v[2][0]
    g = gating(inner)
    if g is not None:
        spec, gate, up = g
        if drop:  # a dropout after the gated MLP: ffn_ext's gated forwards have none
            return None
        if not isinstance(spec, Named) and spec.get("act", "") is None and "limit" not in spec:
            return None  # F.silu written out in a plain MLP: the patched forward reads its activation attribute
        if isinstance(spec, Named):
            return spec
        gp, upp = _proj(gate, x), _proj(up, x)
        if gp and upp and gp != upp:
            return Form("gated", (gp, upp, out), _gate(spec), guards)
        source = _packed_source(gate)
        layout = _halves(gate, up, source)
        if isinstance(layout, Named):
            return layout
        if layout is not None and _proj(source, x):
            return Form("packed", (_proj(source, x), out), _gate(spec, layout), guards)
        return None
    act = _act_of(inner)
    if act and act[0] and _proj(act[1], x):  # out(act(fc1(x)))
        return Form("classic", (_proj(act[1], x), out, drop), _Gate(act=act[0]), guards)
    if inner[0] == "call" and len(inner[2]) == 1:
        between = gating(inner[2][0])
        if between is not None and not isinstance(between[0], Named):
            if _halves(between[1], between[2], _packed_source(between[1])) == "concat":
                return Named(_DROPOUT_BETWEEN)  # out(drop(gating(proj(x))))
        act = _act_of(inner[2][0])
        if act and act[0] and _proj(act[1], x) and not drop:  # drop(fc2(act(fc1(x)))): `out` is the dropout
            return Form("classic", (_proj(act[1], x), inner[1], out), _Gate(act=act[0]), guards)
    return None


def _packed_source(v):
    return v[1] if v[0] in ("half", "ihalf") else None


def gate_form(module):
    """The Form (kind "gate") or Named of an experts class's _apply_gate(gate_up), else None."""
    fn = getattr(type(module), "_apply_gate", None)
    if not callable(fn):
        return None
    found = evaluate(module, fn, 1)
    if found is None:
        return None
    v, guards = found
    g = gating(v)
    if g is None:
        return None
    spec, gate, up = g
    if isinstance(spec, Named):
        return spec
    layout = _halves(gate, up, ("in", 0))
    if layout is None or isinstance(layout, Named):
        return layout
    return Form("gate", (), _gate(spec, layout), guards)


def pair_form(layer):
    """Form "pair" for a BERT-style layer whose feed_forward_chunk(x) is output(intermediate(x), x), with
    intermediate.forward(x) = act(dense(x)) and output.forward(h, x) = LayerNorm(dropout(dense(h)) + x); the
    activation attribute is the intermediate's. Else None."""
    fn = getattr(type(layer), "feed_forward_chunk", None)
    inter, out = layer._modules.get("intermediate"), layer._modules.get("output")
    if not callable(fn) or inter is None or out is None:
        return None
    found = evaluate(layer, fn, 1)
    if found is None or found[0] != ("call", "output", (("call", "intermediate", (("in", 0),)), ("in", 0))):
        return None
    i = evaluate(inter, type(inter).forward, 1)
    act = _act_of(i[0]) if i is not None else None
    if act is None or _proj(act[1], ("in", 0)) != "dense":
        return None
    o = evaluate(out, type(out).forward, 2)
    want = ("call", "LayerNorm", (_add(("call", "dropout", (("call", "dense", (("in", 0),)),)), ("in", 1)),))
    if o is None or o[0] != want:
        return None
    return Form("pair", (), _Gate(act=act[0]), found[1] + i[1] + o[1])


def numbers_in(fn) -> list[float]:
    """The positive finite numbers written in fn's code (a literal clamp limit is a limit-like number too)."""
    node = _source(fn)
    if node is None:
        return []
    values = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)]
    found = {float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return sorted(v for v in found if 0 < v <= 1e4)
