"""Hugging Face interop: make a loaded `transformers` model's SwiGLU MLPs run on ffn_ext, in place.

    model = AutoModelForCausalLM.from_pretrained(...)
    n = ffn_ext.hf.patch_model(model)      # == ffn_ext.patch_hf_model(model); returns the number patched

Patched: modules of the transformers classes known to compute exactly down_proj(act_fn(gate_proj(x)) * up_proj(x))
(Llama, Qwen2/3, Mistral, DeepSeek-V3, OLMo, Granite, ...) or the packed Phi-3 form down_proj(act(gate) * up) with
gate, up = gate_up_proj(x).chunk(2, -1) (``_KNOWN``, checked against transformers' source by tests/test_hf.py), and
of the classes passed as ``extra_classes`` (your own MLPs of that form; subclasses that do not override forward
count too), when the projections are nn.Linear and the activation is a SiLU. Modules that only look like one (the
same submodules, but extra multipliers, clamps, norms, dropout or adapters in forward, or a GELU-gated activation)
are left alone with one RuntimeWarning naming their classes, or refused with ValueError if strict=True (then
nothing is patched). Self-check: before patching, a module whose parameters are plain, materialized floating
tensors (not meta / offloaded, quantized or sharded) and that carries no hooks or forward wrappers is run both ways
on two random rows (no_grad, its device and dtype, a private generator); a mismatch leaves it unpatched the same way.

The patch replaces the MLP instance's ``forward`` (no class swap, no weight copy): the parameters stay the same
objects, state_dict / save_pretrained are unchanged, deepcopy and pickling keep the patch. Called with one tensor
(positionally or by the name of the original forward's parameter: x, hidden_state(s)), the new forward runs
ffn_ext.modules.swiglu_mlp / swiglu_mlp_packed (fused SwiGLU; training saves x and the projections and recomputes
h in backward), or, when a projection is not a plain nn.Linear (LoRA, quantized) or carries hooks or a forward
wrapper (accelerate's add_hook_to_module, which loads offloaded weights), calls the projections as modules with
the fused ffn_ext.swiglu in between. The fused forms never call the activation module, so when it carries hooks
(or global module hooks are set) or a forward wrapper, or it was replaced after patching by something that is not
a SiLU, and for any other call signature, the MLP runs its original forward: the class's, or the forward wrapper
the instance had when it was patched (then always that one).
``unpatch_model`` restores the original forward. transformers itself is not imported here.
"""
from __future__ import annotations

import inspect
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops as _ops
from .modules import SiLU, _fusable, _linear_args, swiglu_mlp, swiglu_mlp_packed

__all__ = ["patch_model", "unpatch_model"]

_MARK = "_ffn_ext_patched"  # 'gated' | 'packed'
_ACT = "_ffn_ext_act"        # (attribute name of the activation, the activation patched over)

# transformers classes whose forward is exactly down_proj(act(gate_proj(x)) * up_proj(x)) (gated), or
# down_proj(act(gate) * up) with gate, up = gate_up_proj(x).chunk(2, -1) (packed: the last line), as of
# transformers 5.24; tests/test_hf.py::test_known_classes_compute_plain_swiglu checks each against the source.
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
_NOT_SILU = "not SiLU-gated, ffn_ext implements SwiGLU only"
_UNKNOWN = ("not known to compute exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)) (their forward may add "
            "multipliers, clamps, norms, dropout or adapters); if a class does, pass it in extra_classes=[...]")
_DISAGREES = ("their forward gave a different result from the fused SwiGLU on a random input (self-check), so it "
              "is not plain SwiGLU and must run as it is")


def _is_silu(act) -> bool:
    if isinstance(act, (nn.SiLU, SiLU)) or act in (F.silu, torch.nn.functional.silu, _ops.silu):
        return True
    # transformers' ACT2FN["silu"] is its own SiLUActivation class (x -> F.silu(x)); match it without importing it
    cls = type(act)
    return cls.__name__ == "SiLUActivation" and cls.__module__.startswith("transformers")


def _act_bypassable(self) -> bool:
    """Whether the fused kernels may stand in for the MLP's activation call: it still is the SiLU patched over
    (or another SiLU), and no hook or forward wrapper, on it or global, expects to see it run."""
    name, patched = self.__dict__[_ACT]
    mods = self._modules
    act = mods[name] if name in mods else getattr(self, name, None)
    if act is not patched and not _is_silu(act):
        return False
    return not isinstance(act, nn.Module) or _fusable((), (act,))


