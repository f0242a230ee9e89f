"""The machine code of ffn_ext's CUDA kernels, read without a GPU: the kernels a binary holds, their memory
accesses and resource usage, and the instructions on each kernel's vector path. tests/test_sass.py checks the
kernels with it and benchmarks/sass_budget.py reports the instruction budgets from it. Test machinery, not part of
the package: it reads whichever binary it is given (by default the loaded ffn_ext native library).

What it reads. ``cuobjdump`` (triton ships one, triton/backends/nvidia/bin, in the CUDA build of torch; else
$CUDA_HOME/bin or PATH) dumps the SASS (``--dump-sass``) and the resource usage (``--dump-resource-usage``) of a
binary; parse_sass and parse_resources turn them into {(sm, mangled name): ...}. Every CUDA kernel of ffn_ext is
an instantiation ``ffn_ext::cuda::rows_kernel<T, F, VEC>`` (csrc/rows.h, csrc/row_ops.h): T the storage type,
VEC = 16 bytes / sizeof(T), and F a functor of csrc/ffn_math.h: UnaryFwd<Act> or UnaryBwd<Act> over an
activation, GatedFwd<Gate> or GatedBwd<Gate> over a gate (Glu<Act>: act(gate) * up; or a gate of its own with
runtime parameters, SwigluClamped), or one of those inside Interleaved<F, kPairIn, kPairOut>: the packed ops'
layout "interleaved", whose inputs kPairIn, kPairIn + 1 (outputs kPairOut, kPairOut + 1; -1: none) are one
operand of pairs [g0, u0, g1, u1, ...]. kernel_of decodes a mangled name into a Kernel (a small Itanium-ABI
reader: nested names, template arguments, integer literals). KERNELS, derived from ffn_ext.table, says which
functors the op table makes and what each one computes, in the table's order: per activation its C++ functor is
the CamelCase of its name ("gelu_tanh" -> GeluTanh, csrc/ops_table.h), run by its unary ops as UnaryFwd /
UnaryBwd; per gated op (table.GATED) its gate is Glu<CamelCase(act)> when the op is act(gate) * up (Gated.aten
None: swiglu -> Glu<Silu>), else the CamelCase of the op's name (swiglu_clamped -> SwigluClamped), run as
GatedFwd / GatedBwd by the gated op and its packed op with layout "concat" (two operands at the halves of each
row: the same kernel); the packed ops with layout "interleaved" run Interleaved<GatedFwd<Gate>, 0, -1> and
Interleaved<GatedBwd<Gate>, 1, 0> (gate_up is the pair of inputs gate, up; the packed backward's output the pair
dgate, dup). A kernel's inputs and outputs per element are those of its gated or unary op (OpSpec.args,
OpSpec.n_outputs), a pair counting as its two.

The vector path. A memory-bound elementwise kernel is fast only while the SMs can issue its instructions faster
than memory moves its bytes. vector_path follows, in a rows_kernel's SASS, the path that almost every thread of a
large contiguous tensor takes: a block other than block 0 along the row (no head or tail elements), every
operand 16-byte aligned, all kUnroll vectors in range, one row (rows.h's kFull body). At a conditional forward
branch the path jumps if the code jumped over holds a scalar global load or store (LDG/STG of one element: the
head, an element-wise fallback, the general body) and the target can still lead to kUnroll 128-bit loads per
input and stores per output; otherwise it falls through (into the vector access the branch guards, or into
math). An interleaved pair operand is two 16-byte accesses per VEC elements (VEC whole pairs, split or merged
in registers), so it too makes kUnroll 128-bit accesses per member of the pair. The row loop's back edge is not
taken. budget counts the instructions on that path (NOPs excluded) and divides by the elements a thread handles
(kUnroll * VEC) and the bytes each element moves (one T per input and output, a pair operand's two included). It
also counts the floating-point instructions issued before the path's last load: 0 means every load of the thread
is in flight before its math starts, which is what keeps enough bytes in flight per multiprocessor. How well the
count matches Nsight Compute, and what it predicts, is in docs/performance.md.

The FP8 quantizing kernels (csrc/cuda/quant_kernels.cuh: quant_kernel, quant_row_kernel,
quant_tensor_kernel<T, F, Pair>) are read by quant_kernel_of and counted by quant_budget: the same walk, with a
chunk's 8-byte fp8 store as its vector store, the count taken over one iteration of the loop around the vector
accesses (the steady state: a lane of 16 elements for the group kernel, with the block its writer lanes issue, and
for the tensor kernel; a row of 8192 for the row kernel), not the work before it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ffn_ext.table import GATED, OPS, Gated, OpSpec

__all__ = [
    "K_UNROLL",
    "DTYPES",
    "DTYPE_SIZE",
    "Kernel",
    "KernelSpec",
    "KERNELS",
    "act_struct",
    "gate_struct",
    "expected_kernels",
    "kernel_of",
    "cuobjdump",
    "native_library",
    "dump",
    "parse_sass",
    "parse_resources",
    "vector_path",
    "budget",
    "QuantKernel",
    "quant_kernel_of",
    "quant_budget",
]

K_UNROLL = 4  # csrc/rows.h kUnroll: 16-byte vectors per operand and thread in the body
# the storage type as the Itanium ABI mangles it -> (torch dtype name, bytes)
DTYPES = {"d": ("float64", 8), "f": ("float32", 4), "N3c104HalfE": ("float16", 2), "N3c108BFloat16E": ("bfloat16", 2)}
DTYPE_SIZE = dict(DTYPES.values())

VECTOR_MEM = re.compile(r"\b(?:LDG|STG)(?:\.[A-Z0-9_]+)*\.128\b")  # 16 bytes: LDG.E.128, STG.E.128...
SCALAR_MEM = re.compile(r"\b(?:LDG|STG)(?:\.(?!128\b)[A-Z0-9_]+)*\s")  # one element: LDG.E.U16, STG.E.64...
LOAD_128 = re.compile(r"\bLDG(?:\.[A-Z0-9_]+)*\.128\b")
STORE_128 = re.compile(r"\bSTG(?:\.[A-Z0-9_]+)*\.128\b")
LOCAL_MEM = re.compile(r"\b(?:LDL|STL)\b")  # spills (with a stack frame)
PREDICATE = re.compile(r"^@!?U?P\w+\s+")
BRANCH = re.compile(r"BRA(?:\.[A-Z0-9_]+)*\s+(?:(!?U?P[T0-9]+),\s*)?(0x[0-9a-f]+)")  # BRA [!P0,] 0x1b60
FP_MATH = re.compile(r"(?:FFMA|FMUL|FADD|MUFU|DFMA|DMUL|DADD|HFMA2(?!\.MMA)|HMUL2|HADD2)\b")  # HFMA2.MMA: a move


# ---------------------------------------------------------------- the kernels the op table makes
@dataclass(frozen=True)
class Kernel:
    """One rows_kernel instantiation, decoded from its mangled name."""

    shape: str  # UnaryFwd | UnaryBwd | GatedFwd | GatedBwd (whatever the name says: kernel_of does not check)
    act: str | None  # the shape's template argument: an activation ("GeluTanh") for Unary*, a gate for Gated*
    #                  ("Glu<Silu>", "SwigluClamped"); None for a plain functor without one
    dtype: str  # float64 | float32 | float16 | bfloat16
    vec: int  # elements per 16-byte vector
    pair_in: int = -1  # math::Interleaved<Shape<...>, pair_in, pair_out>: inputs pair_in, pair_in + 1 (outputs
    pair_out: int = -1  # pair_out, pair_out + 1) interleaved in one operand; -1 and -1: not Interleaved

    @property
    def interleaved(self) -> bool:
        return self.pair_in >= 0 or self.pair_out >= 0

    @property
    def functor(self) -> str:
        f = self.shape if self.act is None else f"{self.shape}<{self.act}>"
        return f"Interleaved<{f}, {self.pair_in}, {self.pair_out}>" if self.interleaved else f

    def __str__(self) -> str:
        return f"rows_kernel<{self.dtype}, {self.functor}, VEC={self.vec}>"


@dataclass(frozen=True)
class KernelSpec:
    """What the op table says a kernel computes."""

    op: str  # the op it runs (a concat packed op runs its gated op's kernel too: `also`)
    ni: int  # inputs per element (the functor's NI: an interleaved pair counts as its two inputs)
    no: int  # outputs per element (NO, likewise)
    also: tuple = ()  # other ops that launch this kernel


def act_struct(name: str) -> str:
    """The C++ functor of a table activation: CamelCase of its name ("gelu_tanh" -> "GeluTanh"), the rule
    csrc/ops_table.h follows (tests/test_sass.py fails if the binary's kernels and this rule disagree)."""
    return "".join(part.capitalize() for part in name.split("_"))


def gate_struct(gated: Gated) -> str:
    """The C++ gate functor of a gated op of the table (csrc/ops_table.h FFN_EXT_GATED): Glu<Act> for act(gate) * up
    over an activation (Gated.aten None: "swiglu" -> "Glu<Silu>"), else the CamelCase of the op's own name
    ("swiglu_clamped" -> "SwigluClamped"). tests/test_sass.py checks the rule against the binary."""
    return f"Glu<{act_struct(gated.act.name)}>" if gated.aten is None else act_struct(gated.name)


def _pairs(packed: OpSpec, gated: OpSpec) -> tuple[int, int]:
    """(kPairIn, kPairOut) of a packed op's interleaved kernel: its operand gate_up is the gated op's inputs gate,
    up (at the index of gate); its output, if it stands for the gated op's two (dgate, dup), is the pair 0."""
    pair_in = gated.args.index("gate")
    assert gated.args[pair_in + 1] == "up" and packed.args[pair_in] == "gate_up", (packed, gated)
    return pair_in, 0 if gated.n_outputs == packed.n_outputs + 1 else -1


_SHAPES = {
    ("unary", False): "UnaryFwd",
    ("unary", True): "UnaryBwd",
    ("gated", False): "GatedFwd",
    ("gated", True): "GatedBwd",
}


def _kernels() -> dict[str, KernelSpec]:
    specs: dict[str, KernelSpec] = {}
    also: dict[str, tuple] = {}
    for spec in OPS.values():
        if spec.kind == "unary":
            shape = "UnaryBwdRecompute" if spec.recompute else _SHAPES[("unary", spec.backward)]
            specs[Kernel(shape, act_struct(spec.act.name), "", 0).functor] = KernelSpec(
                spec.name, len(spec.args), spec.n_outputs
            )
            continue
        if spec.recompute:
            k = Kernel("GatedBwdRecompute", gate_struct(spec.gated), "", 0)
            specs[k.functor] = KernelSpec(spec.name, len(spec.args), spec.n_outputs)
            continue
        gated = OPS[spec.gated.name + ("_backward" if spec.backward else "")]  # the (unpacked) gated op
        plain = Kernel(_SHAPES[("gated", spec.backward)], gate_struct(spec.gated), "", 0)
        if spec.kind == "gated":
            specs[plain.functor] = KernelSpec(spec.name, len(spec.args), spec.n_outputs)
        else:  # packed: layout "concat" runs the gated kernel, "interleaved" its Interleaved form
            also[plain.functor] = also.get(plain.functor, ()) + (spec.name,)
            pair_in, pair_out = _pairs(spec, gated)
            k = Kernel(plain.shape, plain.act, "", 0, pair_in, pair_out)
            specs[k.functor] = KernelSpec(spec.name, len(gated.args), gated.n_outputs)
    return {f: KernelSpec(s.op, s.ni, s.no, also.get(f, ())) for f, s in specs.items()}


# {functor: KernelSpec}, in the op table's order: every rows_kernel functor the op table makes, e.g.
# "UnaryFwd<Silu>", "GatedBwd<Glu<GeluTanh>>", "Interleaved<GatedFwd<SwigluClamped>, 0, -1>"
KERNELS: dict[str, KernelSpec] = _kernels()


def expected_kernels() -> set[tuple[str, str]]:
    """{(functor, dtype)}: the rows_kernel instantiations the table predicts for one architecture."""
    return {(functor, dt) for functor in KERNELS for dt in DTYPE_SIZE}


_KERNEL_HEAD = re.compile(r"_ZN7ffn_ext4cuda11rows_kernelI(N3c108BFloat16E|N3c104HalfE|f|d)(?=NS_4math)")


class _Mangled:
    """Just enough of the Itanium C++ ABI to read a rows_kernel's functor: nested names (N...E) whose prefix is a
    namespace, possibly a substitution (S_, S2_, ...), source names (<length><id>), template arguments (I...E)
    of types (nested names, f, d) and integer literals (Li<n>E, Lin<n>E for -n). A type is (name, [args]); an
    integer is an int; anything else raises ValueError."""

    def __init__(self, s: str, i: int):
        self.s, self.i = s, i

    def eat(self, token: str) -> bool:
        if self.s.startswith(token, self.i):
            self.i += len(token)
            return True
        return False

    def source_name(self) -> str:
        m = re.compile(r"\d+").match(self.s, self.i)
        if m is None or len(self.s) < m.end() + int(m.group()):
            raise ValueError(f"no source name at {self.i}")
        self.i = m.end() + int(m.group())
        return self.s[m.end() : self.i]

    def template_args(self) -> list:
        args: list = []
        while not self.eat("E"):
            if self.eat("L"):  # a literal: Li<value>E, the value n<digits> if negative
                m = re.compile(r"i(n?)(\d+)E").match(self.s, self.i)
                if m is None:
                    raise ValueError(f"unknown literal at {self.i}")
                self.i = m.end()
                args.append(-int(m.group(2)) if m.group(1) else int(m.group(2)))
            else:
                args.append(self.type())
        return args

    def type(self) -> tuple[str, list]:
        if self.i >= len(self.s):
            raise ValueError("truncated")
        if self.s[self.i] in "fd":
            self.i += 1
            return ("float" if self.s[self.i - 1] == "f" else "double", [])
        if not self.eat("N"):
            raise ValueError(f"unknown type at {self.i}")
        m = re.compile(r"S[0-9A-Z]*_").match(self.s, self.i)  # the namespace prefix, substituted
        if m:
            self.i = m.end()
        name: str | None = None
        args: list = []
        while not self.eat("E"):
            if args:
                raise ValueError(f"a name after template arguments at {self.i}")
            if self.eat("I"):
                if name is None:
                    raise ValueError(f"template arguments without a name at {self.i}")
                args = self.template_args()
            else:
                name = self.source_name()
        if name is None:
            raise ValueError(f"empty nested name at {self.i}")
        return name, args


def _spell(t) -> str:
    """A decoded type as C++ spells it, without namespaces: Glu<Silu>."""
    if isinstance(t, int):
        return str(t)
    name, args = t
    return f"{name}<{', '.join(map(_spell, args))}>" if args else name


def kernel_of(mangled: str) -> Kernel | None:
    """Decodes ``_ZN7ffn_ext4cuda11rows_kernelI<T>NS_4math<functor>Li<VEC>EEEv...``, the functor a type of
    ffn_ext::math: a shape over its argument (math::UnaryFwd<math::GeluTanh>, math::GatedFwd<math::Glu<math::Silu>>,
    math::GatedBwd<math::SwigluClamped>), that inside math::Interleaved<shape, kPairIn, kPairOut>, or a plain functor
    (math::SwigluBwd, the names before the op table); None for anything else."""
    m = _KERNEL_HEAD.match(mangled)
    if not m:
        return None
    p = _Mangled(mangled, m.end())
    try:
        functor = p.type()
        rest = re.compile(r"Li(\d+)EEE").match(mangled, p.i)  # VEC, then closes rows_kernel's arguments and name
    except ValueError:
        return None
    if rest is None:
        return None
    pairs = (-1, -1)
    name, args = functor
    if name == "Interleaved":
        if len(args) != 3 or not isinstance(args[0], tuple) or not all(isinstance(a, int) for a in args[1:]):
            return None
        (name, args), pairs = args[0], tuple(args[1:])
    if len(args) > 1 or any(isinstance(a, int) for a in args):
        return None
    return Kernel(name, _spell(args[0]) if args else None, DTYPES[m.group(1)][0], int(rest.group(1)), *pairs)


# ---------------------------------------------------------------- reading a binary
def cuobjdump() -> str | None:
    """triton's copy (the CUDA build of torch installs it), else $CUDA_HOME/bin, else PATH."""
    spec = importlib.util.find_spec("triton")
    candidates = (
        [Path(loc) / "backends" / "nvidia" / "bin" / "cuobjdump" for loc in (spec.submodule_search_locations or [])]
        if spec
        else []
    )
    if os.environ.get("CUDA_HOME"):
        candidates.append(Path(os.environ["CUDA_HOME"]) / "bin" / "cuobjdump")
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return shutil.which("cuobjdump")


def native_library() -> tuple[str | None, str]:
    """(path of the loaded ffn_ext CUDA library, "") or (None, why there is no CUDA code to read)."""
    import ffn_ext
    from ffn_ext import _loader

    info = ffn_ext.build_info()
    if ffn_ext.ops._native is None:
        return None, f"no native ffn_ext library is loaded ({info.get('reason')})"
    if not ffn_ext.has_cuda_kernels():
        return None, f"the loaded ffn_ext has no CUDA kernels ({info.get('cuda_kernels_off', 'not built')})"
    return str(_loader.cuda_library_path()), ""


_FLAGS = {
    "sass": "--dump-sass",
    "res": "--dump-resource-usage",
    "elf": "--list-elf",
    "ptx": "--list-ptx",
    "text": "--list-text",
}


def dump(lib: str, kind: str = "sass", arch: int | None = None, tool: str | None = None) -> str:
    """cuobjdump's output for `lib`: kind sass | res | elf | ptx | text, of one architecture (`arch`, e.g. 90) or
    all. A binary without PTX gives "" for ptx; any other failure raises RuntimeError."""
    tool = tool or cuobjdump()
    if tool is None:
        raise RuntimeError("cuobjdump not found (pip install triton, or set CUDA_HOME to a toolkit that has it)")
    cmd = [tool, _FLAGS[kind], *(["-arch", f"sm_{arch}"] if arch is not None else []), lib]
    # no time limit: cuobjdump only reads a local file, and a loaded machine must not turn slowness into a failure
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if kind == "ptx" and r.returncode != 0 and "No PTX" in r.stderr + r.stdout:
        return ""
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return r.stdout


_ARCH_HEADER = re.compile(r"\s*(?:arch = |code for )sm_(\d+)")  # a library's fatbin, or a bare cubin


def parse_sass(text: str) -> dict[tuple[int, str], list[tuple[int, str]]]:
    """{(sm, mangled function name): [(address, instruction)]} from `cuobjdump --dump-sass` output (the
    instruction without its trailing ';' and encoding comment, predicate included)."""
    out: dict[tuple[int, str], list[tuple[int, str]]] = {}
    arch, cur = None, None
    for line in text.splitlines():
        m = _ARCH_HEADER.match(line)
        if m:
            arch, cur = int(m.group(1)), None
            continue
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if arch is None:
                raise ValueError("SASS function before any 'arch = sm_XX' / 'code for sm_XX' header")
            cur = out.setdefault((arch, m.group(1)), [])
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+([^;]*);", line)
        if cur is not None and m:
            cur.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def parse_resources(text: str) -> dict[tuple[int | None, str], dict[str, int]]:
    """{(sm, function): {'REG': .., 'STACK': .., 'LOCAL': .., ...}} from `cuobjdump --dump-resource-usage` (sm None
    for a function before any 'arch = sm_XX' header)."""
    out: dict[tuple[int | None, str], dict[str, int]] = {}
    arch, fn = None, None
    for line in text.splitlines():
        m = re.match(r"\s*arch = sm_(\d+)", line)
        if m:
            arch = int(m.group(1))
            continue
        m = re.match(r"\s*Function (\S+):\s*$", line)
        if m:
            fn = m.group(1)
            continue
        if fn is not None and "REG:" in line:
            out[(arch, fn)] = {k: int(v) for k, v in re.findall(r"([A-Z]+):(\d+)", line)}
            fn = None
    return out


# ---------------------------------------------------------------- the vector path
def _step(
    op: str, predicated: bool, addr: int, index: dict, vector: re.Pattern = VECTOR_MEM, exits: bool = False
) -> tuple[tuple[int, int], list[int], bool]:
    """One instruction: its (vector loads, vector stores) (`vector`: 128-bit by default), the indices the path can
    go on to (none: the path ends there; len(index): it may end there, a predicated EXIT when `exits`), and whether
    it is a conditional forward branch (two ways on)."""
    vec = vector.match(op) is not None
    add = (int(vec and op.startswith("LDG")), int(vec and op.startswith("STG")))
    nxt = index[addr] + 1
    if op.startswith("EXIT") and not predicated:
        return add, [], False
    if op.startswith("EXIT") and exits:
        return add, [len(index), nxt], True
    m = BRANCH.match(op)
    if m is None:
        return add, [nxt], False
    target = int(m.group(2), 16)
    conditional = predicated or m.group(1) not in (None, "PT")
    if target <= addr:  # the row loop's back edge: one row only
        return add, [nxt] if conditional else [], False
    return add, [index[target], nxt] if conditional else [index[target]], conditional


def vector_path(
    ins: list[tuple[int, str]],
    want_loads: int,
    want_stores: int,
    path: list | None = None,
    vector: re.Pattern = VECTOR_MEM,
    scalar: re.Pattern = SCALAR_MEM,
    exits: bool = False,
    avoid: re.Pattern | None = None,
) -> tuple[int, int, int]:
    """(instructions, 128-bit loads, 128-bit stores) on the path described at the top of this file, for a kernel
    whose vector path makes want_loads 128-bit loads and want_stores 128-bit stores. The path never passes an
    unpredicated scalar access (a predicated one is issued with its predicate off, and counted). If `path` is a
    list, the indices of the path's instructions are appended to it. `vector` and `scalar` say which global
    accesses are the vector path's and which are element-wise (the FP8 kernels: 8-byte stores are vector ones).
    With `exits`, a predicated EXIT may end the path (where the rest cannot go on: a scalar store of one thread).
    `avoid` (default `scalar`) is what a conditional branch jumps past (the FP8 kernels: calls too, the slow paths
    of a 64-bit or IEEE division)."""
    avoid = avoid or scalar
    index = {a: i for i, (a, _) in enumerate(ins)}
    ops = [(PREDICATE.sub("", t), PREDICATE.match(t) is not None) for _, t in ins]
    want = (want_loads, want_stores)
    # can[i]: the (loads, stores) that some path from instruction i to its end makes (at most `want`)
    can: list[set] = [set() for _ in range(len(ins) + 1)]
    if exits:
        can[len(ins)] = {(0, 0)}  # the end of the path at a predicated EXIT
    for i in range(len(ins) - 1, -1, -1):
        op, predicated = ops[i]
        if op.startswith("NOP"):
            can[i] = can[i + 1]
        elif not (scalar.search(op) and not predicated):
            add, nexts, _ = _step(op, predicated, ins[i][0], index, vector, exits)
            after = set.union(*(can[j] for j in nexts)) if nexts else {(0, 0)}
            can[i] = {(a + add[0], b + add[1]) for a, b in after if a + add[0] <= want[0] and b + add[1] <= want[1]}
    if want not in can[0]:
        raise RuntimeError(
            f"no path through the kernel makes {want_loads} 128-bit loads and {want_stores} stores "
            "without a scalar access"
        )
    i, count, done = 0, 0, (0, 0)
    while True:
        op, predicated = ops[i]
        if op.startswith("NOP"):
            i += 1
            continue
        add, nexts, two_ways = _step(op, predicated, ins[i][0], index, vector, exits)
        if path is not None:
            path.append(i)
        count, done = count + 1, (done[0] + add[0], done[1] + add[1])
        rest = (want[0] - done[0], want[1] - done[1])
        if not nexts:
            return count, done[0], done[1]
        options = [j for j in nexts if rest in can[j]]  # never empty: rest was in can[i]
        if two_ways and len(options) == 2:  # jump past scalar accesses, else fall through
            i = options[0] if any(avoid.search(t) for t, _ in ops[i + 1 : options[0]]) else options[1]
        else:
            i = options[0]
        if i == len(ins):  # a predicated EXIT ended it
            return count, done[0], done[1]


def _order(kernel: Kernel) -> tuple:
    """The table's order (KERNELS: unary ops per activation, then gated ops, each forward, backward, packed
    forward and packed backward), then dtype."""
    functors = list(KERNELS)
    return (
        functors.index(kernel.functor) if kernel.functor in functors else len(functors),
        kernel.functor,
        list(DTYPE_SIZE).index(kernel.dtype),
    )


def budget(sass: str | dict, arch: int) -> list[dict]:
    """One row per rows_kernel of `arch` (SASS text, or parse_sass's result): op (and layout: "interleaved" for
    a packed op's Interleaved kernel, else ""), kernel, dtype, instructions per
    element and per byte, the 128-bit loads/stores on the path (and how many there should be), the
    floating-point instructions the path issues before its last load (0: every load is in flight before the math
    starts), and the element-wise global accesses on it (predicated off) and its predicated 128-bit accesses: both
    0 on rows.h's kFull body, which has no range checks and no fallbacks. A kernel the op table does not predict
    raises KeyError."""
    funcs = parse_sass(sass) if isinstance(sass, str) else sass
    rows: list[dict] = []
    for (sm, name), ins in funcs.items():
        k = kernel_of(name)
        if sm != arch or k is None:
            continue
        spec = KERNELS.get(k.functor)
        if spec is None:
            raise KeyError(f"sm_{sm} {k}: not a kernel of the op table (ffn_ext.table; known: {list(KERNELS)})")
        size = DTYPE_SIZE[k.dtype]
        path: list[int] = []
        per_thread, loads, stores = vector_path(ins, K_UNROLL * spec.ni, K_UNROLL * spec.no, path)
        ops = [PREDICATE.sub("", ins[i][1]) for i in path]
        last_load = max(n for n, op in enumerate(ops) if VECTOR_MEM.match(op) and op.startswith("LDG"))
        math_first = sum(FP_MATH.match(op) is not None for op in ops[:last_load])
        scalar = sum(SCALAR_MEM.search(op) is not None for op in ops)  # predicated ones, issued with the predicate off
        guarded = sum(VECTOR_MEM.search(ins[i][1]) is not None and PREDICATE.match(ins[i][1]) is not None for i in path)
        per_elem = per_thread / (K_UNROLL * k.vec)  # an element: one of each input and output (of a pair: both)
        per_byte = per_elem / ((spec.ni + spec.no) * size)
        rows.append(
            dict(
                op=spec.op,
                also=spec.also,
                layout="interleaved" if k.interleaved else "",
                kernel=k.functor,
                dtype=k.dtype,
                instr_per_thread=per_thread,
                instr_per_elem=per_elem,
                instr_per_byte=per_byte,
                loads=loads,
                stores=stores,
                want_loads=K_UNROLL * spec.ni,
                want_stores=K_UNROLL * spec.no,
                math_before_last_load=math_first,
                scalar_accesses=scalar,
                guarded_vector_accesses=guarded,
                _key=_order(k),
            )
        )
    rows.sort(key=lambda r: r.pop("_key"))
    return rows


# ---------------------------------------------------------------- the FP8 quantizing kernels
# csrc/cuda/quant_kernels.cuh: quant_kernel (scaling="group"), quant_row_kernel ("row") and quant_tensor_kernel
# ("tensor"), each <T, F, Pair> with F = Identity (the op quantize) or GatedH<Gate> (a gated op), Pair: one interleaved operand.
QUANT_KINDS = {"quant_kernel": "group", "quant_row_kernel": "row", "quant_tensor_kernel": "tensor"}
QUANT_LANE = 8  # csrc/quant_kernel.h kLaneElems: elements per lane (chunk)
QUANT_ROW_CHUNKS = 4  # kRowChunks: chunks per thread a row kernel holds in registers (rows up to 8192 elements)
QUANT_GROUP_CHUNKS = 2  # kGroupChunks: chunks per lane of the group kernel
QUANT_TENSOR_CHUNKS = 2  # kTensorChunks: chunks per lane of the tensor kernel
_QUANT_HEAD = re.compile(
    r"_ZN7ffn_ext5quant\w*?\d+(quant_(?:row_|tensor_)?kernel)I(N3c108BFloat16E|N3c104HalfE|f|d)(?=N)"
)
# the quantizing kernels' vector accesses: 16-byte loads, the 8-byte store of a lane's 8 fp8 values
QUANT_VECTOR = re.compile(r"\b(?:LDG(?:\.[A-Z0-9_]+)*\.128|STG(?:\.[A-Z0-9_]+)*\.64)\b")
QUANT_SCALAR = re.compile(r"\b(?:LDG(?:\.(?!128\b)[A-Z0-9_]+)*|STG(?:\.(?!64\b)[A-Z0-9_]+)*)\s")
QUANT_AVOID = re.compile(QUANT_SCALAR.pattern + r"|\bCALL\b")  # and the slow paths: 64-bit / IEEE division calls
F2FP_FP8 = re.compile(r"\bF2FP\.SATFINITE\.(E4M3|E5M2)\.F32\b")  # cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32


@dataclass(frozen=True)
class QuantKernel:
    """One quantizing kernel, decoded from its mangled name."""

    kind: str  # group | row | tensor
    op: str  # "quantize" or the gated op ("swiglu", "geglu", ...)
    functor: str  # Identity | GatedH<Glu<Silu>> | GatedH<SwigluClamped> ...
    dtype: str  # float32 | float16 | bfloat16
    pair: bool  # the interleaved layout: gate and up in one operand

    def __str__(self) -> str:
        return f"quant {self.kind} <{self.dtype}, {self.functor}{', pair' if self.pair else ''}>"


def quant_kernel_of(mangled: str) -> QuantKernel | None:
    """Decodes ``_ZN7ffn_ext5quant<anonymous namespace><kind>I<T>NS0_<functor>Lb<pair>EEEv...``; None for any
    other name."""
    m = _QUANT_HEAD.match(mangled)
    if not m:
        return None
    p = _Mangled(mangled, m.end())
    try:
        functor = p.type()
    except ValueError:
        return None
    rest = re.compile(r"Lb([01])E").match(mangled, p.i)
    if rest is None:
        return None
    text = _spell(functor)
    if text == "Identity":
        op = "quantize"
    else:
        gates = {f"GatedH<{gate_struct(g)}>": g.name for g in GATED}
        if text not in gates:
            return None
        op = gates[text]
    return QuantKernel(QUANT_KINDS[m.group(1)], op, text, DTYPES[m.group(2)][0], rest.group(1) == "1")


SCALE_STORE = re.compile(r"\bSTG\.E\s")  # a float32 scale (4 bytes); q's is STG.E.64
E8M0_STORE = re.compile(r"\bSTG\.E\.U8\s")  # an e8m0 scale (1 byte)


def _writer_block(ins: list[tuple[int, str]], index: dict, path: list[int], start: int, end: int) -> int:
    """The instructions a warp of the group kernel issues for its writer lanes (which store the group's float32
    scale) on top of `path` (vector_path skips the block: its stores are scalar): from the forward branch on
    path[start:end + 1] that jumps past the scale store to its target, the float32 route (past the e8m0 store).
    `index`: instruction address -> position in `ins`."""
    for n in range(start, end + 1):
        m = BRANCH.match(PREDICATE.sub("", ins[path[n]][1]))
        if not (m and PREDICATE.match(ins[path[n]][1]) and int(m.group(2), 16) > ins[path[n]][0]):
            continue
        lo, hi = path[n] + 1, index[int(m.group(2), 16)]
        if path[n + 1] != hi or not any(SCALE_STORE.search(t) for _, t in ins[lo:hi]):
            continue
        block: list[int] = []
        vector_path(ins[lo : hi + 1], 0, 0, block, QUANT_VECTOR, E8M0_STORE, True, E8M0_STORE)
        return len(block) - 1  # not the target, which is on the path
    raise RuntimeError("no writer block (a branch past the float32 scale store) in the group kernel's loop")


def quant_budget(sass: str | dict, arch: int) -> list[dict]:
    """Instructions per element of each quantizing kernel of `arch` in its steady state, on the path a lane of a
    large contiguous bf16/fp16/fp32 tensor takes (vector_path's rule, the 8-byte fp8 store counting as a vector
    store: 16-byte loads, whole lanes, not the lane that writes the scale (the group kernel adds the block a warp
    issues for it), e4m3 or e5m2 alike; past the calls of
    the slow paths: a 64-bit index division whose operands fit 32 bits, a division without FCHK's special cases):
      group  one iteration of the grid-stride loop: a lane's 16 elements (kGroupChunks chunks of 8), its group's
             amax (the shuffle steps unrolled: all three taken, as at group size 128), the scale, the two stores and
             the writer lanes' block (every warp holds writers, so every warp issues it: the float32 scale's route);
      row    one iteration of the row loop, a row of 8192 elements (kRowChunks chunks per thread of 256: 32
             elements), the block's amax (warp shuffles, the warps' fold) and the scale included;
      tensor one iteration of the lane loop of each launch (a lane of 16 elements, kTensorChunks chunks):
             "tensor" (the quantize launch, the only one with a static scale) and "tensor amax" (a dynamic
             scale's first launch: h and its amax, no store).
    The count runs from the loop's head to its back edge; the work before the loop (the grid's index arithmetic,
    the tensor kernels' scale) is left out as it is paid once per thread, not per element. Bytes per element: the
    inputs' (one T per operand element) plus the fp8 byte; the amax launch reads the inputs only. The same count as
    budget's, for these kernels."""
    funcs = parse_sass(sass) if isinstance(sass, str) else sass
    rows: list[dict] = []
    for (sm, name), ins in funcs.items():
        k = quant_kernel_of(name)
        if sm != arch or k is None:
            continue
        size = DTYPE_SIZE[k.dtype]
        ni = 1 if k.op == "quantize" else 2
        loads = ni * QUANT_LANE * size // 16  # 16-byte loads per lane (an interleaved pair: the same bytes)
        chunks = {"row": QUANT_ROW_CHUNKS, "group": QUANT_GROUP_CHUNKS, "tensor": QUANT_TENSOR_CHUNKS}[k.kind]
        phases = [("tensor", 1), ("tensor amax", 0)] if k.kind == "tensor" else [(k.kind, 1)]
        f2fp = sorted({m.group(1) for _, t in ins if (m := F2FP_FP8.search(t))})
        index = {a: i for i, (a, _) in enumerate(ins)}
        for label, stores in phases:
            path: list[int] = []
            vector_path(ins, loads * chunks, stores * chunks, path, QUANT_VECTOR, QUANT_SCALAR, True, QUANT_AVOID)
            ops = [PREDICATE.sub("", ins[i][1]) for i in path]
            first = min(n for n, op in enumerate(ops) if QUANT_VECTOR.match(op))
            last = max(n for n, op in enumerate(ops) if QUANT_VECTOR.match(op))
            # the loop around every vector access: the outermost back edge on the path enclosing them
            loops = []
            for n, i in enumerate(path):
                b = BRANCH.match(ops[n])
                if b and int(b.group(2), 16) <= ins[i][0] and n >= last:
                    head = index[int(b.group(2), 16)]
                    start = next((q for q, j in enumerate(path) if j >= head), None)
                    if start is not None and start <= first:
                        loops.append((start, n))
            if not loops:
                raise RuntimeError(f"sm_{sm} {k}: no loop around the vector accesses")
            start, end = min(loops)
            per_iter = end - start + 1
            if k.kind == "group":  # every warp holds writer lanes (a group is at most 8 lanes): it issues their block
                per_iter += _writer_block(ins, index, path, start, end)
            elems = QUANT_LANE * chunks
            per_elem = per_iter / elems
            per_byte = per_elem / (ni * size + stores)
            rows.append(
                dict(
                    kind=label,
                    op=k.op,
                    layout="interleaved" if k.pair else "",
                    dtype=k.dtype,
                    instr_per_iter=per_iter,
                    elems_per_iter=elems,
                    instr_per_elem=per_elem,
                    instr_per_byte=per_byte,
                    f2fp=f2fp,
                )
            )
    order = ["quantize", *(g.name for g in GATED)]
    kinds = ["group", "row", "tensor", "tensor amax"]
    rows.sort(
        key=lambda r: (order.index(r["op"]), r["layout"], kinds.index(r["kind"]), list(DTYPE_SIZE).index(r["dtype"]))
    )
    return rows
