"""Hugging Face interop: make a loaded `transformers` model's gated MLPs (SwiGLU, GeGLU) run on ffn_ext, in place.

    model = AutoModelForCausalLM.from_pretrained(...)
    n = ffn_ext.hf.patch_model(model)      # == ffn_ext.patch_hf_model(model); returns the number patched

What is patched: the MLPs that compute exactly down_proj(act(gate_proj(x)) * up_proj(x)), or the packed Phi-3 form
down_proj(act(gate) * up) with gate, up = gate_up_proj(x).chunk(2, -1), with nn.Linear projections and `act` (the
module's act_fn or activation_fn) one of the activations of ffn_ext's table (ffn_ext/table.py):

    silu       nn.SiLU, ffn_ext.SiLU, F.silu, ffn_ext.silu; transformers' SiLUActivation (ACT2FN "silu"; "swish"
               is nn.SiLU)
    gelu       nn.GELU(), ffn_ext.GELU(), F.gelu, ffn_ext.gelu; transformers' GELUActivation (ACT2FN "gelu" and
               "gelu_python": the exact erf GELU)
    gelu_tanh  nn.GELU(approximate="tanh"), ffn_ext.GELU(approximate="tanh"); transformers' GELUTanh (alias
               PytorchGELUTanh; ACT2FN "gelu_pytorch_tanh", "gelu_python_tanh"), NewGELUActivation ("gelu_new"),
               AccurateGELUActivation ("gelu_accurate"), FastGELUActivation ("gelu_fast"): the same function,
               0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), written four ways (gelu_fast writes sqrt(2/pi) as
               0.7978845608, the same float32 number)

(transformers classes are recognised by class name in transformers.activations and the ACT2FN name they stand for,
which the table's ``hf_names`` must list; tests/test_hf.py checks each against transformers' ACT2FN numerically).
Not patched, named in the warning: any other activation, e.g. transformers' QuickGELUActivation ("quick_gelu",
x sigmoid(1.702 x), not a GELU ffn_ext implements), ClippedGELUActivation ("gelu_10", a clamped GELU), ReLU.

Which modules: those of the transformers classes known to have exactly that forward (``_KNOWN``: Llama, Qwen2/3,
Mistral, DeepSeek-V3, OLMo, Granite, ... with SiLU; Gemma, Gemma2, Gemma3, Gemma4 text, VaultGemma,
RecurrentGemma, ... with the tanh GELU of their configs; Phi-3 packed; all checked against transformers' source by
tests/test_hf.py, which also checks that the list has every class of that form), and of the classes passed as
``extra_classes`` (your own MLPs of that form; subclasses that do not override forward count too). Modules that
only look like one (the same submodules, but extra multipliers, clamps, norms, dropout or adapters in forward) or
whose activation is not one of the above are left alone with one RuntimeWarning naming their classes (and the
activation), or refused with ValueError if strict=True (then nothing is patched). Self-check: before patching, a
module whose parameters are plain, materialized floating tensors (not meta / offloaded, quantized or sharded) and
that carries no hooks or forward wrappers is run both ways on two random rows (no_grad, its device and dtype, a
private generator); a mismatch leaves it unpatched the same way.

The patch replaces the MLP instance's ``forward`` (no class swap, no weight copy): the parameters stay the same
objects, state_dict / save_pretrained are unchanged, deepcopy and pickling keep the patch. Called with one tensor
(positionally or by the name of the original forward's parameter: x, hidden_state(s)), the new forward runs
ffn_ext.mlp.gated_mlp / gated_mlp_packed with the activation's table entry (the fused gated op; training saves x
and the projections and recomputes h in backward), or, when a projection is not a plain nn.Linear (LoRA, quantized)
or carries hooks or a forward wrapper (accelerate's add_hook_to_module, which loads offloaded weights), calls the
projections as modules with the fused gated op (ffn_ext.gated) in between. The activation is looked up at each
call: the fused forms never call the activation module, so when it carries hooks (or global module hooks are set)
or a forward wrapper, or it was replaced after patching by something that is not one of the activations above,
and for any other call signature, the MLP runs its original forward: the class's, or the forward wrapper the
instance had when it was patched (then always that one). An activation replaced by another of the table's is
fused with that one.
``unpatch_model`` restores the original forward. transformers itself is not imported here.
"""
from __future__ import annotations

