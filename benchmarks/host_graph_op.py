"""What one op of a host graph replay costs, beside what one ATen call costs from Python.

A chain of 200 tiny ops (`add` then `mul` on a [1, 8] tensor, 100 times), run eagerly
and replayed from a host graph (its native C++ tape, and the Python tape it falls
back to), in interleaved rounds; and single calls of the cheapest ways to run one
such op from Python. A Python replay cannot be cheaper per op than the call it makes
(`torch.add(x, 1.0, out=y)`); the native tape makes the same call without Python.

    python benchmarks/host_graph_op.py
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

from graphopt.runtime import native_tape
from graphopt.runtime.host_graph import HostGraph

OPS = 200


def chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(OPS // 2):
        x = torch.mul(torch.add(x, 1.0), 0.5)
    return x


def best_us(runs: dict[str, tuple[Callable[[], object], int]], rounds: int = 20, calls: int = 50) -> dict[str, float]:
    """Best round of each run, in µs per op; every round runs each in turn."""
    best = {name: float("inf") for name in runs}
    for _ in range(rounds):
        for name, (run, ops) in runs.items():
            start = time.perf_counter()
            for _ in range(calls):
                run()
            best[name] = min(best[name], (time.perf_counter() - start) / calls / ops * 1e6)
    return best


def main() -> None:
    torch.set_num_threads(1)
    x, y = torch.randn(1, 8), torch.empty(1, 8)
    graphs = {"native": HostGraph(native=True), "Python": HostGraph(native=False)}
    with torch.inference_mode():
        chain(x)
        outs = {}
        for name, graph in graphs.items():
            graph.capture_begin()
            outs[name] = chain(x)
            graph.capture_end([outs[name]])
        times = best_us({
            "eager chain": (lambda: chain(x), OPS),
            **{f"host graph replay of the chain, {name} tape": (graph.replay, OPS) for name, graph in graphs.items()},
            "torch.add(x, 1.0, out=y)": (lambda: torch.add(x, 1.0, out=y), 1),
            "torch.add(x, 1.0)": (lambda: torch.add(x, 1.0), 1),
            "torch.ops.aten.add.out(x, 1.0, out=y)": (lambda: torch.ops.aten.add.out(x, 1.0, out=y), 1),
        })
    for name, graph in graphs.items():
        graph.replay()
        assert torch.equal(outs[name], chain(x)), f"the {name} tape's replay differs from eager"
    if not graphs["native"].replays_natively:
        print(f"no native tape here: {native_tape.unavailable()}")
    table = Table(title=f"µs per op: a host graph replay of {OPS} tiny ops, and single ATen calls from Python",
                  caption=f"torch {torch.__version__} · 1 thread · best of 20 interleaved rounds · "
                          f"{graphs['native'].copy_replays} replays that allocate")
    table.add_column("what runs")
    table.add_column("µs per op", justify="right")
    for name, us in times.items():
        table.add_row(name, f"{us:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
