"""Each fusion on and off at levels 1 and 2: what every rewrite is worth where it
runs, and what the fusion gates (`graphopt/passes/fusion/gates.py`) skip.

For each workload and level the baseline is graphopt as shipped, with
freeze_parameters=True (so the horizontal fusion runs too), level 1 with host
graphs. Each variant turns one fusion off (`disabled_passes`), or, for a fusion a
gate holds back, turns the gates off so the rewrite happens. Only fusions that
change the workload's graph are shown. In every round each variant runs right
after the baseline and the ratio of the two is kept, so drift on a shared machine
hits both; the table shows the median ratio over the rounds:
time without the rewrite / time with it, > 1 when the rewrite pays.

    python benchmarks/fusion_gates.py --threads 1
    python benchmarks/fusion_gates.py --workloads bert-eager   # BERT, attention written out: prefill-shaped queries
    python benchmarks/fusion_gates.py --workloads decoder --levels 2 --rounds 30
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

import torch
from rich.console import Console
from rich.table import Table

import graphopt
from graphopt.bench.measure import compare, seconds_per_call
from graphopt.bench.workloads import WORKLOADS, Sizes, Workload
from graphopt.passes.fusion import fusion_passes, gates


def _workload(name: str) -> Workload:
    """A `graphopt bench` workload; `bert-eager` is its BERT with transformers' eager
    attention (written out, so fuse_attention meets 32-token queries)."""
    workload = WORKLOADS[name.removesuffix("-eager")](Sizes(quick=False, device="cpu"))
    if name == "decoder":  # the decode step alone: the stream mixes the two sizes timed here
        workload.cases = [c for c in workload.cases if c.name.startswith("decode step")]
    if name == "bert-eager":
        workload.model.bert.config._attn_implementation = "eager"
        workload.name = name
    return workload


def _step(workload: Workload, level: int, disabled: list[str]) -> Callable:
    config = graphopt.GraphOptimizationConfig(
        graph_opt_level=level, use_cudagraph=level == 1, cudagraph_capture_sizes=workload.capture_sizes,
        freeze_parameters=True, disabled_passes=disabled, cache_dir=None)
    return workload.bind(lambda target: graphopt.optimize(target, config, pad_values=workload.pad_values))


def _warm(step: Callable, workload: Workload, gated: bool) -> list[Any]:
    """Compile (with the gates on or off) and capture at every case; the outputs."""
    gates.ENABLED = gated
    try:
        with torch.inference_mode():
            return [[case.runner(step)() for _ in range(3)][-1] for case in workload.cases]
    finally:
        gates.ENABLED = True


def _rewrites(step: Callable) -> tuple[list[str], list[str]]:
    """(fusions that changed the graph, fusions whose gate held a match back)."""
    passes = step.report().passes
    names = set(fusion_passes())
    changed = sorted({p.name for p in passes if p.name in names and p.changed})
    held = sorted({p.name for p in passes if p.name in names and p.counts.get("gated")})
    return changed, held


def _ratios(baseline: Callable[[], Any], variants: dict[str, Callable[[], Any]], rounds: int,
            target_s: float) -> dict[str, list[float]]:
    """Per round, each variant's time over the baseline's, timed just before it.
    Each run is called 3 times first: a run on fresh inputs captures its host graph
    again, ~50x a replay, which would swamp a short benchmark's first round."""
    with torch.inference_mode():
        for run in [baseline, *variants.values()]:
            for _ in range(3):
                run()
        calls = max(1, round(target_s / seconds_per_call(baseline)))
        ratios: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, run in variants.items():
                base = seconds_per_call(baseline, runs=calls)
                ratios[name].append(seconds_per_call(run, runs=calls) / base)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="decoder,bert-eager")
    parser.add_argument("--levels", default="1,2")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    console = Console() if Console().is_terminal else Console(width=160)  # no wrapped cells in a log
    table = Table(title="each fusion on and off: time without the rewrite / time with it (> 1: it pays)",
                  caption=f"torch {torch.__version__} · cpu · {args.threads} thread(s) · median of "
                          f"{args.rounds} paired rounds · freeze_parameters=True · level 1 with host graphs")
    for column in ("workload", "level", "fusion", "state", "case", "without / with", "output = eager"):
        table.add_column(column, justify="right" if column in ("level", "without / with") else "left")
    for name in args.workloads.split(","):
        workload = _workload(name)
        eager = workload.bind(lambda target: target)
        with torch.inference_mode():
            expected = [case.runner(eager)() for case in workload.cases]
        for level in (int(x) for x in args.levels.split(",")):
            baseline = _step(workload, level, [])
            outputs = {"shipped": _warm(baseline, workload, gated=True)}
            changed, held = _rewrites(baseline)
            steps = {"shipped": baseline}
            for fusion in changed:
                steps[f"-{fusion}"] = _step(workload, level, [fusion])
                outputs[f"-{fusion}"] = _warm(steps[f"-{fusion}"], workload, gated=True)
            for fusion in held:
                steps[f"+{fusion}"] = _step(workload, level, [])
                outputs[f"+{fusion}"] = _warm(steps[f"+{fusion}"], workload, gated=False)
            console.print(f"{name} level {level}: fusions that rewrite {changed}, gated {held}")
            for i, case in enumerate(workload.cases):
                variants = {v: case.runner(step) for v, step in steps.items() if v != "shipped"}
                ratios = _ratios(case.runner(baseline), variants, args.rounds, 0.05)
                for variant in variants:
                    median = statistics.median(ratios[variant])
                    off = variant.startswith("-")
                    # A "-" variant runs without the rewrite; a "+" variant with the gated rewrite.
                    pays = median if off else 1 / median
                    equal = all(compare(outputs[v][i], expected[i])[0] for v in ("shipped", variant))
                    table.add_row(name, str(level), variant[1:], "on, shipped" if off else "gated off, shipped",
                                  case.name, f"{pays:.2f}", "✓" if equal else "✗")
    console.print(table)


if __name__ == "__main__":
    main()
