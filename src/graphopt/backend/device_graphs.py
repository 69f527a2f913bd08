"""The Backend's side of device graphs: what it learns of a graph before compiling it
(`analyse`: fake run, splitting ops, Signature) and the runtime it hands Dynamo
(`wrap`: compiled pieces in CapturedGraphs behind a GraphRunner, `runtime/runner.py`),
so that Dynamo's guards run before every replay. The runtime gets `RuntimeOptions`,
never the Backend: nothing in it calls back into a compile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch.fx

from ..config import GraphOptimizationConfig
from ..report import FallbackKind, PieceRecord, Report
from ..runtime.analysis.fake_run import fake_run
from ..runtime.analysis.signature import Signature, batch_candidates, signature_of
from ..runtime.capture import CapturedGraph
from ..runtime.pool import Pool
from ..runtime.runner import GraphRunner


@dataclass
class RuntimeOptions:
    """What the runtimes of one Backend share (vLLM's CUDAGraphOptions): its config
    (capture sizes, warm-ups, splitting ops), report, batch dims and pad values,
    graph pools, the threads that called, and the lock that keeps replays apart."""

    config: GraphOptimizationConfig
    report: Report
    dynamic_dims: Mapping[str, int] | None
    pad_values: Mapping[str, float | int]
    pools: dict[str, Any]  # device -> the pool its CUDA graphs share
    callers: set[int]
    lock: Any


@dataclass
class Layout:
    """What the fake run found of a graph: its Signature and the nodes a device graph cannot replay."""

    signature: Signature
    unsafe: dict[torch.fx.Node, str]
    graph_index: int


def analyse(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], mode: str,
            options: RuntimeOptions) -> Layout | None:
    """`gm` run on fake values for device graphs in `mode` ("auto" or "full"); None,
    reported, where it then runs without device graphs."""
    config, report = options.config, options.report
    graph_index = len(report.pieces)
    try:
        findings = fake_run(gm, example_inputs, config.cudagraph_splitting_ops,
                            batch_candidates(gm, options.dynamic_dims, example_inputs), config.rowwise_ops)
    except Exception as error:  # noqa: BLE001 - the graph still runs; only device graphs are lost
        report.fallback(FallbackKind.NO_DEVICE_GRAPH,
                        f"use_cudagraph: graph {graph_index} could not be run on fake tensors to "
                        f"find its splitting ops and written inputs ({type(error).__name__}: "
                        f"{error}); it runs without device graphs")
        return None
    unsafe = findings.splitting_nodes
    if unsafe and mode == "full":
        reasons = "; ".join(sorted(set(unsafe.values())))
        report.fallback(FallbackKind.NO_DEVICE_GRAPH,
                        f"use_cudagraph: cudagraph_mode='full' and graph {graph_index} has ops a "
                        f"device graph cannot replay, so it runs without one: {reasons}")
        return None
    signature = signature_of(gm, options.dynamic_dims, options.pad_values, findings.written, example_inputs,
                             findings.mixing)
    return Layout(signature, unsafe, graph_index)


def captured(compiled: Callable, record: PieceRecord, options: RuntimeOptions, pool: Pool,
             static: list[bool]) -> CapturedGraph:
    """A compiled graph or piece in device graphs; `static[i]`: input i sits at a fixed address."""
    return CapturedGraph(compiled, record, options.config, options.report, pool, static)


def pool(options: RuntimeOptions) -> Pool:
    """A pool for the device graphs of one Dynamo graph."""
    return Pool(options.config, options.pools)


def wrap(graph: Callable, pieces: list[CapturedGraph], signature: Signature, key: str | None,
         options: RuntimeOptions) -> GraphRunner:
    """The runtime Dynamo calls: `graph` (one CapturedGraph, or the split graph calling its
    pieces) behind a GraphRunner that fits each call to a capture size."""
    return GraphRunner(graph, signature, pieces, options.config, options.report, options.callers, key, options.lock)


def whole(compiled: Callable, signature: Signature, key: str | None, options: RuntimeOptions) -> GraphRunner:
    """The runtime of an unsplit graph: one CapturedGraph, its device graphs in one pool."""
    record = options.report.piece(len(options.report.pieces), None)
    graph = captured(compiled, record, options, pool(options), signature.static)
    return wrap(graph, [graph], signature, key, options)
