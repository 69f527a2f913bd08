"""float32 against `compute_dtype="bfloat16"` (and `weight_quantization="int8"` / `"int4"`) on a BERT
encoder, a ResNet-18 and the reference decoder's decode step, at level 1 (live and frozen
weights, frozen with host graphs) and level 2 frozen, batch 1 and 8.

Every variant is timed in one process, interleaved round by round; the table shows
the median µs per step, the speed-up of bfloat16 over the same variant in float32,
the error graphopt measured at compile time (`report().graphs[i].precision`), what
lower_precision lowered, and the error of the output against eager float32 on the
timed inputs. bfloat16 only pays on a CPU with AVX512-BF16 or AMX (printed first).

    python benchmarks/precision.py --threads 1
    python benchmarks/precision.py --models bert --levels 1 --rounds 5
    python benchmarks/precision.py --threads 1 --models decoder --variants "level 1 frozen + host graphs" \
        --precisions float32,bfloat16,int8\\ weights
"""

from __future__ import annotations

import argparse
import statistics
import subprocess

import torch
from rich.console import Console
from rich.table import Table
from timing import interleaved_times

import graphopt
from graphopt._compat import mkldnn
from graphopt.bench.vision import ResNet18
from graphopt.bench.workloads import BertEncoder


def bert(batch_sizes: list[int]):
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                     intermediate_size=1024, max_position_embeddings=64)
    model = BertEncoder(config).eval()
    ids = {b: torch.randint(0, 1000, (b, 64), generator=torch.Generator().manual_seed(b)) for b in batch_sizes}
    return "BERT encoder (hidden 256, 4 layers, sequence 64)", model, lambda b: (ids[b], torch.ones_like(ids[b]))


def decoder(batch_sizes: list[int]):
    from graphopt.models import Decoder, DecoderConfig

    torch.manual_seed(0)
    model = Decoder(DecoderConfig.bench()).eval()

    def step(b):
        ids = torch.randint(0, model.config.vocab_size, (b,), generator=torch.Generator().manual_seed(b))
        return ids, torch.full((b,), 5), torch.arange(b)
    steps = {b: step(b) for b in batch_sizes}
    return "the reference decoder's decode step (DecoderConfig.bench, 107M parameters)", model, steps.__getitem__


def resnet18(batch_sizes: list[int]):
    torch.manual_seed(0)
    images = {b: torch.randn(b, 3, 112, 112, generator=torch.Generator().manual_seed(b)) for b in batch_sizes}
    return "ResNet-18 at 112x112", ResNet18().eval(), lambda b: (images[b],)


PRECISIONS = {  # name -> config keys; the first is the baseline of the "vs" column
    "float32": {}, "bfloat16": dict(compute_dtype="bfloat16"),
    # No bound: the table shows the error it measured.
    "int8 weights": dict(weight_quantization="int8", precision_tolerance=None),
    "int4 weights": dict(weight_quantization="int4", precision_tolerance=None),
}
VARIANTS = {  # name -> config keys
    "level 1": dict(graph_opt_level=1, use_cudagraph=False, freeze_parameters=False),
    "level 1 frozen": dict(graph_opt_level=1, use_cudagraph=False, freeze_parameters=True),
    "level 1 frozen + host graphs": dict(graph_opt_level=1, use_cudagraph=True, freeze_parameters=True),
    "level 2 frozen": dict(graph_opt_level=2, use_cudagraph=False, freeze_parameters=True),
    # Inductor without timing its C++ GEMM template: every GEMM is ATen's (int8: _weight_int8pack_mm).
    "level 2 frozen + ATen GEMMs": dict(graph_opt_level=2, use_cudagraph=False, freeze_parameters=True,
                                        inductor_compile_config={"max_autotune_gemm": False}),
}


def cpu_flags() -> str:
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    found = [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags.split()]
    model = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("Model name")), "?")
    native = mkldnn.cpu_has_native_bf16()
    return f"{model}; bfloat16 flags: {', '.join(found) or 'none'}; native bf16 (graphopt): {native}"


def optimized(model, args) -> dict[str, torch.nn.Module]:
    """The model under every variant and precision the arguments ask for, by label."""
    levels = {int(x) for x in args.levels.split(",")}
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    opts = {}
    for name, keys in VARIANTS.items():
        if keys["graph_opt_level"] not in levels or name not in args.variants.split(","):
            continue
        for precision, more in PRECISIONS.items():
            if precision not in args.precisions.split(",") or ("weight_quantization" in more and (
                    keys["graph_opt_level"] not in (1, 2) or not keys["freeze_parameters"])):
                continue
            config = graphopt.GraphOptimizationConfig(**keys, **more, cache_dir=None,
                                                      cudagraph_capture_sizes=batch_sizes)
            opts[f"{name}, {precision}"] = graphopt.optimize(model, config)
    return opts


def row(label: str, batch: int, times: dict, errors: dict, opt) -> list[str]:
    """A table row: median, ratio to the same variant in float32, errors, what was lowered."""
    median = statistics.median(times[label, batch])
    cells = [str(batch), label, f"{median:.0f}"]
    if opt is None:
        return cells + ["", "", "", ""]
    base = label.rsplit(", ", 1)[0] + ", float32"
    cells.append(f"{statistics.median(times[base, batch]) / median:.2f}x" if base != label else "")
    cells.append(f"{errors[label, batch]:.2g}")
    report = opt.report()
    cells.append(", ".join(f"{p['max_abs_error']:.2g} / {p['relative_error']:.2g}"
                           + (" (fell back)" if p["fell_back"] else "") for p in
                           (g.precision for g in report.graphs if g.precision)))
    lowered: dict[str, int] = {}
    for p in (p for p in report.passes if p.name in ("quantize_weights", "lower_precision")):
        for op, n in p.counts.items():
            lowered[op] = lowered.get(op, 0) + n
    return cells + [", ".join(f"{op} {n}" for op, n in lowered.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert,resnet18")
    parser.add_argument("--levels", default="1,2")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--precisions", default="float32,bfloat16", help=f"of {', '.join(PRECISIONS)}")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5, help="steps per round")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    console = Console(width=180)
    console.print(cpu_flags())
    for build in (globals()[name] for name in args.models.split(",")):
        title, model, inputs = build(batch_sizes)
        opts = optimized(model, args)
        times = interleaved_times({"eager": model, **opts}, batch_sizes, inputs, args.rounds, args.steps)
        with torch.inference_mode():
            expected = {b: model(*inputs(b)).clone() for b in batch_sizes}
            errors = {(label, b): (opt(*inputs(b)) - expected[b]).abs().max().item()
                      for label, opt in opts.items() for b in batch_sizes}
        table = Table(title=title, caption=f"torch {torch.__version__} · {args.threads} thread(s) · "
                                           f"{args.rounds} interleaved rounds of {args.steps} steps")
        for column in ("batch", "variant", "median µs", "vs float32", "max abs err vs eager",
                       "measured at compile (max / rel)", "lowered"):
            table.add_column(column, justify="right")
        for batch in batch_sizes:
            for label in ["eager", *opts]:
                table.add_row(*row(label, batch, times, errors, opts.get(label)))
        console.print(table)


if __name__ == "__main__":
    main()
