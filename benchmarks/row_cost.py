"""What a padded row costs: the decoder's decode step at each batch size, replayed from
a host graph captured at that size, so padding a batch of `b` to a capture size `s`
costs `time(s) - time(b)`.

This is what `cudagraph_capture_sizes="auto"` saves over the default capture list, and
what it cannot save where a step costs the same at any batch (the weights are read
once whatever the rows). Sizes in interleaved rounds (`timing.interleaved_times`),
median per size.

    python benchmarks/row_cost.py --threads 1
    python benchmarks/row_cost.py --threads 1 --sizes 3,4,8,9,16 --rounds 9 --steps 40
"""

from __future__ import annotations

import argparse
import statistics

import torch
from rich.console import Console
from rich.table import Table
from timing import interleaved_times

import graphopt
from graphopt.bench.serving import MAX_NUM_SEQS, POSITIONS
from graphopt.models import Decoder, DecoderConfig

SIZES = "3,4,5,6,8,9,11,13,16,17,20,24,26,32"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["tiny", "small", "bench"], default="small")
    parser.add_argument("--sizes", default=SIZES, help=f"batch sizes, comma-separated (default {SIZES})")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=40, help="calls per size per round")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    config = getattr(DecoderConfig, args.config)(max_num_seqs=MAX_NUM_SEQS, max_seq_len=POSITIONS)
    step = graphopt.optimize(Decoder(config).eval(), graphopt.GraphOptimizationConfig(
        graph_opt_level=1, max_num_seqs=MAX_NUM_SEQS, cudagraph_capture_sizes=sizes, cache_dir=None))
    times = interleaved_times({"step": step}, sizes,
                              lambda b: (torch.randint(0, config.vocab_size, (b,)), torch.full((b,), 3),
                                         torch.arange(b)), args.rounds, args.steps)
    _print({b: statistics.median(times["step", b]) for b in sizes}, step.report(), args)


def _print(median: dict[int, float], report: graphopt.Report, args: argparse.Namespace) -> None:
    table = Table(title=f"decode step per batch size: decoder {args.config}, level 1 + host graphs, "
                        f"{args.threads} thread(s), median of {args.rounds} rounds")
    table.add_column("batch", justify="right")
    table.add_column("µs per step", justify="right")
    table.add_column("µs per row over the size below", justify="right")
    previous = None
    for b, us in median.items():
        per_row = "" if previous is None else f"{(us - median[previous]) / (b - previous):+.0f}"
        table.add_row(str(b), f"{us:.0f}", per_row)
        previous = b
    console = Console(width=120)
    console.print(table)
    console.print(f"steps replayed: {report.steps_replayed} of {report.steps}")


if __name__ == "__main__":
    main()