import inspect
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops as _ops
from .mlp import fusable, gated_mlp, gated_mlp_packed, linear_args
from .modules import GELU, SiLU
from .table import ACTIVATIONS, BY_NAME

__all__ = ["patch_model", "unpatch_model"]

_MARK = "_ffn_ext_patched"  # 'gated' | 'packed'
_ACT = "_ffn_ext_act"        # (attribute name of the activation, the activation patched over)

# transformers classes whose forward is exactly down_proj(act(gate_proj(x)) * up_proj(x)) (gated), or
# down_proj(act(gate) * up) with gate, up = gate_up_proj(x).chunk(2, -1) (packed: the last line), with `act` the
# attribute act_fn or activation_fn that __init__ sets to ACT2FN[...] or nn.SiLU(), as of transformers 5.24; the
# activation itself is identified at patch time (_table_activation). tests/test_hf.py::
# test_known_classes_compute_plain_gated_mlp checks each against the source, and that no class of that form is
# missing.
_KNOWN = frozenset("""
    AXK1MLP AXK2MLP AfmoeMLP Aimv2MLP AriaSharedExpertsMLP BailingHybridMLP BambaMLP BltMLP ChameleonMLP Cohere2MLP
    Cohere2MoeMLP CohereCompassMLP CohereMLP CsmMLP CwmMLP DINOv3ViTGatedMLP DeepseekOcr2TextMLP
    DeepseekOcr2VisionMLP DeepseekV2MLP DeepseekV32MLP DeepseekV3MLP Deimv2SwiGLUFFN DiffLlamaMLP
    DiffusionGemmaText4MLP Dinov2SwiGLUFFN Dinov2WithRegistersSwiGLUFFN DogeMLP Dots1MLP Dots3NoteTextMLP
    Dots3NoteVisionMLP EmbeddingGemma2MLP Emu3MLP EomtDinov3GatedMLP EomtSwiGLUFFN Ernie4_5MLP Ernie4_5_MoeMLP
    Ernie4_5_VLMoeMLP EsmcMLP EuroBertMLP EvollaMLP Exaone4MLP Exaone4_5_MLP ExaoneMoeMLP FlexOlmoMLP FlintMLP
    Gemma2MLP Gemma3MLP Gemma4TextMLP Gemma4UnifiedTextMLP Gemma4VisionMLP GemmaMLP Glm4MoeLiteMLP Glm4MoeMLP
    Glm4VisionMlp Glm4vMoeTextMLP Glm4vMoeisionMlp GlmMoeDsaMLP GlmOcrVisionMlp Granite4VisionTextMLP
    GraniteDoclingTextMLP GraniteMLP GraniteSWAMLP HYV3MLP HYV4MLP HYV4VLMLP HeliumMLP HiggsAudioV2MLP HrmTextMLP
    HunYuanDenseV1MLP HunYuanMoEV1MLP HunYuanVLMLP HyperCLOVAXMLP Idefics2MLP IdeficsMLP JambaMLP KimiLinearMLP
    Kolibri1MLP LagunaMLP LaraMiniMLP Llama4TextMLP LlamaMLP LongcatFlashMLP MellumMLP MiMoV2FlashMLP MiniCPM3MLP
    Ministral3MLP MinistralMLP Mistral4MLP MistralLarge4TextMLP MistralMLP MllamaTextMLP Molmo2ImageProjectorMLP
    Molmo2MLP MoonshinMoonshineStreamingDecoderMLP MuseGlimmerAssistantMLP MuseGlimmerTextMLP MuseSparkTextMLP
    NomicBertMLP Olmo2MLP Olmo3MLP OlmoHybridMLP OlmoMLP OlmoeMLP Ovis2MLP Ovis2VisionMLP PaddleOCRMLP
    PeAudioEncoderMLP PeAudioVideoEncoderMLP PeVideoEncoderMLP PixtralMLP Qwen2MLP Qwen2MoeMLP Qwen2_5OmniMLP
    Qwen2_5_VLMLP Qwen3MLP Qwen3MoeMLP Qwen3NextMLP Qwen3OmniMoeCode2WavMlp Qwen3OmniMoeMLP
    Qwen3OmniMoeTalkerTextMLP Qwen3OmniMoeThinkerTextMLP Qwen3VLMoeTextMLP Qwen3VLTextMLP Qwen3_5MLP Qwen3_5MoeMLP
    Qwen4ExpTextMLP RadioSwiGLUFFN RecurrentGemmaMlp RfDetrDinov2SwiGLUFFN Sapiens2GatedMLP SmolLM3MLP SolarOpenMLP
    StableLmMLP Tipsv2VisionSwiGLUFFN UltrabertMLP UnlimitedOcrTextMLP VaultGemmaMLP VibeVoiceMLP VideomtGatedMLP
    VideomtSwiGLUFFN VoxtralRealtimeMLP VoxtralRealtimeTextMLP YoutuMLP ZambaMLP
    DiaMLP Dots3NoteAudioMLP EsmFold2SwiGLU Glm4MLP Glm4vTextMLP GlmImageTextMLP GlmMLP GlmOcrTextMLP Phi3MLP
    Phi4MultimodalMLP
""".split())

