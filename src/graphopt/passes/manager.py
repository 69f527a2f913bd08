"""The pass pipeline of each graph_opt_level, run on one ATen FX graph.

A pass is a function `GraphModule -> PassResult` that rewrites the graph in place.
The manager runs the level's pipeline in order, skips `disabled_passes`, checks the
graph after every pass, records one `PassRecord` per pass in the report (counts
summed over cleanup rounds), writes debug dumps, and with `verify=True` proves each
pass kept the graph's results.

A pass that leaves an invalid graph (one `Graph.lint` refuses, or a node taking a
tensor as a literal argument instead of reading a constant with get_attr) is undone:
the graph goes back to what it was before that pass, the fallback is counted in the
report, and the pipeline goes on. With `verify=True` it is an error instead.

The cleanup passes repeat as a group until a round changes nothing (at most
`CLEANUP_ROUNDS` rounds): one rewrite often enables another (a removed no-op lets
CSE merge two values, a folded constant turns `x * w` into `x * 1`).
"""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx

from .._compat import fake
from .._compat.names import tree_leaves
from ..config import GraphOptimizationConfig
from ..report import FallbackKind, GraphRecord, PassRecord, Report, first_line
from . import lowered_error, precision, quantize, shared_weights
from .base import PassResult
from .checks import GraphRun, PassVerificationError, Snapshot, check_same, graph_state, same_state
from .fusion import fused_op_counts
from .fusion.replacement import searches_cached_in
from .memory_plan import memory_record

PassFn = Callable[[torch.fx.GraphModule], PassResult]


def builtin_passes() -> dict[str, PassFn]:
    """Every pass graphopt ships, by name (the names `disabled_passes` takes)."""
    from . import (
        algebraic,
        cleanup,
        constant_fold,
        layout,
        memory_plan,
        redundant,
        reinplace,
        transposed_weights,
    )
    from .canonical import canonical_passes
    from .fusion import fusion_passes, linear, packed_linear

    return {
        **canonical_passes(),
        **fusion_passes(),
        "dce": cleanup.dce,
        "cse": cleanup.cse,
        "remove_noops": redundant.remove_noops,
        "remove_redundant": redundant.remove_redundant,
        "simplify_algebra": algebraic.simplify_algebra,
        "fold_constants": constant_fold.fold_constants,
        "recompose_linear": linear.recompose_linear,
        "recompose_matmul": linear.recompose_matmul,
        "fuse_packed_linear": packed_linear.fuse_packed_linear,
        "quantize_weights": quantize.quantize_weights,
        "lower_precision": precision.lower_precision,
        "convert_layout": layout.convert_layout,
        "store_transposed_weights": transposed_weights.store_transposed_weights,
        "reinplace_input_mutations": reinplace.reinplace_input_mutations,
        "reinplace_intermediates": reinplace.reinplace_intermediates,
        "plan_memory": memory_plan.plan_memory,
    }


# Run as a group to a fixed point. Folding comes before the fusions, so they see
# folded constants; views of weights are never folded, so `t(w)` stays for them.
CLEANUP = ["dce", "remove_noops", "remove_redundant", "simplify_algebra", "cse", "fold_constants"]
CLEANUP_ROUNDS = 4


def _canonical_and_fusions() -> list[str]:
    from .canonical import canonical_passes
    from .fusion import fusion_passes

    # Canonicalization right before the fusions: it rewrites each op family into the
    # one form the fusions match, after cleanup has merged and folded what it reads.
    return [*canonical_passes(), *fusion_passes()]


