"""What keeping a held output costs on the reference decoder's decode step.

A replay overwrites the device graph's memory, so an output of the last replay
that the caller still holds is copied out first (docs/device-graphs.md, Outputs).
Three loops over one optimized step (level 1, device graphs), timed in interleaved
rounds: the output let go before the next call (no copy), the output kept until the
next call returns (`logits = step(...)` in a loop: one copy per step), and
`clone_output=True` (a copy of every output on every call).

    python benchmarks/held_outputs.py --batch-sizes 1,8 --threads 1
    python benchmarks/held_outputs.py --config bench --device cuda
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

import torch
from rich.console import Console
from rich.table import Table
from timing import interleaved_times

import graphopt
from graphopt.models import Decoder, DecoderConfig


class LetGo:
    """Calls the step and drops its output at once."""

    def __init__(self, step: Callable):
        self.step = step

    def __call__(self, *args: Any) -> None:
        self.step(*args)


class Keep:
    """Calls the step while the previous output is still held, as `logits = step(...)` does."""

    def __init__(self, step: Callable):
        self.step, self.last = step, None

    def __call__(self, *args: Any) -> None:
        self.last = self.step(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--config", choices=["tiny", "bench"], default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=50, help="steps per round")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    config = getattr(DecoderConfig, args.config)()
    torch.manual_seed(0)
    model = Decoder(config).eval().to(args.device)

    def optimized(clone_output: bool) -> Callable:
        cfg = graphopt.GraphOptimizationConfig(graph_opt_level=1, cudagraph_capture_sizes=batch_sizes,
                                               clone_output=clone_output, cache_dir=None)
        return graphopt.optimize(model, cfg, pad_values={"slots": model.scratch_slot})

    shared = optimized(False)
    keep = Keep(shared)
    variants = {"let go (no copy)": LetGo(shared), "kept (copied out)": keep,
                "clone_output=True": LetGo(optimized(True))}

    def inputs(batch: int) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(0, config.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch))
        return tuple(x.to(args.device) for x in (ids, torch.full((batch,), 7), torch.arange(batch)))

    times = interleaved_times(variants, batch_sizes, inputs, args.rounds, args.steps, args.device)
    table = Table(title=f"decode step, {args.config} reference decoder, level 1 + device graphs",
                  caption=f"torch {torch.__version__} · {args.device} · {args.threads} thread(s) · "
                          f"{args.rounds} interleaved rounds of {args.steps} steps · "
                          f"{shared.report().held_copies} held outputs copied out")
    for column in ("batch", "loop", "median µs", "best µs", "median over let go"):
        table.add_column(column, justify="right")
    for batch in batch_sizes:
        base = statistics.median(times["let go (no copy)", batch])
        for name in variants:
            ours = times[name, batch]
            table.add_row(str(batch), name, f"{statistics.median(ours):.1f}", f"{min(ours):.1f}",
                          f"{statistics.median(ours) - base:+.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