# why a module that looks like a gated MLP was left unpatched (the keys of patch_model's warning)
_UNKNOWN = ("not known to compute exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)) (their forward may add "
            "multipliers, clamps, norms, dropout or adapters); if a class does, pass it in extra_classes=[...]")
_DISAGREES = ("their forward gave a different result from the fused gated MLP on a random input (self-check), so "
              "it is not a plain gated MLP and must run as it is")


def _unsupported(act) -> str:
    what = type(act).__name__ if isinstance(act, nn.Module) or act is None else getattr(act, "__qualname__",
                                                                                         type(act).__name__)
    ours = "; ".join(f"{a.name}: {', '.join(a.hf_names)}" for a in ACTIVATIONS)
    return (f"activation {what} is not one ffn_ext implements (ffn_ext's, with the transformers ACT2FN names "
            f"that are the same function: {ours})")


# ---------------------------------------------------------------- which activation of the table is `act`?
_GELUS = {a.api[1]["approximate"]: a for a in ACTIVATIONS if a.api[0] == "gelu"}  # "none", "tanh" -> entry
_SILU = BY_NAME["silu"]
# transformers.activations classes -> the ACT2FN name whose function each computes (for every constructor argument
# ACT2FN passes); the table's hf_names says which entry that name is. As of transformers 5.24 (PytorchGELUTanh:
# GELUTanh's earlier name, now an alias); tests/test_hf.py checks these against ACT2FN.
_HF_CLASSES = {"SiLUActivation": "silu", "GELUActivation": "gelu", "GELUTanh": "gelu_pytorch_tanh",
               "PytorchGELUTanh": "gelu_pytorch_tanh", "NewGELUActivation": "gelu_new",
               "FastGELUActivation": "gelu_fast", "AccurateGELUActivation": "gelu_accurate"}
_HF_ENTRIES = {cls: a for cls, hf_name in _HF_CLASSES.items() for a in ACTIVATIONS if hf_name in a.hf_names}
_FUNCTIONS = ((F.silu, _SILU), (_ops.silu, _SILU), (F.gelu, _GELUS["none"]), (_ops.gelu, _GELUS["none"]))


def _table_activation(act):
    """The table entry (ffn_ext/table.py) that `act` computes, or None: nn.SiLU / nn.GELU(approximate) and
    ffn_ext's SiLU / GELU (these exact types: a subclass may compute something else), F.silu / F.gelu and ffn_ext's
    functions, and transformers' activation classes of _HF_CLASSES (matched by name and module, without importing
    transformers)."""
    cls = type(act)
    if cls is nn.SiLU or cls is SiLU:
        return _SILU
    if cls is nn.GELU or cls is GELU:
        return _GELUS.get(act.approximate)
    if cls.__module__ == "transformers.activations":
        return _HF_ENTRIES.get(cls.__name__)
    for fn, entry in _FUNCTIONS:
        if act is fn:
            return entry
    return None


def _act_now(self):
    """The table entry the fused kernels may stand in for the MLP's activation call with, else None: its
    activation (looked up now: it may have been replaced since patching) is one of the table's, and no hook or
    forward wrapper, on it or global, expects to see it run."""
    name = self.__dict__[_ACT][0]
    mods = self._modules
    act = mods[name] if name in mods else getattr(self, name, None)
    entry = _table_activation(act)
    if entry is None or (isinstance(act, nn.Module) and not fusable((), (act,))):
        return None
    return entry


def _gated_forward(self, x, act):
    mods = self._modules
    g, u, d = mods["gate_proj"], mods["up_proj"], mods["down_proj"]
    if fusable((g, u, d)):
        return gated_mlp(x, *linear_args(g, u, d), activation=act.name)
    return d(_ops.gated(g(x), u(x), act.name))


