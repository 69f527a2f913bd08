"""Where a decode step's GPU time goes: the 1.1B decoder in bfloat16 at one level,
without device graphs, under torch's profiler (CUDA kernels), at a few batch sizes.

Prints, per batch: the step's wall time, its summed kernel time, the kernel count,
and the kernels that take the most time. Against the HBM floor (weight bytes /
bandwidth) this says whether a replayed step is bound by its GEMMs, by its other
kernels, or by the gaps between kernels.

    python benchmarks/cuda_kernels.py --level 2 --batches 1,32 [--frozen]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import graphopt
from graphopt.models import Decoder, DecoderConfig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--level", type=int, default=2, choices=[0, 1, 2])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--config", default="billion", choices=["tiny", "bench", "billion"])
    parser.add_argument("--rows", type=int, default=18, help="kernels to list per batch")
    parser.add_argument("--frozen", action="store_true", help="freeze_parameters=True (fused Q/K/V and gate/up)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cuda_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    config = getattr(DecoderConfig, args.config)(dtype=torch.bfloat16)
    with torch.device("cuda"):
        model = Decoder(config).eval()
    options = graphopt.GraphOptimizationConfig(graph_opt_level=args.level, use_cudagraph=False,
                                               freeze_parameters=args.frozen)
    step = graphopt.optimize(model, options) if args.level else model
    for batch in (int(b) for b in args.batches.split(",")):
        inputs = (torch.randint(0, config.vocab_size, (batch,), device="cuda"),
                  torch.full((batch,), 7, device="cuda"), torch.arange(batch, device="cuda"))
        with torch.inference_mode():
            for _ in range(3):
                step(*inputs)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(10):
                step(*inputs)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / 10
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step(*inputs)
                torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / 5
        print(f"\n== level {args.level}, batch {batch}: {wall * 1e6:.0f} us a step (no device graph), "
              f"{busy:.0f} us of kernels, {len(kernels) / 5:.0f} kernels a step", flush=True)
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=args.rows, max_name_column_width=70),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
