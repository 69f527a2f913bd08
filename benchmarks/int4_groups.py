"""How the int4 group size trades error for time: `aten._weight_int4pack_mm_for_cpu` on
DecoderConfig.bench's linear shapes per group size (interleaved rounds, medians), and the
error of the decode step's logits with `weight_quantization="int4"` at each group size
(level 1, 6 batches of 8 random tokens) against eager float32, int8 beside it.

    python benchmarks/int4_groups.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics

import torch
from timing import median_us

import graphopt
from graphopt.models import Decoder, DecoderConfig
from graphopt.passes import quantize

aten = torch.ops.aten
kernel = aten._weight_int4pack_mm_for_cpu
GROUPS = (32, 64, 128, 256)


def packed(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [N, K] as the kernel reads it (the values do not matter for the time)."""
    levels = torch.randint(0, 16, w.shape, dtype=torch.int32)
    pairs = torch.randn(w.shape[1] // group, w.shape[0], 2).bfloat16()
    return aten._convert_weight_to_int4pack_for_cpu(levels, 1), pairs


def kernel_times(model: Decoder, rounds: int) -> None:
    shapes = {name: tuple(m.weight.shape) for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and name.startswith(("layers.0.", "lm_head"))}
    for rows in (1, 8):
        runs = {}
        for name, (n, k) in shapes.items():
            x = torch.randn(rows, k).bfloat16()
            for group in (g for g in GROUPS if k % g == 0):  # else the linear is skipped
                w, pairs = packed(torch.empty(n, k), group)
                runs[f"{name} g{group}"] = lambda x=x, w=w, g=group, p=pairs: kernel(x, w, g, p)
        print(f"{rows} row(s), µs:", {k: round(v) for k, v in median_us(runs, rounds, 5).items()})


def errors(model: Decoder) -> None:
    def step(seed: int):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model.config.vocab_size, (8,), generator=g)
        return ids, torch.randint(0, 64, (8,), generator=g), torch.arange(8)

    for fmt, group in [("int8", None), *(("int4", g) for g in GROUPS)]:
        quantize.INT4_GROUP = group or quantize.INT4_GROUP
        torch._dynamo.reset()
        opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(
            graph_opt_level=1, use_cudagraph=False, freeze_parameters=True, weight_quantization=fmt,
            precision_tolerance=None, cache_dir=None))
        rms, agree = [], []
        with torch.inference_mode():
            for seed in range(6):
                out, ref = opt(*step(seed)).clone(), model(*step(seed))
                rms.append(((out - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item())
                agree.append((out.argmax(-1) == ref.argmax(-1)).float().mean().item())
        counts = {p.name: p.counts for p in opt.report().passes}["quantize_weights"]
        measured = opt.report().graphs[0].precision
        print(f"{fmt} group {group}: logits' relative RMS error {statistics.mean(rms):.3f}, greedy tokens agree "
              f"on {statistics.mean(agree):.0%} of 48; report: relative error {measured['relative_error']:.3f}, tokens "
              f"agree on {measured['token_agreement']:.0%} of {measured['tokens_compared']}; {counts}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Decoder(DecoderConfig.bench()).eval()
    kernel_times(model, args.rounds)
    errors(model)


if __name__ == "__main__":
    main()