def _packed_forward(self, x, act):
    mods = self._modules
    gu, d = mods["gate_up_proj"], mods["down_proj"]
    if fusable((gu, d)):
        return gated_mlp_packed(x, *linear_args(gu, d), activation=act.name)
    return d(_ops.gated_packed(gu(x), act.name))


class _BoundForward:
    """The patched forward, bound to its MLP like a method, but picklable: a types.MethodType pickles as
    getattr(mlp, '_gated_forward') and so made torch.save(model) write checkpoints that torch.load could not read.
    This pickles the module-level function by name and the MLP by reference.

    A call with one tensor, positional or named `arg` (the original forward's parameter), runs the fused form with
    the activation's table entry while the activation may be bypassed (_act_now); every other call runs the
    original forward: `prev`, the forward the instance had when patched (a wrapper such as accelerate's hook, which
    must run), else the class's."""

    arg, prev = "x", None  # class defaults: patched models pickled before these existed still load

    def __init__(self, module, func, arg, prev):
        self.__self__, self.__func__, self.arg, self.prev = module, func, arg, prev

    def __call__(self, *args, **kwargs):
        mlp, prev = self.__self__, self.prev
        if prev is not None:
            return prev(*args, **kwargs)
        if len(args) + len(kwargs) == 1:
            x = args[0] if args else kwargs.get(self.arg)
            if isinstance(x, torch.Tensor):
                act = _act_now(mlp)
                if act is not None:
                    return self.__func__(mlp, x, act)
        return type(mlp).forward(mlp, *args, **kwargs)


