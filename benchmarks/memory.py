"""Memory and step time at level 1, before and after re-inplacing intermediates.

"Before" is level 1 with `reinplace_intermediates` disabled, "after" is level 1 as it
ships. For each model and batch size the table shows the memory plan of the final
graph (`report().memory`: every intermediate its own buffer against one arena shared
by lifetime, planned at that batch size), the arena of the host graph captured for
that size, and the step time without and with host graphs. Every figure is "before
-> after (after / before)". Variants are timed in interleaved rounds in one process,
so drift on a shared machine hits them alike.

    python benchmarks/memory.py --threads 1
    python benchmarks/memory.py --models decoder --batch-sizes 1,8,32 --rounds 40
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table
from timing import interleaved_times

import graphopt
from graphopt.models import Decoder, DecoderConfig

VARIANTS = ("before", "after")


def decoder_workload() -> tuple[torch.nn.Module, Callable[[int], tuple], dict]:
    model = Decoder(DecoderConfig.tiny()).eval()

    def inputs(batch: int) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(0, model.config.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch))
        return ids, torch.full((batch,), 7), torch.arange(batch)

    return model, inputs, {"pad_values": {"slots": model.scratch_slot}}


def resnet_workload() -> tuple[torch.nn.Module, Callable[[int], tuple], dict] | None:
    try:
        from graphopt.models import ResNet, ResNetConfig
    except ImportError:
        return None
    model = ResNet(ResNetConfig.tiny()).eval()
    return model, lambda batch: (model.example_input(batch),), {}


WORKLOADS = {"decoder": ("reference decoder (tiny), decode step", decoder_workload),
             "resnet": ("ResNet (tiny), 32x32 images", resnet_workload)}


def config(variant: str, **fields) -> graphopt.GraphOptimizationConfig:
    disabled = ["reinplace_intermediates"] if variant == "before" else []
    return graphopt.GraphOptimizationConfig(graph_opt_level=1, disabled_passes=disabled, **fields)


def inplace_count(report) -> int:
    return sum(p.counts.get("inplace", 0) for p in report.passes if p.name == "reinplace_intermediates")


def change(before: float, after: float, scale: float = 1.0, digits: int = 0) -> str:
    ratio = f"{after / before:.2f}x" if before else "-"
    return f"{before / scale:.{digits}f} -> {after / scale:.{digits}f} ({ratio})"


def measure(label: str, workload, batch_sizes: list[int], args) -> list[list[str]]:
    model, inputs, extra = workload
    rows = []
    # The plan describes the graph at the batch it was traced with: one compile per size.
    plans: dict[tuple[str, int], object] = {}
    inplace: dict[tuple[str, int], int] = {}
    for variant in VARIANTS:
        for batch in batch_sizes:
            torch._dynamo.reset()
            opt = graphopt.optimize(model, config(variant, use_cudagraph=False), **extra)
            with torch.inference_mode():
                opt(*inputs(batch))
            plans[variant, batch] = opt.report().memory[-1]
            inplace[variant, batch] = inplace_count(opt.report())
    torch._dynamo.reset()
    steps = {}
    for variant in VARIANTS:
        steps[f"{variant}, level 1"] = graphopt.optimize(model, config(variant, use_cudagraph=False), **extra)
        steps[f"{variant}, host graphs"] = graphopt.optimize(
            model, config(variant, cudagraph_capture_sizes=batch_sizes), **extra)
    times = interleaved_times(steps, batch_sizes, inputs, args.rounds, args.steps)
    arenas = {(v, c.size): c.nbytes for v in VARIANTS for c in steps[f"{v}, host graphs"].report().captures}
    for batch in batch_sizes:
        before, after = plans["before", batch], plans["after", batch]
        best = {name: min(times[name, batch]) for name in steps}
        median = {name: statistics.median(times[name, batch]) for name in steps}
        rows.append([
            label, str(batch), str(inplace["after", batch]),
            change(before.naive_bytes, after.naive_bytes, 1024),
            change(before.planned_bytes, after.planned_bytes, 1024),
            f"{after.planned_bytes / after.naive_bytes:.2f}",
            change(arenas.get(("before", batch), 0), arenas.get(("after", batch), 0), 1024),
            change(best["before, level 1"], best["after, level 1"]),
            f"{median['after, level 1'] / median['before, level 1']:.2f}x",
            change(best["before, host graphs"], best["after, host graphs"]),
            f"{median['after, host graphs'] / median['before, host graphs']:.2f}x",
        ])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="decoder,resnet")
    parser.add_argument("--batch-sizes", default="1,8,16")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=50, help="steps per round")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    rows, skipped = [], []
    for name in args.models.split(","):
        label, make = WORKLOADS[name]
        torch.manual_seed(0)
        workload = make()
        if workload is None:
            skipped.append(f"{name} (graphopt.models has no ResNet)")
            continue
        rows += measure(label, workload, batch_sizes, args)

    table = Table(title="level 1 memory and step time, before -> after reinplace_intermediates",
                  caption=f"torch {torch.__version__} · cpu · {args.threads} thread(s) · {args.rounds} "
                          f"interleaved rounds of {args.steps} steps; KiB are 64-byte aligned buffers at "
                          f"that batch; µs are the best round, ratios also of the medians"
                          + (f" · skipped: {', '.join(skipped)}" if skipped else ""))
    for column in ("model", "batch", "ops in place", "naive KiB", "planned KiB", "planned / naive",
                   "host arena KiB", "level 1 µs", "(median)", "host graphs µs", "(median)"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*row)
    Console(width=250).print(table)


if __name__ == "__main__":
    main()
