"""A patched Hugging Face model under DeepSpeed ZeRO-3, 2 CPU ranks (DS_ACCELERATOR=cpu, gloo): patched before
deepspeed.initialize, built under deepspeed.zero.Init, and transformers' Trainer with a ZeRO-3 config and
from_pretrained (benchmarks/train_distributed.py's zero3 modes, each against the same run unpatched): every gated MLP
patched, ffn_ext's ops run in every step, losses and gathered final weights within 1e-5 of the unpatched run's.

CI has no deepspeed (it would cost CI minutes): `bash .ci/zero3` installs it into a venv and runs this file."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import tempfile
import traceback
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (bash .ci/zero3 installs it and runs this file)", allow_module_level=True)

WORLD = 2
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "train_distributed.py"
# (what each run passes to patch_hf_model): the defaults, and the lean autograd's options
OPTIONS = {"default": {}, "recompute": {"recompute": True}, "token_chunk": {"token_chunk": 48}}


def _bench():
    spec = importlib.util.spec_from_file_location("_train_distributed", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _worker(rank: int, port: int, out: str, model: str, options: str) -> None:
    os.environ.update(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
    )
    torch.set_num_threads(1)
    try:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        bench = _bench()
        path = os.path.join(out, "model")
        if rank == 0:
            bench.save_tiny(bench.parser().parse_args(["--quick", "--model", model]), bench.SIZES["quick"], path)
        torch.distributed.barrier()
        failures, rows = bench.zero3_check(opts=OPTIONS[options], path=path, model=model, steps=3)
    except Exception:
        failures, rows = [traceback.format_exc()], {}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"failures": failures, "rows": rows}, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "model,options", [("llama", "default"), ("llama", "recompute"), ("llama", "token_chunk"), ("qwen3_moe", "default")]
)
def test_zero3_patched_runs_fused_and_equals_unpatched(model, options):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _worker, args=(_free_port(), out, model, options), nprocs=WORLD, join=True, start_method="spawn"
        )
        results = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    failures = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["failures"]]
    for mode, row in results[0]["rows"].items():  # the op counts, in the test's output (pytest -rP)
        print(
            f"{model} {options} {mode}: patched {row['patched']}, ops {row['op_counts']}, loss diff "
            f"{row['loss_max_diff']:.2e}, weights diff {row['weights_max_diff']:.2e}"
        )
    assert not failures, "\n".join(failures)
