"""The reference decoder over a mixed stream of batch sizes: eager against each
level, with and without device graphs (host graphs on CPU, CUDA graphs on a GPU).

Every variant decodes the same stream of (batch size, steps) segments. Device
graphs are captured for all capture sizes before timing; the stream is timed in
interleaved rounds (best round counts) so drift hits the variants alike.

    python benchmarks/batch_stream.py --threads 1
    python benchmarks/batch_stream.py --config bench --device cuda     # on a GPU
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

import graphopt
from graphopt.models import Decoder, DecoderConfig


def stream(max_batch: int, segments: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [int(b) for b in torch.randint(1, max_batch + 1, (segments,), generator=generator)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["tiny", "bench"], default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--levels", default="0,1,2")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--segments", type=int, default=12)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per segment")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = getattr(DecoderConfig, args.config)()
    torch.manual_seed(0)
    model = Decoder(config).eval().to(args.device)
    sizes = [b for b in (1, 2, 4, 8, 16, 32) if b <= args.max_batch] or [args.max_batch]
    batches = stream(args.max_batch, args.segments)

    variants: dict[str, torch.nn.Module] = {"eager": model}
    for level in (int(x) for x in args.levels.split(",")):
        for graphs in (False, True):
            cfg = graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=graphs,
                                                   cudagraph_capture_sizes=sizes)
            name = f"level {level}" + (" + device graphs" if graphs else "")
            variants[name] = graphopt.optimize(model, cfg, pad_values={"slots": model.scratch_slot})

    def run(step: torch.nn.Module) -> int:
        tokens = 0
        for batch in batches:
            ids = torch.randint(0, config.vocab_size, (batch,), device=args.device)
            slots = torch.arange(batch, device=args.device)
            for position in range(args.steps):
                step(ids, torch.full((batch,), position, device=args.device), slots)
                tokens += batch
        return tokens

    best = {name: float("inf") for name in variants}
    with torch.inference_mode():
        for name, step in variants.items():
            if getattr(step, "_runner", None) is not None:
                step.capture_all(*(x.to(args.device) for x in (
                    torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                    torch.zeros(1, dtype=torch.long))))
            run(step)  # compile and warm
        for _ in range(args.rounds):
            for name, step in variants.items():
                if args.device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                tokens = run(step)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                best[name] = min(best[name], time.perf_counter() - start)

    table = Table(title=f"mixed batch stream, {args.config} decoder on {args.device}",
                  caption=f"torch {torch.__version__} · {args.threads} thread(s) · batches {batches} "
                          f"× {args.steps} steps · capture sizes {sizes} · best of {args.rounds}")
    for column in ("variant", "tokens/s", "vs eager", "pool MiB", "graphs captured", "fallbacks"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for name, step in variants.items():
        rate = tokens / best[name]
        report = step.report() if name != "eager" else None
        table.add_row(name, f"{rate:,.0f}", f"{best['eager'] / best[name]:.2f}x",
                      f"{report.pool_bytes / 2**20:.2f}" if report else "-",
                      str(len(report.captures)) if report else "-",
                      str(sum(report.fallbacks.values())) if report else "-")
    Console().print(table)


if __name__ == "__main__":
    main()