# Mutation-introducing passes go last: the passes before them see a functional graph.
# At level 2 Inductor re-inplaces input mutations itself and expects a functional graph,
# and it lowers a decomposed linear better than an `aten.linear` call.
# fuse_packed_linear is level 1 only: it reads the `linear` that recompose_linear makes, and
# at level 2 with frozen weights Inductor times each GEMM's C++ template against ATen's.
# store_transposed_weights is level 2 only, after the quantization: it takes the transpose
# out of a folded linear weight, which level 1's recompose_linear and the quantization read.
# convert_layout is level 1 only: Inductor chooses channels-last for convolution graphs
# itself (GraphLowering.decide_layout_opt, always on CPU with oneDNN), and would have to
# honour graphopt's explicit clones as copies.
PIPELINES: dict[int, list[str]] = {
    0: [],
    1: [*CLEANUP, *_canonical_and_fusions(), "recompose_linear", "recompose_matmul", "fuse_packed_linear",
        "convert_layout", "reinplace_input_mutations", "reinplace_intermediates", "plan_memory"],
    2: [*CLEANUP, *_canonical_and_fusions(), "store_transposed_weights"],
}

# Opt-in, after this pass: after the fusions, which match float32 spellings, and
# recompose_* (whole linears); before fuse_packed_linear (float32 only), layout and the
# mutation passes. Weights are quantized first, lower_precision lowers what is left.
PRECISION_AFTER: dict[int, str] = {1: "recompose_matmul", 2: _canonical_and_fusions()[-1]}


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
        names = precision.with_opt_in(PIPELINES[config.graph_opt_level], PRECISION_AFTER.get(config.graph_opt_level),
                                      config)
        self.pipeline = [(name, passes[name]) for name in names if config.pass_enabled(name)]

    def optimize(self, gm: torch.fx.GraphModule, record: GraphRecord, inputs: list, kinds: list[str]) -> dict:
        """Run the pipeline on the ATen graph `gm` of graph `record`, whose placeholders
        take `inputs` (real tensors; `kinds` says which are parameters and buffers),
        with the config's freezing and verification. Fills `record`; returns the
        report records the compile added, for the compile cache."""
        config, report = self.config, self.report
        first_pass, first_plan, fallbacks_before = len(report.passes), len(report.memory), Counter(report.fallbacks)
        record.nodes_before = _count_ops(gm.graph)
        gm.meta["graphopt_level"] = config.graph_opt_level
        matched = _inputs_match(gm, inputs)
        if config.freeze_parameters and matched:
            # Constant folding may treat these as constants; mutated buffers it must skip itself.
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            gm.meta["graphopt_frozen_inputs"] = {
                node.name: value for node, value, kind in zip(placeholders, inputs, kinds)
                if kind in ("parameter", "buffer") and isinstance(value, torch.Tensor)
                and not fake.is_fake(value)}
        real = matched and not any(isinstance(x, torch.Tensor) and fake.is_fake(x) for x in inputs)
        precision.prepare(gm, config, report.fallback)
        verify_inputs = inputs if config.verify and real else None
        if config.verify and not real:
            report.fallback(FallbackKind.UNCHECKED, "verify skipped: the ATen graph's inputs do not match "
                            "Dynamo's example inputs (AOTAutograd added or merged inputs, or a piece of a split "
                            "graph reads intermediate values)")
        if config.freeze_parameters and not matched:
            report.fallback(FallbackKind.NOT_FROZEN, "freeze_parameters: the ATen graph's inputs do not match "
                            "Dynamo's example inputs, so parameters stay live inputs")
        offered = shared_weights.offered()
        self.run(gm, record.index, verify_inputs, inputs if real else None)
        record.weight_bytes = shared_weights.held_bytes(gm, offered)
        record.nodes_after = _count_ops(gm.graph)
        record.precision = dict(gm.meta.get(precision.PRECISION_ERROR, {}))
        memory = memory_record(gm, record.index)  # set by the plan_memory pass
        if memory is not None:
            report.memory.append(memory)
        record.fused_ops = fused_op_counts(gm.graph)
        return {"record": {"nodes_before": record.nodes_before, "nodes_after": record.nodes_after,
                           "fused_ops": dict(record.fused_ops), "precision": dict(record.precision),
                           "weight_bytes": dict(record.weight_bytes)},
                "passes": report.passes[first_pass:], "memory": report.memory[first_plan:],
                "fallbacks": report.fallbacks_since(fallbacks_before)}

    def run(self, gm: torch.fx.GraphModule, graph_index: int, verify_inputs: Sequence[Any] | None = None,
            example_inputs: Sequence[Any] | None = None) -> torch.fx.GraphModule:
        """Run the pipeline on `gm` in place. Given `verify_inputs` (real tensors in
        the graph's input order), every pass is checked against the graph before it;
        given `example_inputs`, the error of lower precision is measured on them."""
        folder = dump_dir(self.config)
        if folder is not None:
            folder = folder / f"graph_{next(_dump_ids):03d}"
            folder.mkdir(parents=True, exist_ok=True)
            _dump(gm, folder / "00_input")
        run = _Run(gm, graph_index, self.report, folder, verify_inputs, self.config, example_inputs)
        with searches_cached_in(self.config.cache_dir, self.report):
            for group in self._groups():
                rounds = CLEANUP_ROUNDS if group[0][1] in CLEANUP else 1
                for round_ in range(1, rounds + 1):
                    changed = [run.step(step, name, fn, round_) for step, name, fn in group]
                    if not any(changed):
                        break
        return gm

    def _groups(self) -> list[list[tuple[int, str, PassFn]]]:
        """The pipeline as (step, name, fn), in groups: each run of consecutive
        cleanup passes is one group, every other pass a group of its own."""
        groups: list[list[tuple[int, str, PassFn]]] = []
        for step, (name, fn) in enumerate(self.pipeline, start=1):
            if groups and name in CLEANUP and groups[-1][-1][1] in CLEANUP:
                groups[-1].append((step, name, fn))
            else:
                groups.append([(step, name, fn)])
        return groups


