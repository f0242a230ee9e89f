"""ffn_ext: fused activation kernels for transformer MLPs (GELU exact and tanh, SiLU, SwiGLU, GeGLU), forward and
backward.

    import ffn_ext
    h = ffn_ext.swiglu(gate, up)                      # silu(gate) * up
    h = ffn_ext.swiglu_packed(gate_up)                # [..., 2M] -> [..., M]; layout="interleaved" too
    h = ffn_ext.swiglu_clamped(gate, up, limit=7.0, alpha=1.702, up_offset=1.0)   # GPT-OSS, DeepSeek-V4
    h = ffn_ext.geglu(gate, up, approximate="tanh")   # gelu_tanh(gate) * up (Gemma)
    y = ffn_ext.gelu(x); y = ffn_ext.gelu(x, approximate="tanh"); y = ffn_ext.silu(x)
    y = ffn_ext.relu(x); y = ffn_ext.relu2(x); y = ffn_ext.quick_gelu(x); y = ffn_ext.act(x, "relu2")
    mlp = ffn_ext.SwiGLUFFN(896, 4864); mlp = ffn_ext.GeGLUFFN(2048, 16384, approximate="tanh")   # lean autograd
    y = ffn_ext.geglu_mlp(x, w_gate, w_up, w_down, approximate="tanh")   # the same, functional (ffn_ext.mlp)
    ffn = ffn_ext.FFN(768, 3072, activation="gelu"); y = ffn_ext.plain_mlp(x, w_fc1, w_fc2)   # the classic FFN
    ffn_ext.patch_hf_model(model)   # a transformers model's SwiGLU / GeGLU MLPs on ffn_ext (ffn_ext.hf)

The ops are torch.ops.ffn_ext.* (dispatcher ops: autograd, torch.compile, export and fake tensors work).
"""

import torch  # (load libtorch before the native library)

from . import _build

_too_old = _build.too_old(torch.__version__)
if _too_old:  # before the native library, which would fail less clearly
    raise ImportError(_too_old)

# ops first: importing it loads the native library (ffn_ext._C, or adopts ops registered before this import; see
# ffn_ext/_loader.py), and a fallback warning then points at this line, not at a module that imported ops.
from .ops import (
    act,
    build_info,
    build_summary,
    gated,
    gated_packed,
    Gating,
    geglu,
    geglu_packed,
    gelu,
    has_cuda_kernels,
    quick_gelu,
    relu,
    relu2,
    silu,
    swiglu,
    swiglu_clamped,
    swiglu_clamped_packed,
    swiglu_packed,
)
from .mlp import gated_mlp, gated_mlp_packed, geglu_mlp, geglu_mlp_packed, plain_mlp, swiglu_mlp, swiglu_mlp_packed
from .modules import FFN, GELU, Act, Gated, GatedFFN, GeGLU, GeGLUFFN, SiLU, SwiGLU, SwiGLUFFN
from .sizing import ffn_params, gated_ffn_params, swiglu_ffn_params, swiglu_hidden_dim
from . import distributed  # noqa: F401  (registers its hooks in ops and mlp; torch.distributed.tensor stays unloaded)
from . import hf  # noqa: F401
from .hf import patch_model as patch_hf_model
from . import jit  # noqa: F401

__version__ = "0.1.0"
__all__ = [
    "gelu",
    "silu",
    "relu",
    "relu2",
    "quick_gelu",
    "act",
    "swiglu",
    "swiglu_packed",
    "swiglu_clamped",
    "swiglu_clamped_packed",
    "geglu",
    "geglu_packed",
    "gated",
    "gated_packed",
    "Gating",
    "has_cuda_kernels",
    "build_info",
    "build_summary",
    "jit",
]
__all__ += [
    "Act",
    "GELU",
    "SiLU",
    "Gated",
    "SwiGLU",
    "GeGLU",
    "FFN",
    "GatedFFN",
    "SwiGLUFFN",
    "GeGLUFFN",
    "gated_mlp",
    "gated_mlp_packed",
    "swiglu_mlp",
    "swiglu_mlp_packed",
    "geglu_mlp",
    "geglu_mlp_packed",
    "plain_mlp",
    "swiglu_hidden_dim",
    "ffn_params",
    "gated_ffn_params",
    "swiglu_ffn_params",
    "hf",
    "patch_hf_model",
]

# FP8 outputs (ffn_ext.quant): the gated ops and the identity writing FP8 values and their scales in one pass
from .quant import (
    QuantRecipe,
    gated_packed_quant,
    gated_quant,
    geglu_quant,
    quantize,
    swiglu_clamped_quant,
    swiglu_quant,
)

__all__ += [
    "QuantRecipe",
    "quantize",
    "swiglu_quant",
    "geglu_quant",
    "swiglu_clamped_quant",
    "gated_quant",
    "gated_packed_quant",
]
from .fp8 import FP8FFN, FP8GatedFFN, quantize_fp8  # FP8 inference MLPs on F.scaled_mm (ffn_ext.fp8)

__all__ += ["quantize_fp8", "FP8GatedFFN", "FP8FFN"]
