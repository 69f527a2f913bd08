"""What graphopt's layers above the compiled graph cost per call, beside torch.compile's.

A tiny step (`x * 2 + 1` on an [n, 8] tensor: a few microseconds of work) called
through each way in, in interleaved rounds, best round per variant, µs per call:
eager, `torch.compile` (default, `mode="reduce-overhead"`, which on the CPU adds
nothing, and `dynamic=True`: graphopt marks the batch dynamic from the first call,
where torch.compile's default specialises on it until a second size comes), and
graphopt's `optimize()` at levels 1 and 2, without device graphs and with host
graphs (level 1), with and without the compile cache (stored traces run the step
without Dynamo's own dispatch; level 1 with host graphs and the cache is
graphopt's default config). Each variant's overhead is its time minus eager's;
the last column is that overhead against `torch.compile`'s. Below the table, the
Python frames a replayed call of each host-graph variant nests from the module call
down to the replay.

    python benchmarks/step_overhead.py
    python benchmarks/step_overhead.py --rows 1 --rounds 30
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

import graphopt


class Tiny(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


def variants(cache_dir: str) -> dict[str, Callable]:
    def opt(level: int, graphs: bool, cached: bool) -> Callable:
        config = graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=graphs,
                                                  cudagraph_capture_sizes=[1, 2, 4, 8],
                                                  cache_dir=cache_dir if cached else None)
        return graphopt.optimize(Tiny(), config)

    return {
        "eager": Tiny(),
        "torch.compile": torch.compile(Tiny()),
        "torch.compile reduce-overhead": torch.compile(Tiny(), mode="reduce-overhead"),
        "torch.compile dynamic=True": torch.compile(Tiny(), dynamic=True),
        "graphopt L1": opt(1, False, False),
        "graphopt L1, stored traces": opt(1, False, True),
        "graphopt L1 + host graphs": opt(1, True, False),
        "graphopt L1 + host graphs, stored traces": opt(1, True, True),
        "graphopt L2": opt(2, False, False),
        "graphopt L2, stored traces": opt(2, False, True),
    }


def best_us(steps: dict[str, Callable], x: torch.Tensor, rounds: int, calls: int) -> dict[str, float]:
    best = {name: float("inf") for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(calls):
                step(x)
            best[name] = min(best[name], (time.perf_counter() - start) / calls * 1e6)
    return best


def replay_frames(step: Callable, x: torch.Tensor) -> list[str]:
    """The Python frames open when one call of `step` replays its device graph (a
    C function named "replay"), outermost first."""
    stack: list[str] = []
    found: list[str] = []

    def profile(frame, event, arg) -> None:
        if event == "call":
            stack.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")
        elif event == "return" and stack:
            stack.pop()
        elif event == "c_call" and getattr(arg, "__name__", "") == "replay" and not found:
            found.extend(stack)

    sys.setprofile(profile)
    try:
        step(x)
    finally:
        sys.setprofile(None)
    return found[found.index("module.py:_wrapped_call_impl"):] if "module.py:_wrapped_call_impl" in found else found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(args.rows, 8)
    with tempfile.TemporaryDirectory() as cache_dir, torch.inference_mode():
        steps = variants(cache_dir)
        for name, step in steps.items():  # compile, warm up, capture; every output checked
            for _ in range(4):
                torch.testing.assert_close(step(x), x * 2 + 1, msg=name)
        times = best_us(steps, x, args.rounds, args.calls)
        frames = {name: replay_frames(step, x) for name, step in steps.items() if "host graphs" in name}
    table = Table(title=f"One call of a tiny step ([{args.rows}, 8]), µs, best of {args.rounds} rounds, 1 thread")
    for column in ("variant", "µs per call", "overhead over eager", "overhead / torch.compile's"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    compile_overhead = times["torch.compile"] - times["eager"]
    for name, us in times.items():
        overhead = us - times["eager"]
        ratio = f"{overhead / compile_overhead:.2f}x" if name != "eager" and compile_overhead > 0 else ""
        table.add_row(name, f"{us:.1f}", f"{overhead:.1f}" if name != "eager" else "", ratio)
    Console().print(table)
    for name, chain in frames.items():
        print(f"{name}: {len(chain)} Python frames from the module call to the replay:\n  " + " > ".join(chain))


if __name__ == "__main__":
    main()
