"""The ResNet-like reference CNN (or torchvision's ResNet-18 layout): NCHW against the
channels-last layout pass.

Each level-1 variant runs once with `convert_layout` disabled (the graph stays NCHW)
and once with it; with and without frozen parameters (frozen weights are converted
once at optimize time, live ones by an op in every step) and with and without host
graphs. Variants are timed in interleaved rounds in one process, so drift on a
shared machine hits them alike; the table shows, per step, the best round and the
median, the speed-up over eager, and the layout pass's speed-up over the same
variant in NCHW (medians).

    python benchmarks/layout.py --threads 1
    python benchmarks/layout.py --batch-sizes 1,8,32 --freeze 1 --device-graphs 0
    python benchmarks/layout.py --model resnet18 --threads 1 --rounds 8 --steps 3
"""

from __future__ import annotations

import argparse
import statistics

import torch
from rich.console import Console
from rich.table import Table
from timing import interleaved_times

import graphopt
from graphopt.bench.vision import ResNet18
from graphopt.models import ResNet, ResNetConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "resnet18"], default="tiny",
                        help="the reference ResNet's tiny config, or ResNet-18 on 3x112x112 images")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--freeze", default="0,1", help="freeze_parameters values to run, e.g. 0,1")
    parser.add_argument("--device-graphs", default="0,1", help="use_cudagraph values to run (host graphs on CPU)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    if args.model == "tiny":
        model = ResNet(ResNetConfig.tiny(dtype=dtype)).to(args.device)
        example, title = model.example_input, "ResNet-like tiny CNN"
    else:
        model = ResNet18().eval().to(args.device, dtype)
        example, title = (lambda b: torch.randn(b, 3, 112, 112, dtype=dtype)), "ResNet-18 at 112x112"

    variants: dict[str, torch.nn.Module] = {"eager": model}
    pairs: dict[str, str] = {}  # layout variant -> the same variant in NCHW
    for freeze in (bool(int(x)) for x in args.freeze.split(",") if x):
        for graphs in (bool(int(x)) for x in args.device_graphs.split(",") if x):
            name = "level 1" + (" + host graphs" if graphs else "") + (", frozen" if freeze else "")
            for layout in (False, True):
                config = graphopt.GraphOptimizationConfig(
                    graph_opt_level=1, use_cudagraph=graphs, cudagraph_capture_sizes=batch_sizes,
                    freeze_parameters=freeze, disabled_passes=[] if layout else ["convert_layout"])
                variants[f"{name}, {'NHWC pass' if layout else 'NCHW'}"] = graphopt.optimize(model, config)
            pairs[f"{name}, NHWC pass"] = f"{name}, NCHW"

    inputs = {b: example(b).to(args.device) for b in batch_sizes}
    times = interleaved_times(variants, batch_sizes, lambda b: (inputs[b],), args.rounds, args.steps, args.device)

    table = Table(title=f"{title} ({args.dtype}), NCHW vs the channels-last layout pass",
                  caption=f"torch {torch.__version__} · {args.device} · {args.threads} thread(s) · "
                          f"{args.rounds} interleaved rounds of {args.steps} steps")
    for column in ("batch", "variant", "best µs", "median µs", "vs eager (median)", "NHWC pass vs NCHW (median)"):
        table.add_column(column, justify="right")
    for batch in batch_sizes:
        eager = statistics.median(times["eager", batch])
        for name in variants:
            ours = times[name, batch]
            base = pairs.get(name)
            layout = f"{statistics.median(times[base, batch]) / statistics.median(ours):.2f}x" if base else ""
            table.add_row(str(batch), name, f"{min(ours):.0f}", f"{statistics.median(ours):.0f}",
                          f"{eager / statistics.median(ours):.2f}x", layout)
    Console().print(table)


if __name__ == "__main__":
    main()
