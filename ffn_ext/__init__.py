"""ffn_ext: fused activation kernels for transformer MLPs (exact GELU, SiLU, SwiGLU), forward and backward.

    import ffn_ext
    h = ffn_ext.swiglu(gate, up)          # silu(gate) * up
    h = ffn_ext.swiglu_packed(gate_up)    # [..., 2M] -> [..., M]
    y = ffn_ext.gelu(x); y = ffn_ext.silu(x)

The ops are torch.ops.ffn_ext.* (dispatcher ops: autograd, torch.compile, export and fake tensors work).
"""
import torch  # noqa: F401  (load libtorch before the native library)

from . import jit  # noqa: F401
from .ops import build_info, build_summary, gelu, has_cuda_kernels, silu, swiglu, swiglu_packed
from .modules import FFN, GELU, SiLU, SwiGLU, SwiGLUFFN, swiglu_mlp, swiglu_mlp_packed
from .sizing import ffn_params, swiglu_ffn_params, swiglu_hidden_dim
from . import hf  # noqa: F401
from .hf import patch_model as patch_hf_model

__version__ = "0.1.0"
__all__ = ["gelu", "silu", "swiglu", "swiglu_packed", "has_cuda_kernels", "build_info", "build_summary", "jit"]
__all__ += ["GELU", "SiLU", "SwiGLU", "FFN", "SwiGLUFFN", "swiglu_mlp", "swiglu_mlp_packed",
            "swiglu_hidden_dim", "ffn_params", "swiglu_ffn_params", "hf", "patch_hf_model"]
