"""The timing loop every benchmark shares: variants in interleaved rounds, in one
process, so drift on a shared machine hits them alike."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def interleaved_times(variants: dict[str, Callable], batch_sizes: list[int], inputs: Callable[[int], tuple],
                      rounds: int, steps: int, device: str = "cpu") -> dict[tuple[str, int], list[float]]:
    """µs per step of each variant at each batch size, one figure per round. Every
    variant first runs 4 times at each size (compile, capture, warm up)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times: dict[tuple[str, int], list[float]] = {(v, b): [] for v in variants for b in batch_sizes}
    with torch.inference_mode():
        for step in variants.values():
            for batch in batch_sizes:
                for _ in range(4):
                    step(*inputs(batch))
        for _ in range(rounds):
            for batch in batch_sizes:
                args = inputs(batch)
                for name, step in variants.items():
                    sync()
                    start = time.perf_counter()
                    for _ in range(steps):
                        step(*args)
                    sync()
                    times[name, batch].append((time.perf_counter() - start) / steps * 1e6)
    return times


def median_us(runs: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, float]:
    """Median over interleaved rounds of µs per call of each run (no arguments), each
    run once first; a round is `calls` calls of each."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            for _ in range(calls):
                run()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}
