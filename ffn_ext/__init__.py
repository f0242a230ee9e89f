"""ffn_ext: fused activation kernels for transformer MLPs (GELU exact and tanh, SiLU, SwiGLU, GeGLU), forward and
backward.

    import ffn_ext
    h = ffn_ext.swiglu(gate, up)                      # silu(gate) * up
    h = ffn_ext.swiglu_packed(gate_up)                # [..., 2M] -> [..., M]
    h = ffn_ext.geglu(gate, up, approximate="tanh")   # gelu_tanh(gate) * up (Gemma)
    y = ffn_ext.gelu(x); y = ffn_ext.gelu(x, approximate="tanh"); y = ffn_ext.silu(x)

The ops are torch.ops.ffn_ext.* (dispatcher ops: autograd, torch.compile, export and fake tensors work).
"""
import torch  # noqa: F401  (load libtorch before the native library)

from . import jit  # noqa: F401
from .ops import (build_info, build_summary, gated, gated_packed, geglu, geglu_packed, gelu, has_cuda_kernels, silu,
                  swiglu, swiglu_packed)
from .modules import FFN, GELU, SiLU, SwiGLU, SwiGLUFFN, swiglu_mlp, swiglu_mlp_packed
from .sizing import ffn_params, swiglu_ffn_params, swiglu_hidden_dim
from . import hf  # noqa: F401
from .hf import patch_model as patch_hf_model

__version__ = "0.1.0"
__all__ = ["gelu", "silu", "swiglu", "swiglu_packed", "geglu", "geglu_packed", "gated", "gated_packed",
           "has_cuda_kernels", "build_info", "build_summary", "jit"]
__all__ += ["GELU", "SiLU", "SwiGLU", "FFN", "SwiGLUFFN", "swiglu_mlp", "swiglu_mlp_packed",
            "swiglu_hidden_dim", "ffn_params", "swiglu_ffn_params", "hf", "patch_hf_model"]
