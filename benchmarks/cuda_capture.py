"""Capture cost on a GPU: 35 capture sizes of a ~1.1B-parameter decoder in bfloat16.

Compiles the decode step once, then `capture_all()` captures every size into one
graph pool (largest first, so the smaller graphs reuse its blocks), and prints:
seconds to capture all sizes, the pool's bytes against a pool holding the largest
graph alone (a fresh process), and each size's logits against eager's, at the
capture sizes and at padded sizes between them.

    python benchmarks/cuda_capture.py --level 1          # vLLM's 35 sizes: 1, 2, 4, 8 ... 256
    python benchmarks/cuda_capture.py --level 2 --json out.json
    python benchmarks/cuda_capture.py --largest-only     # the single-graph pool, for the ratio
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import sys
import time

import torch

import graphopt
from graphopt.models import Decoder, DecoderConfig

SIZES = [1, 2, 4] + list(range(8, 257, 8))  # vLLM's default capture sizes: 35 of them
PADDED = [3, 5, 13, 100, 250]


def build(config_name: str) -> tuple[Decoder, DecoderConfig]:
    torch.manual_seed(0)
    config = getattr(DecoderConfig, config_name)(dtype=torch.bfloat16)
    with torch.device("cuda"):
        model = Decoder(config).eval()
    return model, config


def inputs(config: DecoderConfig, batch: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, config.vocab_size, (batch,), generator=generator)
    return ids.cuda(), torch.full((batch,), 7, device="cuda"), torch.arange(batch, device="cuda")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--level", type=int, default=1, choices=[0, 1, 2])
    parser.add_argument("--config", default="billion", choices=["tiny", "small", "bench", "billion"])
    parser.add_argument("--largest-only", action="store_true", help="capture the largest size alone")
    parser.add_argument("--sizes", default=None, help="comma-separated capture sizes instead of vLLM's 35")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--profile", action="store_true", help="print where capture_all() spends its time")
    parser.add_argument("--warmups", type=int, default=None, help="cudagraph_num_of_warmups (default: the config's)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cuda_capture.py needs a CUDA GPU", file=sys.stderr)
        return 2
    model, config = build(args.config)
    sizes = [int(n) for n in args.sizes.split(",")] if args.sizes else SIZES
    sizes = sizes[-1:] if args.largest_only else sizes
    options = graphopt.GraphOptimizationConfig(graph_opt_level=args.level, use_cudagraph=True,
                                               cudagraph_capture_sizes=sizes, max_num_seqs=max(sizes),
                                               **({} if args.warmups is None else
                                                  {"cudagraph_num_of_warmups": args.warmups}))
    start = time.perf_counter()
    opt = graphopt.optimize(model, options, pad_values={"slots": model.scratch_slot})
    with torch.no_grad():
        opt(*inputs(config, 8))  # the compile
    torch.cuda.synchronize()
    compiled = time.perf_counter()
    reserved = torch.cuda.memory_reserved()
    print(f"compiled: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated", flush=True)
    profile = cProfile.Profile() if args.profile else contextlib.nullcontext()
    try:
        with torch.no_grad(), profile:  # a step that records autograd is not captured
            opt.capture_all(*inputs(config, 8))
    except torch.OutOfMemoryError:
        # Where the memory went, for the next run to read: live blocks by size, largest first.
        print(torch.cuda.memory_summary(abbreviated=True), flush=True)
        print([(c.size, round(c.nbytes / 2**20)) for c in opt.report().captures], flush=True)
        raise
    torch.cuda.synchronize()
    captured = time.perf_counter()
    grown = torch.cuda.memory_reserved() - reserved
    if args.profile:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(35)
    print(f"captured: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated", flush=True)
    report = opt.report()
    worst, agree, rows = 0.0, 0, 0
    batches = sorted({*sizes[:6], *sizes[-2:], *(p for p in PADDED if p < sizes[-1])})
    for batch in ([] if args.largest_only else batches):
        step = inputs(config, batch)
        with torch.no_grad():
            expected = model(*step).float()
            got = opt(*step).float()
        worst = max(worst, (got - expected).abs().max().item())
        agree += int((got.argmax(-1) == expected.argmax(-1)).sum())
        rows += batch
    figures = {
        "level": args.level, "config": args.config, "sizes": len(sizes), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "warmups": options.cudagraph_num_of_warmups,
        "compile_s": round(compiled - start, 2),
        "capture_all_s": round(captured - compiled, 2), "captures": len(report.captures),
        "pool_mib": round(report.pool_bytes / 2**20, 1),
        "largest_graph_mib": round(max((c.nbytes for c in report.captures), default=0) / 2**20, 1),
        "reserved_growth_mib": round(grown / 2**20, 1),  # pool and output blocks: what the captures took
        "max_abs_logit_diff": round(worst, 4), "argmax_agree": f"{agree}/{rows}",
        "fallbacks": report.fallbacks,
        "per_size": [(c.size, round(c.nbytes / 2**20, 1), round(c.seconds, 3)) for c in report.captures],
    }
    print(json.dumps(figures, indent=1))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
