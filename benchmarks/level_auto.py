"""graph_opt_level="auto" against graphopt's default (level 1), level 2 and torch.compile's
default, on models graphopt was not built on: transformers' BERT and GPT-2, a stack of
MLP blocks, graphopt's ResNet at ResNet-18's widths. Each model in a process of its own,
random weights, interleaved rounds, medians; the first call's seconds of each, and what
auto chose per graph.

    OMP_NUM_THREADS=1 python benchmarks/level_auto.py
    python benchmarks/level_auto.py --models bert resnet --batches 1 8
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import interleaved_times  # noqa: E402

import graphopt  # noqa: E402

MODELS = ("bert", "gpt2", "mlp", "resnet")


class LastHidden(torch.nn.Module):
    """A transformers encoder or decoder as a function of token ids."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).last_hidden_state


def build(name: str):
    """(model, inputs(batch)) with random weights."""
    torch.manual_seed(0)
    if name == "resnet":
        from graphopt.models import ResNet, ResNetConfig

        config = ResNetConfig(image_size=112, in_channels=3, stem_channels=64, stage_channels=(64, 128, 256, 512),
                              blocks_per_stage=2, num_classes=1000)
        return ResNet(config).eval(), lambda b: (torch.randn(b, 3, 112, 112),)
    if name == "mlp":
        blocks = [torch.nn.Sequential(torch.nn.LayerNorm(512), torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                      torch.nn.Linear(2048, 512)) for _ in range(4)]
        return torch.nn.Sequential(*blocks).eval(), lambda b: (torch.randn(b, 16, 512),)
    import transformers

    if name == "bert":
        model = transformers.BertModel(transformers.BertConfig(hidden_size=256, num_hidden_layers=4,
                                                               num_attention_heads=4, intermediate_size=1024))
    else:
        model = transformers.GPT2Model(transformers.GPT2Config(n_embd=256, n_layer=4, n_head=4))
    return LastHidden(model).eval(), lambda b: (torch.randint(0, 1000, (b, 64)),)


def run_one(name: str, batches: list[int], rounds: int) -> None:
    torch._dynamo.config.cache_size_limit = 64
    model, inputs = build(name)
    base = graphopt.GraphOptimizationConfig(cache_dir=None, cudagraph_capture_sizes=batches)
    variants = {"torch.compile": torch.compile(model), "default (L1)": graphopt.optimize(model, base),
                "auto": graphopt.optimize(model, base.replace(graph_opt_level="auto")),
                "L2": graphopt.optimize(model, base.replace(graph_opt_level=2))}
    first = {}
    with torch.inference_mode():
        args = inputs(batches[0])
        expected = model(*args)
        for label, step in variants.items():
            start = time.perf_counter()
            out = step(*args)
            first[label] = time.perf_counter() - start
            torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4, msg=lambda m: f"{label}: {m}")
        graphopt.wait_for_background()  # level 2's code is in: each graph's next call chooses
        for batch in batches:
            variants["auto"](*inputs(batch))
    times = interleaved_times(variants, batches, inputs, rounds, steps=5)
    for batch in batches:
        compiled = statistics.median(times["torch.compile", batch])
        medians = {label: statistics.median(times[label, batch]) for label in variants}
        row = [f"{medians[label]:.0f} ({compiled / medians[label]:.2f}x)" for label in variants]
        print(f"| {name} | {batch} | " + " | ".join(row) + " |", flush=True)
    chosen = [(c["graph"], c.get("level"), c.get("reason")) for c in variants["auto"].report().level_choices]
    print(f"<!-- {name}: first call s {({k: round(v, 1) for k, v in first.items()})}; auto chose {chosen} -->")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one model
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        run_one(args.models[0], args.batches, args.rounds)
        return
    print("µs per call, median of interleaved rounds (speed against torch.compile's default)\n")
    print("| model | batch | torch.compile | default (L1) | auto | L2 |")
    print("| --- | --- | --- | --- | --- | --- |", flush=True)
    for name in args.models:
        subprocess.run([sys.executable, __file__, "--one", "--models", name, "--batches", *map(str, args.batches),
                        "--rounds", str(args.rounds), "--threads", str(args.threads)], check=True)


if __name__ == "__main__":
    main()
