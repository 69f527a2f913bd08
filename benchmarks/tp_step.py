"""The tensor-parallel decode step: the reference decoder on 2 ranks beside 1 rank.

Launch with torchrun, one process per rank (gloo on the CPU, NCCL on CUDA):

    torchrun --nproc-per-node 2 benchmarks/tp_step.py --threads 1
    torchrun --nproc-per-node 2 benchmarks/tp_step.py --config bench --device cuda   # on 2 GPUs

Rank 0 first times the single-device Decoder alone (the other ranks wait at a
barrier), then every rank times its shard of the same weights (ParallelDecoder), the
variants in interleaved rounds in lockstep (each step all-reduces). Rank 0 prints
the best round's µs per step.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from timing import interleaved_times

import graphopt
from graphopt.models import Decoder, DecoderConfig, ParallelDecoder


def step_inputs(config: DecoderConfig, batch: int, device: str) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(0, config.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch))
    return tuple(x.to(device) for x in (ids, torch.full((batch,), 7), torch.arange(batch)))


def variants(model: Decoder, levels: list[int], graph_levels: list[int], sizes: list[int]) -> dict:
    found = {"eager": model}
    for level in levels:
        found[f"level {level}"] = graphopt.optimize(
            model, graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=False))
    for level in graph_levels:
        found[f"level {level} + device graphs"] = graphopt.optimize(
            model, graphopt.GraphOptimizationConfig(graph_opt_level=level, cudagraph_capture_sizes=sizes),
            pad_values={"slots": model.scratch_slot})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--config", choices=["tiny", "bench"], default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--levels", default="1", help="levels to time without device graphs")
    parser.add_argument("--device-graphs", default="1", help="levels to time with device graphs")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30, help="steps per round")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = args.device
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    levels = [int(x) for x in args.levels.split(",") if x]
    graph_levels = [int(x) for x in args.device_graphs.split(",") if x]
    config = getattr(DecoderConfig, args.config)()
    torch.manual_seed(0)
    full = Decoder(config).eval()

    def inputs(batch: int) -> tuple[torch.Tensor, ...]:
        return step_inputs(config, batch, device)

    one = None
    if rank == 0:
        one = interleaved_times(variants(full.to(device), levels, graph_levels, sizes), sizes, inputs,
                                args.rounds, args.steps, device)
    dist.barrier()
    sharded = ParallelDecoder.from_decoder(full.cpu()).to(device)
    many = interleaved_times(variants(sharded, levels, graph_levels, sizes), sizes, inputs,
                             args.rounds, args.steps, device)
    if rank == 0:
        table = Table(title=f"decode step, {args.config} reference decoder, 1 rank and {world} ranks",
                      caption=f"torch {torch.__version__} · {device} · {args.threads} thread(s) per rank · best "
                              f"of {args.rounds} interleaved rounds of {args.steps} steps (median in brackets)")
        for column in ("batch", "variant", "1 rank µs", f"{world} ranks µs", f"{world} ranks ÷ 1 rank"):
            table.add_column(column, justify="right")
        for batch in sizes:
            for name in dict.fromkeys(key for key, _ in one):
                a, b = one[name, batch], many[name, batch]
                table.add_row(str(batch), name, f"{min(a):.0f} ({statistics.median(a):.0f})",
                              f"{min(b):.0f} ({statistics.median(b):.0f})", f"{min(b) / min(a):.2f}x")
        Console().print(table)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