def _gated_forward(self, x):
    mods = self._modules
    g, u, d = mods["gate_proj"], mods["up_proj"], mods["down_proj"]
    if _fusable((g, u, d)):
        return swiglu_mlp(x, *_linear_args(g, u, d))
    return d(_ops.swiglu(g(x), u(x)))


def _packed_forward(self, x):
    mods = self._modules
    gu, d = mods["gate_up_proj"], mods["down_proj"]
    if _fusable((gu, d)):
        return swiglu_mlp_packed(x, *_linear_args(gu, d))
    return d(_ops.swiglu_packed(gu(x)))


class _BoundForward:
    """The patched forward, bound to its MLP like a method, but picklable: a types.MethodType pickles as
    getattr(mlp, '_gated_forward') and so made torch.save(model) write checkpoints that torch.load could not read.
    This pickles the module-level function by name and the MLP by reference.

    A call with one tensor, positional or named `arg` (the original forward's parameter), runs the fused form
    while the activation may be bypassed; every other call runs the original forward: `prev`, the forward the
    instance had when patched (a wrapper such as accelerate's hook, which must run), else the class's."""

    arg, prev = "x", None  # class defaults: patched models pickled before these existed still load

    def __init__(self, module, func, arg, prev):
        self.__self__, self.__func__, self.arg, self.prev = module, func, arg, prev

    def __call__(self, *args, **kwargs):
        mlp, prev = self.__self__, self.prev
        if prev is not None:
            return prev(*args, **kwargs)
        if len(args) + len(kwargs) == 1:
            x = args[0] if args else kwargs.get(self.arg)
            if isinstance(x, torch.Tensor) and _act_bypassable(mlp):
                return self.__func__(mlp, x)
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
    """Whether cls's forward is known to be plain SwiGLU: cls or a base class up to the one that defines forward is
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


def _agrees(module, func) -> bool:
    """The self-check: whether func (the fused forward) computes what the class's forward does on two random rows
    (the module's device and dtype, no_grad, a private generator: the global RNG is untouched). True without
    running anything when running would be neither cheap nor free of side effects: parameters on meta (offloaded)
    or not plain floating nn.Parameters of one dtype and device (quantized, sharded), a Linear that is not a plain
    nn.Linear (LoRA), hooks or forward wrappers on any submodule (or global hooks). Also True when the result is
    not finite (weights not initialised): nothing can be told from it."""
    params, subs = list(module.parameters()), tuple(module.modules())[1:]
    if not params or not _fusable(tuple(m for m in subs if isinstance(m, nn.Linear)), subs):
        return True
    w = params[0]
    if not w.is_floating_point() or any(type(p) is not nn.Parameter or p.is_meta or p.dtype != w.dtype
                                        or p.device != w.device for p in params):
        return True
    x = torch.randn(2, module.down_proj.out_features, generator=torch.Generator().manual_seed(0), device="cpu")
    x = x.to(w.device, w.dtype)
    with torch.no_grad():
        ref, out = type(module).forward(module, x).float(), func(module, x).float()
    tol = 2e-2 if w.element_size() <= 2 else 1e-4  # relative, in norm; half types: ffn_ext rounds h once, ATen twice
    return not bool(ref.isfinite().all()) or bool((out - ref).norm() <= tol * ref.norm())


def _input_name(forward) -> str:
    """The name of the first parameter of a bound forward ('x' when there is none to name)."""
    try:
        return next(iter(inspect.signature(forward).parameters), "x")
    except (TypeError, ValueError):
        return "x"


def patch_model(model: nn.Module, strict: bool = False, extra_classes=()) -> int:
    """Patches in place every MLP of `model` that computes SwiGLU (see the module docstring) to use ffn_ext;
    returns how many were patched now (already patched ones are not counted again).

    extra_classes: your own MLP classes (nn.Linear gate_proj/up_proj/down_proj or gate_up_proj/down_proj, a SiLU
    act_fn or activation_fn) whose forward computes exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)), or the
    packed form with gate first. Modules with these submodules that are not known to compute that, are not
    SiLU-gated or fail the self-check are left unpatched with one RuntimeWarning naming their classes; with
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
        if not _is_silu(act):
            reason = _NOT_SILU
        elif not _vouched(type(module), extra):
            reason = _UNKNOWN
        else:
            _check_shapes(name, module, kind)
            reason = None if prev is not None or _agrees(module, func) else _DISAGREES
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
