"""What the Backend hands Dynamo with device graphs on: the compiled graph inside
the runtime (`runtime/runner.py`), so that Dynamo's guards run before every replay.

    Dynamo graph -> fake run (splitting ops, written inputs, rows) -> Signature
                 -> one CapturedGraph (no op a device graph cannot replay)
                  | pieces around those ops, each safe one a CapturedGraph (piecewise)
                  | the compiled graph alone (cudagraph_mode="full" with such ops, or no fake run)
                 -> GraphRunner

`compile(graph, example_inputs, key=None)` compiles a graph or a piece at the
Backend's level for this graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.fx

from .backend_cache import GraphSpec
from .report import FallbackKind
from .runtime.analysis import piecewise
from .runtime.analysis.fake_run import fake_run
from .runtime.analysis.signature import Signature, batch_candidates, signature_of
from .runtime.capture import CapturedGraph
from .runtime.pool import Pool
from .runtime.runner import GraphRunner

if TYPE_CHECKING:
    from .backend import Backend


def wrap(backend: Backend, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], mode: str,
         compile: Callable, key: str | None, spec: GraphSpec | str) -> tuple[Callable, GraphSpec | str]:
    """The runtime of `gm` with device graphs in `mode` ("auto" or "full"), and its
    spec (a split graph's says why a later process cannot build it again)."""
    config, report = backend.config, backend.report()
    graph_index = len(report.pieces)
    try:
        findings = fake_run(gm, example_inputs, config.cudagraph_splitting_ops,
                            batch_candidates(gm, backend.dynamic_dims, example_inputs), config.rowwise_ops)
    except Exception as error:  # noqa: BLE001 - the graph still runs; only device graphs are lost
        report.fallback(FallbackKind.NO_DEVICE_GRAPH,
                        f"use_cudagraph: graph {graph_index} could not be run on fake tensors to "
                        f"find its splitting ops and written inputs ({type(error).__name__}: "
                        f"{error}); it runs without device graphs")
        return compile(gm, example_inputs, key=key), spec
    signature = signature_of(gm, backend.dynamic_dims, backend.pad_values, findings.written, example_inputs,
                             findings.mixing)
    unsafe = findings.splitting_nodes
    if unsafe and mode == "full":
        reasons = "; ".join(sorted(set(unsafe.values())))
        report.fallback(FallbackKind.NO_DEVICE_GRAPH,
                        f"use_cudagraph: cudagraph_mode='full' and graph {graph_index} has ops a "
                        f"device graph cannot replay, so it runs without one: {reasons}")
        return compile(gm, example_inputs, key=key), spec
    if not unsafe:
        if isinstance(spec, GraphSpec):
            spec.signature = signature
        return runner_of(backend, compile(gm, example_inputs, key=key), signature, key), spec
    runner = _piecewise(backend, gm, example_inputs, unsafe, compile, signature, key, graph_index)
    return runner, "it is split into pieces around ops a device graph cannot replay"


def runner_of(backend: Backend, compiled: Callable, signature: Signature, key: str | None) -> GraphRunner:
    """The runtime of an unsplit graph: one CapturedGraph, its device graphs in one pool."""
    config, report = backend.config, backend.report()
    record = report.piece(len(report.pieces), None)
    captured = CapturedGraph(compiled, record, config, report, Pool(config, backend.graph_pools),
                             signature.static)
    return GraphRunner(captured, signature, [captured], config, report, backend.callers, key, backend.replay_lock)


def _piecewise(backend: Backend, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], unsafe: dict,
               compile: Callable, signature: Signature, key: str | None, graph_index: int) -> GraphRunner:
    """`gm` split at its `unsafe` nodes: each safe piece compiled and captured, the
    others (and pieces reading a number an earlier piece computes) run as compiled."""
    config, report = backend.config, backend.report()
    split_gm, unsafe_pieces = piecewise.split(gm, unsafe)
    real = dict(zip([n.name for n in gm.graph.nodes if n.op == "placeholder"], example_inputs))
    captured = []
    pool = Pool(config, backend.graph_pools)

    def compile_piece(name: str, piece: torch.fx.GraphModule, fakes: list) -> Callable | None:
        inputs = [n.name for n in piece.graph.nodes if n.op == "placeholder"]
        # A number an earlier piece computes (`.item()`) changes every call: a capture would freeze it.
        numbers = [n for n, fake in zip(inputs, fakes) if not isinstance(fake, torch.Tensor) and n not in real]
        if numbers and name not in unsafe_pieces:
            unsafe_pieces[name] = f"it reads {numbers[0]}, a number computed at run time by an earlier piece"
        record = report.piece(graph_index, unsafe_pieces.get(name))
        if name in unsafe_pieces:
            return None
        # Top-level inputs are real (freezing and verify need values); intermediates stay fake.
        examples = [real.get(n, fake) for n, fake in zip(inputs, fakes)]
        # The graph's own inputs sit at fixed addresses; intermediates from eager pieces are copied in.
        wrapper = CapturedGraph(compile(piece, examples), record, config, report, pool,
                                static=[n in real for n in inputs])
        captured.append(wrapper)
        return wrapper

    piecewise.compile_pieces(split_gm, example_inputs, compile_piece)
    return GraphRunner(split_gm, signature, captured, config, report, backend.callers, key, backend.replay_lock)
