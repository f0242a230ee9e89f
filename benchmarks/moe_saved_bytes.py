"""transformers' experts implementations against ffn_ext's ("ffn_ext", ffn_ext/hf/moe.py) on one experts layer:
the bytes autograd keeps for backward, and the CPU time of forward + backward.

    python benchmarks/moe_saved_bytes.py             # the shapes below, 1 thread, 5 blocks of 3 rounds
    python benchmarks/moe_saved_bytes.py --quick     # the smallest shape, 1 block (seconds)

A row: an experts class (Qwen3-MoE: SiLU, concat [gate | up]; GPT-OSS: clamped SwiGLU, interleaved, biases,
transposed weights) at (tokens, hidden, intermediate, experts, top_k), random weights and routing. Saved bytes: the
unique storages autograd saves during one forward (torch.autograd.graph.saved_tensors_hooks), parameters not
counted, with the input and routing weights requiring grad. Time: forward + backward into the input, the routing
weights and every weight, grouped_mm and ffn_ext alternating (ffn_ext._timing.blocked_pair: each side's best run,
and grouped_mm / ffn_ext as the median of the blocks' ratios of their best runs; > 1: ffn_ext faster). nan: batched_mm
not run (its gathered weights past --max-gib).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

import ffn_ext  # noqa: F401
from ffn_ext._timing import blocked_pair
from ffn_ext.hf import moe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SavedTensors  # noqa: E402

IMPLS = ("eager", "grouped_mm", "batched_mm", "ffn_ext")
# (model, tokens, hidden, intermediate, experts, top_k)
SHAPES = [
    ("qwen3_moe", 256, 256, 128, 8, 2),
    ("qwen3_moe", 1024, 512, 256, 16, 4),
    ("qwen3_moe", 2048, 1024, 512, 32, 4),
    ("gpt_oss", 1024, 512, 256, 16, 4),
]


def experts_layer(model: str, hidden: int, inter: int, experts: int, top_k: int):
    import transformers

    if model == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as cls

        config = transformers.Qwen3MoeConfig(
            hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k
        )
    else:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as cls

        config = transformers.GptOssConfig(
            hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=top_k
        )
    layer = cls(config)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05)
    return layer


def inputs(layer, tokens: int, hidden: int, experts: int, top_k: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).requires_grad_()
    index = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=g).softmax(-1).requires_grad_()
    return x, index, weights


def saved_bytes(layer, args) -> int:
    with SavedTensors(exclude=list(layer.parameters())) as saved:
        layer(*args)
    return saved.extra_bytes


def fwd_bwd(layer, impl, args, grad):
    layer.config._experts_implementation = impl
    for t in (*layer.parameters(), args[0], args[2]):
        t.grad = None
    t0 = time.perf_counter()
    layer(*args).backward(grad)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-gib", type=float, default=4.0, help="batched_mm's gathered weights above this: not run")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    assert moe.register(), "transformers with ExpertsInterface is needed"
    shapes, blocks = (SHAPES[:1], 1) if a.quick else (SHAPES, a.blocks)
    print(f"torch {torch.__version__}, {a.threads} thread(s), fp32, saved bytes in MiB per experts layer")
    head = f"{'model':<10} {'T':>5} {'H':>5} {'I':>5} {'E':>3} {'k':>2} | " + " ".join(f"{i:>10}" for i in IMPLS)
    print(head + " | grouped_mm ms  ffn_ext ms  grouped_mm/ffn_ext")
    for model, tokens, hidden, inter, experts, top_k in shapes:
        layer = experts_layer(model, hidden, inter, experts, top_k)
        layer.config._experts_implementation = "eager"
        args = inputs(layer, tokens, hidden, experts, top_k)
        sizes = []
        for impl in IMPLS:
            # batched_mm gathers every row's expert weights, [S, 2I + I, H]: past --max-gib it is not run
            if impl == "batched_mm" and tokens * top_k * 3 * inter * hidden * 4 > a.max_gib * 2**30:
                sizes.append(float("nan"))
                continue
            layer.config._experts_implementation = impl
            sizes.append(saved_bytes(layer, args) / 2**20)
        grad = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
        run = functools.partial(fwd_bwd, layer, args=args, grad=grad)
        t_ref, t_ours, ratio = blocked_pair(lambda k, run=run: run(("grouped_mm", "ffn_ext")[k]), blocks, a.rounds)
        row = f"{model:<10} {tokens:>5} {hidden:>5} {inter:>5} {experts:>3} {top_k:>2} | "
        row += " ".join(f"{s:>10.2f}" for s in sizes)
        print(row + f" | {t_ref * 1e3:>13.1f} {t_ours * 1e3:>11.1f} {1 / ratio:>17.2f}x")


if __name__ == "__main__":
    main()