class _Run:
    """One pipeline run on one graph: runs passes, and keeps their records, dumps
    and the reference results verification compares against."""

    def __init__(self, gm: torch.fx.GraphModule, graph_index: int, report: Report,
                 folder: Path | None, verify_inputs: Sequence[Any] | None, config: GraphOptimizationConfig,
                 example_inputs: Sequence[Any] | None):
        self.gm, self.graph_index, self.report, self.folder = gm, graph_index, report, folder
        self.verify, self.full_precision = config.verify, None
        self.tolerance, self.slack = precision.tolerance(config)
        self.verify_run = GraphRun(gm, verify_inputs) if verify_inputs is not None else None
        self.example_run = GraphRun(gm, example_inputs) if example_inputs is not None else None
        self.expected = self.verify_run() if self.verify_run is not None else None
        self.records: dict[str, PassRecord] = {}
        self.snapshot: Snapshot | None = None
        # (graph_state, forward) when gm was last recompiled here: its code is current while both hold.
        self.compiled: tuple[tuple, Any] | None = None

    def step(self, step: int, name: str, fn: PassFn, round_: int) -> bool:
        """Run one pass; True when it changed the graph (and was not undone)."""
        start = time.perf_counter()
        before = self.snapshot = Snapshot(self.gm, self.snapshot)
        result = self._measured(name, fn, before) if name in precision.MEASURED_PASSES else fn(self.gm)
        after = graph_state(self.gm)
        problem = None if same_state(before.state, after) else _invalid(self.gm.graph)
        if problem is not None:
            advice = f"Disable it with disabled_passes=[{name!r}] and report the graph (debug_dump_dir)."
            if self.verify:
                raise PassVerificationError(f"pass {name!r} left an invalid graph: {problem}. {advice}")
            before.restore(self.gm)
            self.report.fallback(FallbackKind.PASS_UNDONE, f"pass {name!r} left an invalid graph ({problem}); "
                                 f"it was undone for this graph. {advice}")
            result = PassResult(changed=False)
            after = graph_state(self.gm)  # the restored nodes are new ones
        self._recompile(after)
        record = self.records.get(name)
        if record is None:
            record = self.records[name] = PassRecord(self.graph_index, name, False, {}, 0.0)
            self.report.passes.append(record)
        record.changed |= result.changed
        record.seconds += time.perf_counter() - start
        for key, count in result.counts.items():
            record.counts[key] = record.counts.get(key, 0) + count
        if self.folder is not None and (round_ == 1 or result.changed):
            suffix = "" if round_ == 1 else f"_round{round_}"
            _dump(self.gm, self.folder / f"{step:02d}_{name}{suffix}")
        if self.expected is not None:
            actual = self.verify_run(name)
            if name not in precision.MEASURED_PASSES:  # held to precision_tolerance instead
                with fake.outside_fake_mode():
                    check_same(name, self.expected, actual)
            self.expected = actual
        return result.changed

    def _recompile(self, state: tuple) -> None:
        """Recompile gm, whose graph_state is `state`, unless its graph and code are as this
        run last compiled them (a pass that changed nothing). Every recompile gives the module
        a new forward, so a pass that recompiled on its own, or a graph put back after one,
        is compiled again."""
        forward = type(self.gm).forward
        if self.compiled is not None and self.compiled[1] is forward and same_state(self.compiled[0], state):
            return
        self.gm.recompile()
        self.compiled = state, type(self.gm).forward

    def _measured(self, name: str, fn: PassFn, before: Snapshot) -> PassResult:
        """A pass that lowers precision, its error measured on the example inputs against
        the graph before the first such pass (`gm.meta`); undone past precision_tolerance."""
        if self.full_precision is None and self.example_run is not None:
            self.full_precision = self.example_run(name)
        expected, result = self.full_precision, fn(self.gm)
        if result.changed and expected is None:
            self.report.fallback(FallbackKind.UNCHECKED, precision.NOT_MEASURED)
        elif result.changed:
            error = self._error_of(name, expected)
            # Past the bound, a causal LM's output projection takes its float weight before
            # the whole graph's quantization is undone.
            while error["fell_back"] and name == "quantize_weights" \
                    and (finer := quantize.finer_logits(result)) is not None:
                before.restore(self.gm)
                self.gm.meta[quantize.LOGITS_FORMAT] = finer
                result = fn(self.gm)
                error = {**self._error_of(name, expected), "logits_weights": finer}
            if error["fell_back"]:
                before.restore(self.gm)
                self.report.fallback(FallbackKind.PRECISION, lowered_error.over_tolerance(name, error))
                result = PassResult(changed=False)
            self.gm.meta[precision.PRECISION_ERROR] = error
        return result

    def _error_of(self, name: str, expected: Any) -> dict[str, Any]:
        """The error of the graph as pass `name` left it, against `expected` (full precision's)."""
        self.gm.recompile()
        actual = self.example_run(name)
        with fake.outside_fake_mode():
            return lowered_error.measured_error(self.gm, expected, actual, self.tolerance, self.slack)


def _inputs_match(gm: torch.fx.GraphModule, inputs: list) -> bool:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        return False
    for node, value in zip(placeholders, inputs):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) != isinstance(value, torch.Tensor):
            return False
        if isinstance(val, torch.Tensor) and (val.dim() != value.dim() or val.dtype != value.dtype):
            return False
    return True


def _count_ops(graph: torch.fx.Graph) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function")


def _invalid(graph: torch.fx.Graph) -> str | None:
    """Why `graph` is not a valid graph to run or compile, or None when it is: what
    `Graph.lint` refuses (a node used before it is defined, ...), or a tensor given
    as a literal argument. A constant must be read with get_attr: compilers trace
    graphs on fake tensors, and a real tensor among their arguments fails there."""
    try:
        graph.lint()
    except RuntimeError as error:
        return first_line(error)  # lint then prints the whole graph: the dumps have it
    for node in graph.nodes:
        for arg in tree_leaves((node.args, node.kwargs)):
            if isinstance(arg, torch.Tensor):
                return (f"node {node.name!r} takes a tensor of shape {tuple(arg.shape)} as a literal argument "
                        "instead of reading a constant with get_attr")
    return None


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
