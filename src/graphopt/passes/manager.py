"""The pass pipeline of each graph_opt_level, run on one ATen FX graph.

A pass is a function `GraphModule -> PassResult` that rewrites the graph in place.
The manager runs the level's pipeline in order, skips `disabled_passes`, lints the
graph after every pass, records a `PassRecord` per pass in the report, writes debug
dumps, and with `verify=True` proves each pass kept the graph's results.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch.utils._pytree import tree_leaves

from .. import _compat
from ..config import GraphOptimizationConfig, tolerance
from ..report import PassRecord, Report


@dataclass
class PassResult:
    changed: bool
    counts: dict[str, int] = field(default_factory=dict)


PassFn = Callable[[torch.fx.GraphModule], PassResult]


class PassVerificationError(RuntimeError):
    """A pass changed what the graph computes (raised with `verify=True`)."""


def builtin_passes() -> dict[str, PassFn]:
    """Every pass graphopt ships, by name (the names `disabled_passes` takes)."""
    from . import cleanup, reinplace
    from .fusion import linear

    return {
        "dce": cleanup.dce,
        "cse": cleanup.cse,
        "remove_noops": cleanup.remove_noops,
        "recompose_linear": linear.recompose_linear,
        "recompose_matmul": linear.recompose_matmul,
        "reinplace_input_mutations": reinplace.reinplace_input_mutations,
    }


# Mutation-introducing passes go last: the passes before them see a functional graph.
# At level 2 Inductor re-inplaces input mutations itself and expects a functional graph,
# and it lowers a decomposed linear better than an `aten.linear` call.
PIPELINES: dict[int, list[str]] = {
    0: [],
    1: ["dce", "cse", "remove_noops", "recompose_linear", "recompose_matmul",
        "reinplace_input_mutations"],
    2: ["dce", "cse", "remove_noops"],
}


def check_pass_names(names: Sequence[str]) -> None:
    known = builtin_passes()
    unknown = [n for n in names if n != "*" and n not in known]
    if unknown:
        raise ValueError(f"disabled_passes names unknown pass(es) {unknown}; "
                         f"known passes: {sorted(known)} (or '*' for all)")


def dump_dir(config: GraphOptimizationConfig) -> Path | None:
    """Where graphs are dumped: `debug_dump_dir`, or ./graphopt_debug when
    GRAPHOPT_DEBUG=1 or TORCH_COMPILE_DEBUG=1 is set."""
    if config.debug_dump_dir:
        return Path(config.debug_dump_dir)
    if os.environ.get("GRAPHOPT_DEBUG") == "1" or os.environ.get("TORCH_COMPILE_DEBUG") == "1":
        return Path("graphopt_debug")
    return None


# Numbered across the process so two models dumping into one folder never collide.
_dump_ids = itertools.count()


class PassManager:
    def __init__(self, config: GraphOptimizationConfig, report: Report):
        self.config = config
        self.report = report
        passes = builtin_passes()
        self.pipeline = [(name, passes[name]) for name in PIPELINES[config.graph_opt_level]
                         if config.pass_enabled(name)]

    def run(self, gm: torch.fx.GraphModule, graph_index: int,
            verify_inputs: Sequence[Any] | None = None) -> torch.fx.GraphModule:
        """Run the pipeline on `gm` in place. Given `verify_inputs` (real tensors in
        the graph's input order), every pass is checked against the graph before it."""
        folder = dump_dir(self.config)
        if folder is not None:
            folder = folder / f"graph_{next(_dump_ids):03d}"
            folder.mkdir(parents=True, exist_ok=True)
            _dump(gm, folder / "00_input")
        expected = _run_graph(gm, verify_inputs) if verify_inputs is not None else None
        for step, (name, fn) in enumerate(self.pipeline, start=1):
            start = time.perf_counter()
            result = fn(gm)
            gm.graph.lint()
            gm.recompile()
            self.report.passes.append(PassRecord(graph_index, name, result.changed,
                                                 dict(result.counts), time.perf_counter() - start))
            if folder is not None:
                _dump(gm, folder / f"{step:02d}_{name}")
            if expected is not None:
                actual = _run_graph(gm, verify_inputs)
                with _compat.outside_fake_mode():
                    _check_same(name, expected, actual)
                expected = actual
        return gm


def _run_graph(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> list[torch.Tensor]:
    """Outputs and final input states (a pass must keep mutations too), on clones
    of the inputs so the caller's buffers are untouched; random ops reseeded."""
    with _compat.outside_fake_mode(), torch.random.fork_rng(devices=[]), torch.no_grad():
        args = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
        torch.manual_seed(0)
        out = gm(*args)
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)] + \
           [a for a in args if isinstance(a, torch.Tensor)]


def _check_same(name: str, expected: list[torch.Tensor], actual: list[torch.Tensor]) -> None:
    if len(expected) != len(actual):
        raise PassVerificationError(
            f"pass {name!r} changed the number of graph outputs ({len(expected)} -> {len(actual)}); "
            f"disable it with disabled_passes=[{name!r}]")
    for i, (e, a) in enumerate(zip(expected, actual)):
        atol, rtol = tolerance(e.dtype)
        if e.shape != a.shape or e.dtype != a.dtype:
            problem = f"{tuple(e.shape)}/{e.dtype} became {tuple(a.shape)}/{a.dtype}"
        elif torch.allclose(e, a, atol=atol, rtol=rtol, equal_nan=True):
            continue
        else:
            diff = (e.double() - a.double()).abs().nan_to_num(float("inf")).max().item()
            problem = f"max abs difference {diff:.3g} (atol={atol}, rtol={rtol})"
        raise PassVerificationError(
            f"pass {name!r} changed the graph's results: value {i} differs, {problem}. "
            f"Disable it with disabled_passes=[{name!r}] and report the graph (debug_dump_dir).")


def _dump(gm: torch.fx.GraphModule, stem: Path) -> None:
    stem.with_suffix(".py").write_text(gm.print_readable(print_output=False))
    stem.with_suffix(".txt").write_text(node_table(gm.graph))


def node_table(graph: torch.fx.Graph) -> str:
    """One line per node: name, op, target, value shape/dtype, users."""
    rows = [("name", "op", "target", "value", "users")]
    for n in graph.nodes:
        val = n.meta.get("val")
        value = f"{tuple(val.shape)} {val.dtype}".replace("torch.", "") \
            if isinstance(val, torch.Tensor) else ("" if val is None else type(val).__name__)
        rows.append((n.name, n.op, str(n.target), value, str(len(n.users))))
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows) + "\n"
