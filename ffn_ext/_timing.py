"""Two sides timed against each other on a shared, noisy machine: the main job's comparisons (ffn_ext.__main__)
and benchmarks/bench_cpu.py use the one loop below."""

from __future__ import annotations

import statistics
from collections.abc import Callable


def blocked_pair(time_one: Callable[[int], float], blocks: int, rounds: int) -> tuple[float, float, float]:
    """(best of side 0, best of side 1, ratio side 1 / side 0) over `blocks` blocks of `rounds` rounds; time_one(k)
    runs side k once and returns its time.

    Within a round the two sides alternate (so that a busy spell of a shared machine hits them alike), in reverse
    order every other round: on the CPU the first of a round ran slower. The times are each side's minimum over all
    rounds; the ratio is the median over blocks of the ratio of the blocks' minima: a single minimum of two identical
    callables on a shared machine often strays from 1.0x (a spell that spares one side's best run spoils the whole
    figure), a median over blocks rarely (figures: docs/performance.md#timing-on-a-shared-cpu)."""
    best = [float("inf")] * 2
    ratios = []
    for _ in range(blocks):
        block = [float("inf")] * 2
        for r in range(rounds):
            for k in (0, 1) if r % 2 == 0 else (1, 0):
                block[k] = min(block[k], time_one(k))
        best = [min(b, c) for b, c in zip(best, block)]
        ratios.append(block[1] / block[0])
    return best[0], best[1], statistics.median(ratios)
