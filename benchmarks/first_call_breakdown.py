"""Where a first call's seconds go: Dynamo, AOTAutograd, graphopt's passes, Inductor's
lowering, code generation and C++ build, GEMM autotuning. Each variant compiles the
reference decoder's decode step in a fresh process with an empty Inductor cache
directory and no graphopt cache, one `generate()` of two tokens at batch 1 (the
prefill runs eager); the phases are torch's own compile timers (`dynamo_timed`) and
graphopt's pass records. A phase nested in another is shown under it, so the rows do
not add up; "first call" is the wall time of the whole `generate()`.

    python benchmarks/first_call_breakdown.py --model billion --threads 2
    python benchmarks/first_call_breakdown.py --model small --variants "torch.compile" "level 2 frozen"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = ("torch.compile", "level 1", "level 2 frozen")
# torch's timers worth a row, outermost first: (label, timer name).
PHASES = [
    ("Dynamo: trace and compile, all of it", "_compile.compile_inner"),
    ("  the backend (everything after Dynamo's trace)", "OutputGraph.call_user_compiler"),
    ("    AOTAutograd: trace and compile", "create_aot_dispatcher_function"),
    ("      Inductor: compile_fx_inner", "compile_fx_inner"),
    ("        lowering (GraphLowering.run)", "GraphLowering.run"),
    ("        code generation and C++ build", "GraphLowering.compile_to_module"),
    ("          GEMM autotuning (within lowering)", "mm_template_autotuning"),
]


def child(model_name: str, variant: str, threads: int) -> None:
    import torch

    import graphopt
    import graphopt.models

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = getattr(graphopt.models.DecoderConfig, model_name)(max_num_seqs=4, max_seq_len=128)
    model = graphopt.models.Decoder(config).eval()
    if variant == "torch.compile":
        step, report = torch.compile(model), None
    else:
        level = int(variant.split()[1])
        options = graphopt.GraphOptimizationConfig(graph_opt_level=level, freeze_parameters="frozen" in variant,
                                                   use_cudagraph=level == 1, cache_dir=None)
        step = graphopt.optimize(model, options)
        report = step.report
    prompt = torch.randint(config.vocab_size, (1, 8))
    start = time.perf_counter()
    with torch.no_grad():
        graphopt.models.generate(model, prompt, 2, step=step)
    first = time.perf_counter() - start
    headers, values = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    timers = {h: float(v) for h, v in zip(headers, values)}
    passes = sum(p.seconds for p in report().passes) if report is not None else 0.0
    print("RESULT " + json.dumps({"first": first, "timers": timers, "passes": passes}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="billion", choices=["small", "bench", "billion"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.model, args.child[1], args.threads)
    results = {}
    for variant in args.variants:
        with tempfile.TemporaryDirectory() as cold:
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--threads", str(args.threads),
                                  "--child", "run", variant], capture_output=True, text=True,
                                 env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cold})
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{variant} failed:\n{out.stderr[-3000:]}")
        results[variant] = json.loads(line[len("RESULT "):])
    print("| phase (s) | " + " | ".join(args.variants) + " |")
    print("| --- |" + " --- |" * len(args.variants))
    print("| first call (the whole first `generate()`) | "
          + " | ".join(f"{results[v]['first']:.1f}" for v in args.variants) + " |")
    for label, timer in PHASES:
        cells = [results[v]["timers"].get(timer) for v in args.variants]
        print(f"| {label} | " + " | ".join("—" if c is None else f"{c:.1f}" for c in cells) + " |")
    print("| graphopt's passes (report().passes) | "
          + " | ".join(f"{results[v]['passes']:.1f}" if v != "torch.compile" else "—" for v in args.variants) + " |")
    print("\nAll of torch's timers, for the record:")
    for variant in args.variants:
        timers = sorted(results[variant]["timers"].items(), key=lambda kv: -kv[1])
        print(f"- {variant}: " + ", ".join(f"{k} {v:.1f}" for k, v in timers[:14]))


if __name__ == "__main__":
    main()
