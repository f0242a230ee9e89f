"""MoE experts modules (_EXPERTS): their gating of the [S, 2I] projection by one ffn_ext op, through _apply_gate
and, where the class inlines it, a replacement forward (_FORMS)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import ops as _ops
from .common import _PLAIN, _attr, _bind, _BoundForward, _Clamp, _defining, _fused_gate, _Gate, _gate_state

# transformers 5.24 MoE experts classes whose gating is one ffn_ext op: name -> (_Gate, form). Forms: how the class's
# own (eager) forward reaches the gating, so what the patch replaces:
#   gate         it calls self._apply_gate (GPT-OSS, DeepSeek-V4, ...): only _apply_gate is patched
#   linear       @use_experts_implementation classes whose eager loop inlines gate, up = F.linear(x, gate_up_proj[e])
#                .chunk(2, -1); act_fn(gate) * up; transformers' default _apply_gate (the same gating) serves its other
#                implementations: both are patched (matmul: x @ gate_up_proj[e], is_transposed; linear_norm: with the
#                post_expert_norm)
#   llama4, longcat, dbrx, shared, jetmoe   classes without an experts implementation switch: forward is patched
#                (jetmoe: JetMoE's MoE layer, router and experts in one, its experts' [S, 2I] projection from
#                JetMoeParallelExperts submodules)
# tests/test_hf_moe.py checks each against transformers' source, and that no class of these forms is missing.
_GPT_OSS = _Gate(act=None, limit="limit", alpha="alpha", up_offset=1.0)
_EXPERTS = {
    **{
        name: (_PLAIN, "linear")
        for name in """
        AXK1Experts AXK2Experts AfmoeExperts BailingHybridExperts Cohere2MoeExperts DeepseekOcr2TextExperts
        DeepseekV2Experts DeepseekV32Experts DeepseekV3Experts DiffusionGemmaTextExperts Dots1Experts Dots3NoteExperts
        Ernie4_5_MoeExperts Ernie4_5_VLMoeMoeExperts ExaoneMoeExperts FlexOlmoExperts FlintExperts Gemma4TextExperts
        Glm4MoeExperts Glm4MoeLiteExperts Glm4vMoeTextExperts GlmMoeDsaExperts GraniteMoeExperts
        GraniteMoeHybridExperts GraniteMoeSWAExperts GraniteMoeSharedExperts HYV3Experts HunYuanMoEV1Experts
        InklingExperts JambaExperts KimiLinearExperts Kolibri1Experts LagunaExperts LaraMiniExperts Lfm2MoeExperts
        MellumExperts MiMoV2FlashExperts MiniMaxExperts MiniMaxM2Experts Mistral4Experts MistralLarge4TextExperts
        MixtralExperts OlmoeExperts PhimoeExperts Qwen2MoeExperts Qwen3MoeExperts Qwen3NextExperts
        Qwen3OmniMoeTalkerTextExperts Qwen3OmniMoeThinkerTextExperts Qwen3VLMoeTextExperts Qwen3_5MoeExperts
        Qwen4ExpTextExperts SolarOpenExperts UnlimitedOcrTextExperts ZayaExperts
    """.split()
    },
    "AriaExperts": (_PLAIN, "matmul"),
    "MuseSparkExperts": (_PLAIN, "linear_norm"),
    "BeamExperts": (_PLAIN, "gate"),  # act_fn(gate.float()) * up.float(), rounded once: what ffn_ext computes
    "GptOssExperts": (_GPT_OSS._replace(layout="interleaved"), "gate"),
    "OpenAIPrivacyFilterExperts": (_GPT_OSS, "gate"),
    "MiniMaxM3VLExperts": (_Gate(act=None, limit="swiglu_limit", alpha="swiglu_alpha", up_offset=1.0), "gate"),
    "DeepseekV4Experts": (_Gate(limit="limit"), "gate"),
    "Glm5NextTextExperts": (_Gate(act=None, limit="swiglu_limit"), "gate"),
    "HYV4Experts": (_Gate(act=None, limit="swiglu_limit"), "gate"),
    "HYV4VLExperts": (_Gate(act=None, limit="swiglu_limit"), "gate"),
    "Llama4TextExperts": (_PLAIN, "llama4"),
    "LongcatFlashExperts": (_PLAIN, "longcat"),
    "DbrxExpertGLU": (_Gate(act="activation_fn"), "dbrx"),
    "InklingSharedExperts": (_PLAIN, "shared"),
    "JetMoeMoE": (_Gate(act="activation"), "jetmoe"),  # not JetMoeMoA (attention experts: no gating)
}
_UNKNOWN_EXPERTS = (
    "MoE experts modules whose gating ffn_ext does not compute or that are not known to it (their "
    "routed experts run as they are, unaccelerated)"
)
_DISAGREES_GATE = (
    "their gating gave a different result from ffn_ext's op on a random input (self-check), so it must run as it is"
)


def _own_gate(module, gate: _Gate, gate_up):
    """What the module's own code computes from gate_up: its class's _apply_gate, else (the classes that inline the
    gating: always the plain form, concat) act(gate) * up."""
    cls_gate = getattr(type(module), "_apply_gate", None)
    if cls_gate is not None:
        return cls_gate(module, gate_up)
    g, u = gate_up.chunk(2, dim=-1)
    return _attr(module, gate.act)(g) * u


# The replacement forwards of experts classes that inline their gating (_EXPERTS' forms): the class's own code with
# the gating by ffn_ext (state: from _gate_state), the rest as it was, operation for operation.
def _routed(self, state, hidden_states, top_k_index, top_k_weights, matmul=False, norm=False):
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(mask[expert_idx])
        current = hidden_states[token_idx]
        if matmul:
            current = _fused_gate(state, current @ self.gate_up_proj[expert_idx]) @ self.down_proj[expert_idx]
        else:
            current = F.linear(
                _fused_gate(state, F.linear(current, self.gate_up_proj[expert_idx])), self.down_proj[expert_idx]
            )
        if norm:
            current = self.post_expert_norm(current)
        current = current * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, current.to(final.dtype))
    return final


def _routed_linear(self, state, hidden_states, top_k_index, top_k_weights):
    return _routed(self, state, hidden_states, top_k_index, top_k_weights)


def _routed_matmul(self, state, hidden_states, top_k_index, top_k_weights):
    return _routed(self, state, hidden_states, top_k_index, top_k_weights, matmul=True)


def _routed_linear_norm(self, state, hidden_states, top_k_index, top_k_weights):
    return _routed(self, state, hidden_states, top_k_index, top_k_weights, norm=True)


def _llama4_forward(self, state, hidden_states):
    hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
    gate_up = torch.bmm(hidden_states, self.gate_up_proj)
    return torch.bmm(_fused_gate(state, gate_up), self.down_proj).view(-1, self.hidden_size)


def _longcat_forward(self, state, hidden_states, top_k_index, top_k_weights):
    final = torch.zeros_like(hidden_states)
    if top_k_index.numel() == 0:
        return final
    mask = F.one_hot(top_k_index, num_classes=self.total_experts).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero(as_tuple=False)
    for expert_idx_tensor in hit:
        expert_idx = int(expert_idx_tensor.item())
        selection_idx, token_idx = torch.where(mask[expert_idx].squeeze(0))
        if token_idx.numel() == 0:
            continue
        current = hidden_states[token_idx]
        if expert_idx >= self.num_routed_experts or self.gate_up_proj is None:
            current = self.identity_expert(current)
        else:
            current = F.linear(
                _fused_gate(state, F.linear(current, self.gate_up_proj[expert_idx])), self.down_proj[expert_idx]
            )
        current = current * top_k_weights[token_idx, selection_idx, None]
        final.index_add_(0, token_idx, current.to(hidden_states.dtype))
    return final


def _dbrx_forward(self, state, x, expert_w1, expert_v1, expert_w2):
    return _ops.gated(x.matmul(expert_w1.T), x.matmul(expert_v1.T), state.name).matmul(expert_w2)


def _shared_forward(self, state, hidden_states, gammas):
    input_shape = hidden_states.shape
    hidden_states = hidden_states.reshape(1, -1, input_shape[-1]).expand(self.n_shared_experts, -1, -1)
    gammas = gammas.reshape(-1, self.n_shared_experts, 1).transpose(0, 1)
    gate = torch.bmm(hidden_states, self.gate_proj.transpose(1, 2))
    up = torch.bmm(hidden_states, self.up_proj.transpose(1, 2))
    down = torch.bmm(_ops.gated(gate, up, state.name) * gammas, self.down_proj.transpose(1, 2))
    return down.float().sum(dim=0).to(hidden_states.dtype).view(input_shape)


def _jetmoe_forward(self, state, layer_input):
    bsz, length, emb_size = layer_input.size()
    layer_input = layer_input.reshape(-1, emb_size)
    _, batch_index, batch_gates, expert_size, router_logits = self.router(layer_input)
    expert_inputs = layer_input[batch_index]
    hidden_states = _fused_gate(state, self.input_linear(expert_inputs, expert_size))
    expert_outputs = self.output_linear(hidden_states, expert_size)
    expert_outputs = expert_outputs * batch_gates[:, None]
    zeros = torch.zeros((bsz * length, self.input_size), dtype=expert_outputs.dtype, device=expert_outputs.device)
    layer_output = zeros.index_add(0, batch_index, expert_outputs)
    layer_output = layer_output.view(bsz, length, self.input_size)
    return layer_output + self.bias


_ROUTED = ("hidden_states", "top_k_index", "top_k_weights")

# form -> (the replacement forward, its parameters after self, whether the class has transformers' experts
# implementation switch (@use_experts_implementation: then only its "eager" runs the replacement)); "gate": none
_FORMS = {
    "linear": (_routed_linear, _ROUTED, True),
    "matmul": (_routed_matmul, _ROUTED, True),
    "linear_norm": (_routed_linear_norm, _ROUTED, True),
    "gate": None,
    "llama4": (_llama4_forward, ("hidden_states",), False),
    "longcat": (_longcat_forward, _ROUTED, False),
    "dbrx": (_dbrx_forward, ("x", "expert_w1", "expert_v1", "expert_w2"), False),
    "shared": (_shared_forward, ("hidden_states", "gammas"), False),
    "jetmoe": (_jetmoe_forward, ("layer_input",), False),
}


def _eager(module) -> bool:
    """Whether a @use_experts_implementation module runs its own (eager) forward now: config._experts_implementation
    is "eager" or None (any other runs transformers' grouped_mm, batched_mm, ..., which call _apply_gate)."""
    return getattr(getattr(module, "config", None), "_experts_implementation", "") in ("eager", None)


class _BoundGate:
    """The patched _apply_gate of an experts module (set on the instance; picklable, like _BoundForward): what
    transformers' experts implementations (grouped_mm, batched_mm, deepgemm) and the class's own forward call on the
    [S, 2I] projection. Runs ffn_ext's op on it in place while _gate_state allows, else the class's _apply_gate."""

    def __init__(self, module, gate: _Gate):
        self.__self__, self.gate = module, gate

    def __call__(self, gate_up):
        module = self.__self__
        state = _gate_state(module, self.gate)
        if state is not None and isinstance(gate_up, torch.Tensor):
            return _fused_gate(state, gate_up)
        return type(module)._apply_gate(module, gate_up)


class _BoundExperts(_BoundForward):
    """The patched forward of an experts module whose own forward inlines its gating (_FORMS): runs the replacement
    (`func`: the same code, with ffn_ext's op for the gating) where the class would run that forward (always, or for
    @use_experts_implementation classes while their implementation is "eager") and _gate_state allows. Every other
    call goes to the original forward: `prev` (an instance forward wrapper) if there was one, else the class's (its
    grouped_mm and batched_mm call the patched _apply_gate); so does a call that does not bind to the forward's
    parameters (`names`)."""

    names, dispatch = (), False

    def __init__(self, module, func, names, prev, gate, dispatch):
        super().__init__(module, func, names[0], prev, gate)
        self.names, self.dispatch = names, dispatch

    def __call__(self, *args, **kwargs):
        module, prev = self.__self__, self.prev
        if prev is not None:
            return prev(*args, **kwargs)
        if not self.dispatch or _eager(module):
            bound = _bind(self.names, args, kwargs)
            if bound is not None:
                state = _gate_state(module, self.gate)
                if state is not None:
                    return self.__func__(module, state, *bound)
        return type(module).forward(module, *args, **kwargs)


def _experts_entry(cls):
    """(_Gate, form) of an experts class: its forward, and its _apply_gate if it has one, are those of a
    transformers class of _EXPERTS (a subclass that overrides either is not known); else None."""
    c = _defining(cls, "forward")
    if c is None or c.__name__ not in _EXPERTS or not c.__module__.startswith("transformers."):
        return None
    if _defining(cls, "_apply_gate") not in (None, c):
        return None
    return _EXPERTS[c.__name__]


def _3d(params: dict, name: str) -> bool:
    t = params.get(name)
    return t is not None and t.dim() == 3


def _is_experts(module) -> bool:
    """Whether `module` holds gated MoE experts (patched, or named in the warning): a class of _EXPERTS or a subclass
    of one (its own forward or _apply_gate: not known); an experts class of transformers'
    @use_experts_implementation, by its has_gate (non-gated experts, act(up), are no more this patch's business
    than non-gated MLPs); any module with an _apply_gate; one with a 3-D gate_up_proj parameter, or 3-D gate_proj
    and up_proj."""
    cls = type(module)
    if any(c.__name__ in _EXPERTS and c.__module__.startswith("transformers.") for c in cls.__mro__):
        return True
    has_gate = module.__dict__.get("has_gate")
    if isinstance(has_gate, bool):
        return has_gate
    if callable(getattr(cls, "_apply_gate", None)):
        return True
    p = module._parameters
    return _3d(p, "gate_up_proj") or (_3d(p, "gate_proj") and _3d(p, "up_proj"))


def _gate_agrees(module, gate: _Gate) -> bool:
    """The experts' self-check: the module's own gating code (_own_gate: its class's _apply_gate or the inline form)
    and ffn_ext's op give the same on a random [4, 32] projection (float32 on the CPU, whatever the module's device
    and dtype: the gating has no parameters; a private generator), scaled to twice the clamp limit so that the
    clamps act. Not run (True) while hooks on the activation would see it run."""
    state = _gate_state(module, gate)
    if state is None:
        return True
    scale = 2 * min(state.limit, 1e4) if isinstance(state, _Clamp) else 4.0
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0), device="cpu") * scale
    with torch.no_grad():
        ref, out = _own_gate(module, gate, x).float(), _fused_gate(state, x).float()
    return ref.shape == out.shape and bool((out - ref).norm() <= 1e-4 * ref.norm())
