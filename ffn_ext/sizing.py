"""Sizing helpers for transformer MLPs: the SwiGLU hidden width and parameter counts.

A standard FFN has two matrices, up [D -> F] and down [F -> D]: 2*D*F weights. A gated FFN (SwiGLU, GeGLU) has
three (gate, up, down): 3*D*F, whatever its activation. To keep the parameter budget of the classic F = 4D, SwiGLU
shrinks each matrix to 2/3 of that width: F = (2/3) * 4D = (8/3) * D, then rounds up to a hardware-friendly
multiple (LLaMA: multiple_of=256).

    >>> swiglu_hidden_dim(4096)                 # LLaMA-7B / LLaMA-2-7B: 256 * ceil(10922 / 256)
    11008
    >>> ffn_params(4096, 4 * 4096), swiglu_ffn_params(4096)
    (134217728, 135266304)

Qwen2.5-0.5B (d_model 896, intermediate 4864) does NOT follow the 8/3 rule: (8/3) * 896 = 2389, which rounds to
2560 with multiple_of=256, and no multiple_of reproduces 4864 (only the degenerate multiple_of=4864). 4864 is
19 * 256 = 5.43 * 896; it is what LLaMA's formula gives with ``ffn_dim_multiplier=2.0`` (int(2 * 2389) = 4778,
rounded up to a multiple of 256). Small models pick their widths freely; read the width from the config.
"""

from __future__ import annotations

__all__ = ["swiglu_hidden_dim", "ffn_params", "gated_ffn_params", "swiglu_ffn_params"]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"ffn_ext: `{name}` must be a positive int, got {value!r}")
    return value


def swiglu_hidden_dim(d_model: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None) -> int:
    """The SwiGLU FFN width by LLaMA's rule: floor(8 * d_model / 3), times `ffn_dim_multiplier` (if given, then
    truncated to int), rounded UP to a multiple of `multiple_of`.

    4096 -> 11008 (LLaMA-2-7B); 4096 with ffn_dim_multiplier=1.3, multiple_of=1024 -> 14336 (LLaMA-3-8B);
    896 -> 2560 by the plain 8/3 rule, while Qwen2.5-0.5B uses 4864 (= 896 with ffn_dim_multiplier=2.0,
    multiple_of=256): Qwen's width is not the 8/3 rule.
    """
    d_model = _positive_int("d_model", d_model)
    multiple_of = _positive_int("multiple_of", multiple_of)
    hidden = (8 * d_model) // 3  # == int(2 * (4 * d_model) / 3) in LLaMA's reference code, without float error
    if ffn_dim_multiplier is not None:
        if not ffn_dim_multiplier > 0:
            raise ValueError(f"ffn_ext: `ffn_dim_multiplier` must be > 0, got {ffn_dim_multiplier!r}")
        hidden = max(1, int(ffn_dim_multiplier * hidden))
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def ffn_params(d_model: int, d_ff: int, bias: bool = False) -> int:
    """Parameters of a standard FFN (up: d_model -> d_ff, down: d_ff -> d_model): 2*D*F (+ F + D biases)."""
    d_model, d_ff = _positive_int("d_model", d_model), _positive_int("d_ff", d_ff)
    return 2 * d_model * d_ff + ((d_ff + d_model) if bias else 0)


def gated_ffn_params(d_model: int, d_ff: int, bias: bool = False) -> int:
    """Parameters of a gated FFN (gate, up: D -> F, down: F -> D; ffn_ext.GatedFFN, SwiGLUFFN, GeGLUFFN):
    3*D*F (+ 2F + D biases)."""
    d_model, d_ff = _positive_int("d_model", d_model), _positive_int("d_ff", d_ff)
    return 3 * d_model * d_ff + ((2 * d_ff + d_model) if bias else 0)


def swiglu_ffn_params(d_model: int, d_ff: int | None = None, bias: bool = False, multiple_of: int = 256) -> int:
    """Parameters of a SwiGLU FFN (gate, up: D -> F, down: F -> D): 3*D*F (+ 2F + D biases), gated_ffn_params.

    d_ff=None uses swiglu_hidden_dim(d_model, multiple_of) (the 8/3 rule).
    """
    d_model = _positive_int("d_model", d_model)
    d_ff = swiglu_hidden_dim(d_model, multiple_of) if d_ff is None else _positive_int("d_ff", d_ff)
    return gated_ffn_params(d_model, d_ff, bias)
