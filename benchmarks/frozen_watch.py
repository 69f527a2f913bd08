"""What noticing a changed frozen weight costs per call (graphopt/frozen_watch.py).

With `freeze_parameters=True` every call of a compiled graph first reads the version
counter of each parameter and buffer the graph takes and compares one process-wide
count of assignments. This times that check alone (the same expression `FrozenWatch`
runs, over the graph's own tensors), the step's compiled graphs called with the
arguments Dynamo passed them, straight and through their watches (what a watch adds,
check and call together, without Dynamo's noise), and the whole step, on the reference
decoder's decode step at batch 1 and on a tiny MLP, in interleaved rounds, median µs;
and the decode step at level 1 with live weights (the default) against frozen ones, which is
what freezing gains there.

    python benchmarks/frozen_watch.py
    python benchmarks/frozen_watch.py --rounds 40 --config bench
"""

from __future__ import annotations

import argparse
import copy
import types
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table
from timing import median_us

import graphopt
from graphopt.backend import frozen_watch
from graphopt.models import Decoder, DecoderConfig


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).eval()


def optimized(model: torch.nn.Module, frozen: bool) -> Callable:
    """`model` optimized on its own copy, whose forward has its own code object: Dynamo keeps
    the graphs of one code object in one list, and a step whose graphs come later in it pays
    the guards of those before."""
    model = copy.deepcopy(model)
    forward = type(model).forward
    code = forward.__code__.replace()  # a new code object, with a cache of its own
    model.__class__ = type(type(model).__name__, (type(model),), {
        "forward": types.FunctionType(code, forward.__globals__, forward.__name__, forward.__defaults__,
                                      forward.__closure__)})
    config = graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False, cache_dir=None,
                                              freeze_parameters=frozen)
    return graphopt.optimize(model, config)


def check_of(step: Callable) -> tuple[Callable, int]:
    """The check every frozen graph of `step` runs before a call, and how many tensors it reads."""
    watches = step._step.backend.frozen_watches
    version, count = frozen_watch._version, frozen_watch._assignments

    def check() -> bool:
        return any(w.assignments != count[0] or list(map(version, w.tensors)) != w.versions for w in watches)

    return check, sum(len(w.tensors) for w in watches)


def graph_calls(step: Callable, inputs: tuple) -> tuple[Callable, Callable]:
    """Calls of `step`'s compiled graphs with the arguments Dynamo passed them on one step:
    through their watches, and straight to the graphs (what the watch adds, without Dynamo)."""
    calls = []
    for watch in step._step.backend.frozen_watches:
        graph = watch.runtime
        watch.runtime = lambda *args, graph=graph: calls.append((watch, args)) or graph(*args)
        step(*inputs)
        watch.runtime = graph
    return (lambda: [w(*args) for w, args in calls]), (lambda: [w.runtime(*args) for w, args in calls])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["tiny", "bench"], default="tiny")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    decoder = Decoder(getattr(DecoderConfig, args.config)()).eval()
    small = mlp()
    ids, positions, slots = torch.randint(0, decoder.config.vocab_size, (1,)), torch.full((1,), 7), torch.arange(1)
    x = torch.randn(1, 16)
    steps = {"decoder L1 frozen": (optimized(decoder, True), (ids, positions, slots)),
             "decoder L1 live": (optimized(decoder, False), (ids, positions, slots)),
             "MLP L1 frozen": (optimized(small, True), (x,))}
    variants, sizes = {}, {}
    with torch.no_grad():
        for name, (step, inputs) in steps.items():
            for _ in range(3):
                step(*inputs)
            variants[name] = lambda step=step, inputs=inputs: step(*inputs)
            if name.endswith("frozen"):
                check, sizes[name] = check_of(step)
                assert not check(), "a weight changed during warm-up"
                variants[f"{name}: check"] = check
                variants[f"{name}: watched graphs"], variants[f"{name}: graphs"] = graph_calls(step, inputs)
        us = median_us(variants, args.rounds, args.calls)
    for name, (step, _) in steps.items():
        assert not step.report().weight_refreshes, f"{name} refreshed: {step.report().weight_refreshes}"
    table = Table(title=f"frozen-weight check, {args.config} reference decoder (batch 1) and a tiny MLP",
                  caption=f"torch {torch.__version__} · {args.threads} thread(s) · median of {args.rounds} "
                          f"interleaved rounds of {args.calls} calls")
    for column in ("step", "tensors watched", "step µs", "check µs", "graphs alone µs", "graphs watched µs",
                   "watch / step"):
        table.add_column(column, justify="left" if column == "step" else "right")
    for name in steps:
        if name not in sizes:
            table.add_row(name, "-", f"{us[name]:.1f}", "-", "-", "-", "-")
            continue
        alone, watched = us[f"{name}: graphs"], us[f"{name}: watched graphs"]
        table.add_row(name, str(sizes[name]), f"{us[name]:.1f}", f"{us[f'{name}: check']:.2f}", f"{alone:.1f}",
                      f"{watched:.1f}", f"{(watched - alone) / us[name]:.1%}")
    console = Console(width=120)
    console.print(table)
    console.print(f"decode step, live / frozen weights at level 1 (above 1: freezing is faster): "
                  f"{us['decoder L1 live'] / us['decoder L1 frozen']:.2f}x")


if __name__ == "__main__":
    main()
