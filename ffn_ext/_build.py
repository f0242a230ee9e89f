"""How ffn_ext is built: the shared source/flag list (csrc/build.json), where the sources are, the CUDA-or-not
decision, and the record a build leaves next to the library it made.

Used by setup.py (loaded by file path, before the package is installed) and by ffn_ext.jit. Whether to build the
CUDA kernels never looks at torch.cuda.is_available(): build machines often have a CUDA toolkit and no GPU; only
the default architectures do (choose_archs: the visible GPU's alone, as torch's own extensions build).

Sources: in a checkout they are the repository's csrc/; an installed package (wheel or sdist build) carries a copy
under ffn_ext/_src/ (csrc/** and CMakeLists.txt, laid there by setup.py's build_py), so ffn_ext.jit works from an
install as from a checkout. Both layouts hold csrc/build.json with paths relative to that root.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
CHECKOUT = PACKAGE.parent  # the repository root when this is a checkout (or an sdist's unpacked tree)
SHIPPED = PACKAGE / "_src"  # the copy inside an installed package
FORCE_CPU_ENV = "FFN_EXT_FORCE_CPU"
RECORD = "_C_build.json"  # written next to _C by setup.py: torch version, CUDA, sources hash
MIN_TORCH = (2, 10)  # the oldest torch ffn_ext supports: setup.py and `import ffn_ext` refuse older ones
MIN_SETUPTOOLS = 77  # pyproject.toml's SPDX `license` string; older setuptools reject the file


def too_old(torch_version: str) -> str | None:
    """The error for a torch older than MIN_TORCH ('2.9.1+cu128'), else None."""
    match = re.match(r"(\d+)\.(\d+)", torch_version)
    if match is None or tuple(map(int, match.groups())) >= MIN_TORCH:
        return None
    need = ".".join(map(str, MIN_TORCH))
    return f"ffn_ext needs torch>={need}, this is torch {torch_version}: pip install -U 'torch>={need}'"


OPS_TABLE = "csrc/include/ffn_ext/ops_table.h"  # generated from ffn_ext/table.py (write_ops_table), not in git

_OPS_TABLE_DOC = """\
// The one table of ffn_ext's ops, generated from ffn_ext/table.py by ffn_ext/_build.py (write_ops_table) when the
// library is built: edit table.py, not this file. The C++ op by op is generated from these two lists: the schemas
// (registration.cpp), the CUDA kernels (cuda/kernels_part*.cu, registered by row_ops.h's Kernels), and the public C++
// API (<ffn_ext/ops.h>, which installs this header next to it: its lines are only macro text there). The
// CPU and fake kernels and autograd are Python, registered from table.py (ffn_ext/_kernels.py). README "Adding an
// activation".
//
// FFN_EXT_ACTIVATIONS(X): X(name, Act), one line per activation:
//   ops  name(Tensor x) -> Tensor                       act(x)
//        name_backward(Tensor grad, Tensor x) -> Tensor grad * act'(x)
//        name_backward_recompute(Tensor grad, Tensor x) -> (Tensor, Tensor)  (grad * act'(x), act(x))
//   Act  its functor in ffn_math.h (f, df for the kernels, and bwd where act' is unbounded)
//
// FFN_EXT_SCHEMAS(X): X("schema", pointwise), every schema of the namespace (table.py's SCHEMAS: the ops below and the
// quantizing ops), registered by registration.cpp; pointwise 1: tagged torch.Tag.pointwise.
//
// FFN_EXT_GATED(X): X(name, Gate, P), one line per gated op, Gate its functor in ffn_math.h (Glu<Act>: act(gate) * up
// over an activation above; or a gate of its own), P its keyword parameters (FFN_EXT_P_* below):
//   ops  name(Tensor gate, Tensor up[, *, P]) -> Tensor                       gate(gate, up)
//        name_backward(Tensor grad, Tensor gate, Tensor up[, *, P]) -> (Tensor, Tensor)   (dgate, dup)
//        name_backward_recompute(Tensor grad, Tensor gate, Tensor up[, *, P]) -> (Tensor, Tensor, Tensor)
//                                                                  (dgate, dup, gate(gate, up))
//        name_packed(Tensor gate_up, *[, P], str layout="concat") -> Tensor       [..., 2M] -> [..., M]
//        name_packed_backward(Tensor grad, Tensor gate_up, *[, P], str layout="concat") -> Tensor  [..., 2M]
//   layout of gate_up (and of the packed backward's [dgate, dup]): "concat" [gate | up] (gate = gate_up[..., :M]),
//   or "interleaved" [g0, u0, g1, u1, ...] (gate = gate_up[..., ::2], GPT-OSS).
//
// Keyword parameters of a gated op, by the name in its line's P column (pasted: FFN_EXT_P_DECL_##P ...):
//   DECL    the same as C++ parameters of a kernel, each preceded by ", "
//   ARGS    those parameters' names, each preceded by ", " (to pass them on)
//   MAKE    the functor's Params (ffn_math.h) from them
//   DEFAULTS  DECL with the schema's defaults (<ffn_ext/ops.h>'s declarations)
#pragma once
"""


def _load_table(root: Path):
    """ffn_ext/table.py under root, loaded by path: setup.py runs before the package is importable."""
    import importlib.util
    import sys

    name = "_ffn_ext_build_table"
    spec = importlib.util.spec_from_file_location(name, root / "ffn_ext" / "table.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    finally:
        del sys.modules[name]
    return module


def _macro(name: str, lines: list[str]) -> str:
    return f"#define {name}(X) \\\n" + " \\\n".join(f"  {line}" for line in lines) + "\n\n"


def render_ops_table(table) -> str:
    """The C++ op table (OPS_TABLE) for a table module (ffn_ext.table): the op lines in table order, the gated ops'
    parameter sets, all as preprocessor macros the C++ sources expand."""
    acts = [f"X({a.name}, {a.functor})" for a in table.ACTIVATIONS]
    gated: list[str] = []
    psets: dict[str, tuple[str, tuple]] = {"NONE": ("NoParams", ())}
    for g in table.GATED:
        key = "NONE" if g.cpp_gate is None else g.cpp_gate[1].removesuffix("Params").upper()
        if g.cpp_gate is not None:
            psets[key] = (g.cpp_gate[1], g.params)
        gated.append(f"X({g.name}, {g.functor}, {key})")
    schemas = ["X(\"" + schema.replace('"', '\\"') + f'", {int(pointwise)})' for schema, pointwise in table.SCHEMAS]
    out = [_OPS_TABLE_DOC, "// clang-format off\n", _macro("FFN_EXT_ACTIVATIONS", acts), _macro("FFN_EXT_GATED", gated)]
    out.append(_macro("FFN_EXT_SCHEMAS", schemas))
    for key, (struct, params) in psets.items():
        names = [p.name for p in params]
        defaults = "".join(f", double {p.name}" + ("" if p.default is None else f" = {p.default!r}") for p in params)
        bodies = {
            "DECL": "".join(f", double {n}" for n in names),
            "ARGS": "".join(f", {n}" for n in names),
            "MAKE": f"math::{struct}{{{', '.join(names)}}}",
            "DEFAULTS": defaults,
        }
        out += [f"#define FFN_EXT_P_{part}_{key} {body}".rstrip() + "\n" for part, body in bodies.items()]
    return "".join(out) + "// clang-format on\n"


def write_ops_table(root: Path) -> bool:
    """Writes root's OPS_TABLE from root's ffn_ext/table.py when it differs (an unchanged file keeps its time, so
    nothing rebuilds). True if it wrote. A root without table.py (an installed package's _src) has its copy."""
    if not (root / "ffn_ext" / "table.py").is_file():
        return False
    text = render_ops_table(_load_table(root))
    path = root / OPS_TABLE
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return True


def source_root() -> Path:
    """The directory holding csrc/build.json: the checkout's root, else the package's shipped copy."""
    for root in (CHECKOUT, SHIPPED):
        if (root / "csrc" / "build.json").is_file():
            return root
    raise FileNotFoundError(
        f"ffn_ext: no C++/CUDA sources found: neither {CHECKOUT / 'csrc' / 'build.json'} (a source checkout) nor "
        f"{SHIPPED / 'csrc' / 'build.json'} (an installed package) exists. Reinstall ffn_ext from its sdist or a "
        "checkout (pip install --no-build-isolation ...) to get them."
    )


def config(root: Path | None = None) -> dict:
    with open((root or source_root()) / "csrc" / "build.json") as f:
        return json.load(f)


def shipped_files(root: Path) -> list[str]:
    """Files (relative to root) that make up the sources: what an installed package carries and what the sources
    hash covers. Every C++/CUDA file under csrc/ (headers included), build.json, and CMakeLists.txt / cmake/."""
    out = []
    for p in sorted((root / "csrc").rglob("*")):
        if p.is_file() and (p.suffix in (".h", ".cuh", ".hpp", ".cpp", ".cu") or p.name == "build.json"):
            out.append(p.relative_to(root).as_posix())
    cmake = (
        sorted(q.relative_to(root).as_posix() for q in (root / "cmake").glob("*")) if (root / "cmake").is_dir() else []
    )
    return out + [rel for rel in ["CMakeLists.txt", *cmake] if (root / rel).is_file()]


def sources_hash(root: Path | None = None) -> str:
    """sha256 over the C++/CUDA sources, headers and build.json (not the CMake files): equal hashes, same code."""
    root = root or source_root()
    h = hashlib.sha256()
    for rel in shipped_files(root):
        if rel.startswith("csrc/"):
            h.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return h.hexdigest()[:16]


CUDA_HOME_VARS = ("CUDA_HOME", "CUDA_PATH")  # torch.utils.cpp_extension's order
TOOLKIT_FILES = ("bin/nvcc", "include/cuda_runtime.h")  # what cpp_extension compiles with: $CUDA_HOME/<these>
DEFAULT_CUDA_HOME = "/usr/local/cuda"  # cpp_extension's last guess


class CudaToolkitError(RuntimeError):
    """A CUDA build is due (a CUDA build of torch, FFN_EXT_FORCE_CPU unset) and the CUDA toolkit named or found
    cannot compile it. Raised before anything is compiled; the message says what was found, what is missing, and
    the two ways out (CUDA_HOME, FFN_EXT_FORCE_CPU)."""


def _missing(home: str | Path) -> list[str]:
    """TOOLKIT_FILES absent under home (all of them when home does not exist)."""
    return [rel for rel in TOOLKIT_FILES if not (Path(home) / rel).is_file()]


def _nvcc_top(nvcc: str) -> tuple[str | None, str]:
    """(the toolkit folder the nvcc at this path really runs from, None and why not). Asked of nvcc itself: a dry run
    prints `#$ TOP=<its bin>/..`, which holds for a wrapper script that execs the toolkit's nvcc and for symlinks
    alike; -E on /dev/null compiles nothing, and --dryrun runs nothing."""
    import subprocess

    try:
        r = subprocess.run(
            [nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"it did not run ({e})"
    found = re.search(r"^#\$ TOP=(.+?)\s*$", r.stdout + r.stderr, re.M)
    if found is None:
        said = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or ["no output"]
        return None, f"`nvcc --dryrun` named no toolkit (exit status {r.returncode}, {said[0]})"
    return os.path.normpath(found.group(1)), ""


def _toolkits_here() -> list[str]:
    """Complete toolkits in the usual place (/usr/local/cuda*), to name in a message."""
    return sorted(str(p) for p in Path("/usr/local").glob("cuda*") if p.is_dir() and not _missing(p))


def _toolkit_error(found: str, checked: list[tuple[str, str]]) -> CudaToolkitError:
    here = _toolkits_here()
    lines = [
        "ffn_ext: cannot build the CUDA kernels: no usable CUDA toolkit (stopped before compiling anything).",
        f"  found:   {found}",
        *(f"  checked: {home}: {what}" for home, what in checked),
        f"  missing: a toolkit folder with {' and '.join(TOOLKIT_FILES)} (torch compiles with $CUDA_HOME/<these>)",
        "Rerun the same command (pip install ..., or ffn_ext.jit.load()) with one of:",
        "  CUDA_HOME=/path/to/cuda     the CUDA toolkit to compile the kernels with"
        + (f" (here: {', '.join(here)})" if here else ""),
        f"  {FORCE_CPU_ENV}=1         no CUDA kernels: CUDA tensors then run the ops' ATen forms",
    ]
    return CudaToolkitError("\n".join(lines))


def find_cuda_home() -> tuple[str | None, str]:
    """(the CUDA toolkit to build with, how it was found). None when there is none: CUDA_HOME and CUDA_PATH unset,
    no nvcc on PATH and no /usr/local/cuda (then the build is CPU-only). Raises CudaToolkitError when one is named or
    found that lacks TOOLKIT_FILES.

    torch.utils.cpp_extension takes CUDA_HOME, else CUDA_PATH, else the folder above the bin/ of the first nvcc on
    PATH, else /usr/local/cuda. The third guess fails for an nvcc that is a wrapper script outside the toolkit
    (/usr/local/bin/nvcc execing /usr/local/cuda-13.0/bin/nvcc gives /usr/local, which has no CUDA headers) and the
    build then died deep in ninja on cuda_runtime.h: here the toolkit is the one that nvcc really runs."""
    for var in CUDA_HOME_VARS:
        home = os.environ.get(var)
        if home:
            missing = _missing(home)
            if missing:
                raise _toolkit_error(f"{var}={home}", [(home, "no " + " and no ".join(missing))])
            return home, f"named by {var}"
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        top, why_not = _nvcc_top(nvcc)
        real = os.path.realpath(nvcc)
        candidates = [(top, "the toolkit that nvcc runs, asked with nvcc --dryrun")] if top else []
        if real != nvcc:
            candidates.append((os.path.dirname(os.path.dirname(real)), f"above the bin/ of nvcc's target, {real}"))
        candidates.append((os.path.dirname(os.path.dirname(nvcc)), "above nvcc's bin/: torch's own guess"))
        checked: list[tuple[str, str]] = []
        for home, how in candidates:
            if home in (h for h, _ in checked):
                continue
            missing = _missing(home)
            if not missing:
                return home, f"{how}; the nvcc on PATH: {nvcc}"
            checked.append((home, "no " + " and no ".join(missing) + f" ({how})"))
        found = f"the nvcc on PATH, {nvcc}, with CUDA_HOME and CUDA_PATH unset; " + (
            f"it runs the toolkit in {top}" if top else why_not
        )
        raise _toolkit_error(found, checked)
    default = DEFAULT_CUDA_HOME
    if os.path.exists(default):
        missing = _missing(default)
        if missing:
            found = f"{default} (no nvcc on PATH; CUDA_HOME and CUDA_PATH unset)"
            raise _toolkit_error(found, [(default, "no " + " and no ".join(missing))])
        return default, "no nvcc on PATH: torch's default"
    return None, f"no CUDA toolkit: CUDA_HOME and CUDA_PATH are unset, no nvcc is on PATH, and {default} is absent"


def use_cuda_home(home: str) -> None:
    """Points torch.utils.cpp_extension at the toolkit home: CUDA_HOME for this process and its children (the module
    reads it when first imported) and the module's own CUDA_HOME when it was imported already (its build functions
    read that global)."""
    import sys

    os.environ["CUDA_HOME"] = home
    cpp_extension = sys.modules.get("torch.utils.cpp_extension")
    if cpp_extension is not None:
        cpp_extension.CUDA_HOME = home  # type: ignore[attr-defined]


def cuda_toolkit() -> tuple[str, str]:
    """For a build that compiles the CUDA kernels: finds the toolkit (find_cuda_home), points torch at it, and
    returns (its folder, how it was found). Raises CudaToolkitError when there is none or it is incomplete."""
    home, how = find_cuda_home()
    if home is None:
        raise _toolkit_error(how, [])
    use_cuda_home(home)
    return home, how


def decide_cuda() -> tuple[bool, str]:
    """(build CUDA kernels?, why), having pointed torch's cpp_extension at the toolkit when yes. Needs a CUDA build
    of torch and a CUDA toolkit (find_cuda_home): with none at all the build is CPU-only; with one that cannot
    compile, CudaToolkitError. Call it before importing torch.utils.cpp_extension, whose import logs its own guess."""
    import torch

    if os.environ.get(FORCE_CPU_ENV, "0") not in ("", "0"):
        return False, f"{FORCE_CPU_ENV} is set"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU-only build"
    home, how = find_cuda_home()
    if home is None:
        return False, f"{how} (set CUDA_HOME to the toolkit's folder, the one holding bin/nvcc)"
    use_cuda_home(home)
    return True, f"torch {torch.__version__} (CUDA {torch.version.cuda}) and the CUDA toolkit in {home} ({how})"


def visible_gpu_archs() -> str | None:
    """The visible GPUs' architectures as a TORCH_CUDA_ARCH_LIST ('9.0+PTX': PTX for the newest, as torch's own
    extensions build for them), or None when this torch sees no GPU."""
    import torch

    if torch.version.cuda is None or not torch.cuda.is_available():
        return None
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{major}.{minor}" for major, minor in caps) + "+PTX"


def choose_archs(cfg: dict) -> tuple[str, str]:
    """(the TORCH_CUDA_ARCH_LIST of a CUDA build, why): the user's; else the visible GPU's alone, as torch's own
    extensions do (a build for one architecture takes about half the time of two); else, with no GPU visible, the
    project default. Sets the variable, which torch's build reads. Only the architectures look at the GPU: whether
    to build the CUDA kernels at all never does (decide_cuda)."""
    chosen = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if chosen:
        return chosen, "TORCH_CUDA_ARCH_LIST"
    gpus = visible_gpu_archs()
    if gpus:
        chosen, why = gpus, "the visible GPU's alone (TORCH_CUDA_ARCH_LIST picks others)"
    else:
        chosen = cfg["default_cuda_archs"]
        why = (
            f"the default: no GPU visible (TORCH_CUDA_ARCH_LIST picks others; {FORCE_CPU_ENV}=1 builds in seconds, "
            "without the CUDA kernels, which only a GPU runs)"
        )
    os.environ["TORCH_CUDA_ARCH_LIST"] = chosen
    return chosen, why


def arch_names(arch_list: str) -> str:
    """'8.0;9.0+PTX' -> 'sm_80, sm_90 (+PTX)'; '800,900' (the library's record) -> 'sm_80, sm_90'."""
    items = [a for a in re.split(r"[;,\s]+", arch_list.strip()) if a]
    names = []
    for item in items:
        base = item.removesuffix("+PTX")
        number = base.replace(".", "") if "." in base else str(int(base) // 10) if base.isdigit() else base
        names.append(f"sm_{number}" + (" (+PTX)" if item.endswith("+PTX") else ""))
    return ", ".join(names)


# The rates the time estimate rests on (compiler CPU-seconds of a fresh build, measured: docs/building.md#build-time):
# _C's two g++ files; the CUDA library's g++ glue; nvcc's kernel parts, once per architecture. They spread over
# MAX_JOBS (else the cores), at most about two jobs per architecture at a time (nvcc --threads=0).
_CPU_S_C, _CPU_S_CUDA_GLUE, _CPU_S_PER_ARCH = 10, 15, 85


def expected_build_time(arch_list: str | None) -> str:
    """A rough wall time for a fresh build ('about 1.5 min with 2 parallel jobs'), for the build's first lines:
    arch_list None for a build without the CUDA kernels."""
    archs = len([a for a in re.split(r"[;\s]+", arch_list.strip()) if a]) if arch_list else 0
    jobs = max(1, int(os.environ.get("MAX_JOBS") or 0) or (os.cpu_count() or 1))
    cpu_s = _CPU_S_C + (_CPU_S_CUDA_GLUE + _CPU_S_PER_ARCH * archs if archs else 0)
    wall = cpu_s / min(jobs, 2 + 2 * archs)
    amount = f"{wall:.0f} s" if wall < 90 else f"{wall / 60:.1f} min"
    return f"about {amount} with {jobs} parallel job{'s' * (jobs > 1)}"


def build_plan(with_cuda: bool, why: str, archs: str | None, archs_why: str, what: str) -> list[str]:
    """The lines a build (setup.py, ffn_ext.jit) prints first: what it builds, with which toolkit, for which
    architectures, and how long it should take."""
    if not with_cuda:
        return [f"ffn_ext: building {what} only (no CUDA kernels): {why}; {expected_build_time(None)}"]
    return [
        f"ffn_ext: building {what} and the CUDA kernels: {why}",
        f"  architectures: {archs} ({arch_names(archs or '')}): {archs_why}",
        f"  expected time: {expected_build_time(archs)} (MAX_JOBS sets them)",
    ]


TORCH_TARGET_VERSION = "0x020a000000000000"  # 2.10: (2 << 56) | (10 << 48), in build.json's flags


def python_target(root: Path | None = None) -> tuple[list[str], dict, list[str]]:
    """ffn_ext._C (pybind11, the schemas): absolute sources, {'cxx': flags}, libraries to link (libtorch_cpu only:
    no torch_python, c10 or torch, which the stable ABI does not need)."""
    root = root or source_root()
    cfg = config(root)
    return (
        [str(root / s) for s in cfg["python_sources"]],
        {"cxx": list(cfg["cxx_flags"])},
        list(cfg["python_libraries"]),
    )


def cuda_target(root: Path | None = None) -> tuple[list[str], dict, list[str]]:
    """The CUDA library (cuda_library in build.json): absolute sources, {'cxx': [...], 'nvcc': [...]}, libraries.
    USE_CUDA declares the shim's CUDA functions (aoti_torch_get_current_cuda_stream)."""
    root = root or source_root()
    cfg = config(root)
    define = "-D" + cfg["cuda_define"]
    flags = {"cxx": [*cfg["cxx_flags"], define], "nvcc": [*cfg["nvcc_flags"], define]}
    return [str(root / s) for s in cfg["cuda_sources"]], flags, list(cfg["cuda_libraries"])


def cuda_library_relpath(root: Path | None = None) -> str:
    """Where the build puts the CUDA library, relative to the repository root ('ffn_ext/lib/libffn_ext_cuda.so')."""
    return config(root)["cuda_library"]


def torch_base_version(version: str) -> str:
    """'2.14.1+cu130' -> '2.14.1'."""
    return version.split("+")[0]


def build_record(with_cuda: bool, root: Path | None = None, archs: str | None = None) -> dict:
    """What a build of _C records next to it (RECORD): read at import without loading a library, so that the CUDA
    library is loaded only under a torch of the CUDA major it was built with (_loader.py; _C itself, stable-ABI,
    loads under any torch >= 2.10), build_summary() names the architectures of a CUDA library it does not load,
    and ffn_ext.jit can compare the sources it was built from."""
    import torch

    return {
        "torch_version": torch_base_version(torch.__version__),
        "torch_cuda": torch.version.cuda,
        "cuda_kernels": bool(with_cuda),
        "cuda_archs": archs if with_cuda else None,
        "sources_hash": sources_hash(root),
    }


PREBUILT_ENV = "FFN_EXT_PREBUILT"  # setup.py ships the in-place build's binaries instead of compiling (.ci/wheel)


def prebuilt_files(root: Path) -> tuple[list[str], dict]:
    """(the binaries an in-place build left in root's package, relative to root, and its record), for a wheel made
    from them without compiling again (PREBUILT_ENV). Raises RuntimeError when there is no such build or it was
    made from other sources than root's: a wheel must hold the code its sources describe."""
    import importlib.machinery

    package = root / "ffn_ext"
    record = read_record(package)
    found = [p for s in importlib.machinery.EXTENSION_SUFFIXES for p in package.glob("_C" + s)]
    if record is None or not found:
        raise RuntimeError(f"{PREBUILT_ENV}=1: no in-place build in {package} (_C and {RECORD}): build it first")
    if record.get("sources_hash") != sources_hash(root):
        raise RuntimeError(f"{PREBUILT_ENV}=1: the in-place build in {package} was made from other sources: rebuild")
    files = [found[0], package / RECORD]
    cuda = root / cuda_library_relpath(root)
    if record.get("cuda_kernels"):
        if not cuda.is_file():
            raise RuntimeError(f"{PREBUILT_ENV}=1: {RECORD} records CUDA kernels and {cuda} is missing: rebuild")
        files.append(cuda)
    return [p.relative_to(root).as_posix() for p in files], record


def read_record(directory: Path) -> dict | None:
    try:
        return json.loads((Path(directory) / RECORD).read_text())
    except (OSError, ValueError):
        return None


def in_checkout() -> bool:
    """True when the package is imported from a source checkout (setup.py next to it)."""
    return (CHECKOUT / "setup.py").is_file() and (CHECKOUT / "csrc" / "build.json").is_file()


def rebuild_command() -> str:
    """The command that rebuilds ffn_ext in this environment (with its torch's CUDA major), for messages."""
    if in_checkout():
        return f"cd {CHECKOUT} && pip install --no-build-isolation -e ."
    return (
        "pip install --no-build-isolation --no-binary ffn_ext --force-reinstall --no-deps ffn_ext "
        "(or, from its sdist or checkout: pip install --no-build-isolation <path>)"
    )


def shipped_files_abs(root: Path | None = None) -> list[str]:
    root = root or source_root()
    return [str(root / rel) for rel in shipped_files(root)]


if __name__ == "__main__":  # python ffn_ext/_build.py --ops-table ROOT: .ci/env and CMake generate the op table
    import sys

    if sys.argv[1:2] != ["--ops-table"] or len(sys.argv) != 3:
        sys.exit("usage: python ffn_ext/_build.py --ops-table ROOT")
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != PACKAGE]  # its modules would shadow others
    if write_ops_table(Path(sys.argv[2]).resolve()):
        print(f"ffn_ext: wrote {OPS_TABLE} from ffn_ext/table.py")
