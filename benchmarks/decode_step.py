"""The reference decoder's decode step: eager against each graph_opt_level.

Each level is compiled once and serves every batch size. Variants are timed in
interleaved rounds in one process, so drift on a shared machine hits them alike;
the table shows the best round (steady state) and the median, per step.

    python benchmarks/decode_step.py --batch-sizes 1,8,16 --threads 1
    python benchmarks/decode_step.py --device cuda --device-graphs 0,1 --levels 1,2   # on a GPU
"""

from __future__ import annotations

import argparse
import statistics

import torch
from rich.console import Console
from rich.table import Table
from timing import interleaved_times

import graphopt
from graphopt.models import Decoder, DecoderConfig


def step_inputs(config: DecoderConfig, batch: int, device: str) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(0, config.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch))
    return tuple(x.to(device) for x in (ids, torch.full((batch,), 7), torch.arange(batch)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8,16")
    parser.add_argument("--config", choices=["tiny", "bench"], default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--levels", default="1,2")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=50, help="steps per round")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device-graphs", default="1",
                        help="levels to also run with device graphs (host graphs on CPU), e.g. 0,1")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    config = getattr(DecoderConfig, args.config)()
    torch.manual_seed(0)
    model = Decoder(config).eval().to(args.device)

    variants = {"eager": model}
    for level in (int(x) for x in args.levels.split(",")):
        variants[f"level {level}"] = graphopt.optimize(
            model, graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=False))
    for level in (int(x) for x in args.device_graphs.split(",") if x):
        variants[f"level {level} + device graphs"] = graphopt.optimize(
            model, graphopt.GraphOptimizationConfig(graph_opt_level=level, cudagraph_capture_sizes=batch_sizes),
            pad_values={"slots": model.scratch_slot})
    times = interleaved_times(variants, batch_sizes, lambda b: step_inputs(config, b, args.device),
                              args.rounds, args.steps, args.device)

    table = Table(title=f"decode step, {args.config} reference decoder",
                  caption=f"torch {torch.__version__} · {args.device} · {args.threads} thread(s) · "
                          f"{args.rounds} interleaved rounds of {args.steps} steps")
    for column in ("batch", "variant", "best µs", "median µs", "speed-up (best)", "speed-up (median)"):
        table.add_column(column, justify="right")
    for batch in batch_sizes:
        eager = times["eager", batch]
        for name in variants:
            ours = times[name, batch]
            table.add_row(str(batch), name, f"{min(ours):.0f}", f"{statistics.median(ours):.0f}",
                          f"{min(eager) / min(ours):.2f}x",
                          f"{statistics.median(eager) / statistics.median(ours):.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