def _kind(module):
    """('gated'|'packed', name of the activation attribute) for an MLP-shaped module, else None."""
    children = dict(module.named_children())
    if all(isinstance(children.get(n), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
        kind, names = "gated", ("act_fn", "activation_fn")
    elif all(isinstance(children.get(n), nn.Linear) for n in ("gate_up_proj", "down_proj")):
        kind, names = "packed", ("activation_fn", "act_fn")
    else:
        return None
    return kind, next((n for n in names if hasattr(module, n)), names[0])


def _vouched(cls, extra: tuple) -> bool:
    """Whether cls's forward is known to be a plain gated MLP: cls or a base class up to the one that defines forward is
    in `extra`, or that one is a transformers class named in _KNOWN."""
    for c in cls.__mro__:
        if c in extra:
            return True
        if "forward" in vars(c):
            return c.__name__ in _KNOWN and c.__module__.startswith("transformers.")
    return False


def _check_shapes(name, module, kind):
    d = module.down_proj
    if kind == "gated":
        g, u = module.gate_proj, module.up_proj
        ok = g.in_features == u.in_features == d.out_features and g.out_features == u.out_features == d.in_features
    else:
        gu = module.gate_up_proj
        ok = gu.in_features == d.out_features and gu.out_features == 2 * d.in_features
    if not ok:
        raise ValueError(f"ffn_ext.hf.patch_model: {name or 'model'} ({type(module).__name__}) has MLP-named "
                         "projections with inconsistent shapes; not a gated MLP ffn_ext can run")


def _agrees(module, func, act) -> bool:
    """The self-check: whether func (the fused forward) with table activation `act` computes what the class's
    forward does on two random rows (the module's device and dtype, no_grad, a private generator: the global RNG
    is untouched). True without running anything when running would be neither cheap nor free of side effects:
    parameters on meta (offloaded) or not plain floating nn.Parameters of one dtype and device (quantized,
    sharded), a Linear that is not a plain nn.Linear (LoRA), hooks or forward wrappers on any submodule (or global
    hooks). Also True when the result is not finite (weights not initialised): nothing can be told from it."""
    params, subs = list(module.parameters()), tuple(module.modules())[1:]
    if not params or not fusable(tuple(m for m in subs if isinstance(m, nn.Linear)), subs):
        return True
    w = params[0]
    if not w.is_floating_point() or any(type(p) is not nn.Parameter or p.is_meta or p.dtype != w.dtype
                                        or p.device != w.device for p in params):
        return True
    x = torch.randn(2, module.down_proj.out_features, generator=torch.Generator().manual_seed(0), device="cpu")
    x = x.to(w.device, w.dtype)
    with torch.no_grad():
        ref, out = type(module).forward(module, x).float(), func(module, x, act).float()
    tol = 2e-2 if w.element_size() <= 2 else 1e-4  # relative, in norm; half types: ffn_ext rounds h once, ATen twice
    return not bool(ref.isfinite().all()) or bool((out - ref).norm() <= tol * ref.norm())


def _input_name(forward) -> str:
    """The name of the first parameter of a bound forward ('x' when there is none to name)."""
    try:
        return next(iter(inspect.signature(forward).parameters), "x")
    except (TypeError, ValueError):
        return "x"


def patch_model(model: nn.Module, strict: bool = False, extra_classes=()) -> int:
    """Patches in place every MLP of `model` that computes a gated MLP with an activation of ffn_ext's table
    (SwiGLU, GeGLU with the exact or the tanh GELU; see the module docstring) to use ffn_ext; returns how many were
    patched now (already patched ones are not counted again).

    extra_classes: your own MLP classes (nn.Linear gate_proj/up_proj/down_proj or gate_up_proj/down_proj, an
    act_fn or activation_fn of the table: nn.SiLU, nn.GELU(approximate=...), transformers' ACT2FN["silu"],
    ACT2FN["gelu"], ACT2FN["gelu_pytorch_tanh"], ...) whose forward computes exactly
    down_proj(act_fn(gate_proj(x)) * up_proj(x)), or the packed form with gate first. Modules with these
    submodules that are not known to compute that, whose activation is not one of the table's or that fail the
    self-check are left unpatched with one RuntimeWarning naming their classes (and the activation); with
    strict=True that is a ValueError and nothing is patched."""
    extra = tuple(extra_classes)
    if not all(isinstance(c, type) for c in extra):
        raise TypeError(f"ffn_ext.hf.patch_model: extra_classes must be classes (nn.Module subclasses), got {extra!r}")
    todo, skipped = [], {}  # skipped: reason -> class name -> module names
    for name, module in model.named_modules():
        found = _kind(module)
        if found is None or getattr(module, _MARK, None):
            continue
        kind, act_name = found
        act, func = getattr(module, act_name, None), _gated_forward if kind == "gated" else _packed_forward
        prev = module.__dict__.get("forward")  # a forward wrapper set on the instance (e.g. accelerate's hook)
        entry = _table_activation(act)
        if entry is None:
            reason = _unsupported(act)
        elif not _vouched(type(module), extra):
            reason = _UNKNOWN
        else:
            _check_shapes(name, module, kind)
            reason = None if prev is not None or _agrees(module, func, entry) else _DISAGREES
        if reason:
            skipped.setdefault(reason, {}).setdefault(type(module).__name__, []).append(name or "model")
        else:
            todo.append((module, kind, func, prev, (act_name, act)))
    if skipped:
        parts = []
        for reason, by_class in skipped.items():
            where = (f"{cls} at {names[0]!r}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
                     for cls, names in by_class.items())
            parts.append(f"{reason}: {', '.join(where)}")
        msg = "ffn_ext.hf.patch_model: " + "; ".join(parts)
        if strict:
            raise ValueError(msg + " (strict=True: nothing patched)")
        warnings.warn(msg + " (left unpatched)", RuntimeWarning, stacklevel=2)
    for module, kind, func, prev, act in todo:
        module.forward = _BoundForward(module, func, _input_name(module.forward), prev)
        setattr(module, _MARK, kind)
        setattr(module, _ACT, act)
    return len(todo)


def unpatch_model(model: nn.Module) -> int:
    """Undoes patch_model: each patched MLP gets back the forward it had (its class's, or the instance forward
    that was there); under a forward wrapper added after patching by accelerate (which keeps the patched forward
    as `_old_forward`), that is where it is restored. Returns how many MLPs were restored."""
    count = 0
    for name, module in model.named_modules():
        if not getattr(module, _MARK, None):
            continue
        d = module.__dict__
        attr = next((a for a in ("forward", "_old_forward") if isinstance(d.get(a), _BoundForward)), None)
        if attr is None:
            warnings.warn(f"ffn_ext.hf.unpatch_model: {name or 'model'} ({type(module).__name__}): its patched "
                          "forward was wrapped by something other than accelerate's hook and cannot be taken out; "
                          "remove that wrapper first. Left patched.", RuntimeWarning, stacklevel=2)
            continue
        prev = d[attr].prev
        if prev is not None:
            d[attr] = prev
        elif attr == "forward":
            del d["forward"]
        else:
            d[attr] = type(module).forward.__get__(module)
        del d[_MARK], d[_ACT]
        count += 1
    return count
