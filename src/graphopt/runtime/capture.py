"""CapturedGraph: warm-ups, capture and replay of one compiled callable, one device
graph per capture point.

It is called with the arguments the graph should read, and the capture point (the
capture size and any other symbol's value) comes from the GraphRunner: as
`run_at()`'s argument for a graph of one piece, through `running_at()` for the
pieces of a split graph. Without a point it just runs the callable, which is how the
runner's first call and its fallbacks run.

Per capture point: `cudagraph_num_of_warmups` warm-up runs (at least one), the call
that captures, then replays. The first run of any point is the capture-safety scan
(`analysis/safety.scan`): an op a device graph cannot replay, or outputs that require
grad, refuse capture for good, with the reason in the report.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .._compat.names import tensor_leaves
from ..config import GraphOptimizationConfig
from ..report import CaptureRecord, FallbackKind, PieceRecord, Report
from .analysis.safety import scan
from .device_graph import DeviceGraph, PoolBudgetExceeded
from .graph_outputs import GraphOutputs, layouts
from .graphs import device_graph, warmup_stream
from .pool import Pool, PoolShare
from .ranks import Ranks
from .static_inputs import CapturedInputs

_point: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("graphopt_capture_point", default=None)


class running_at:
    """Run the captured graphs called inside at `point`: (capture size, other symbols).
    A class, not a generator: it is entered on every replay, and a generator's
    context manager costs more per call (docs/design.md, "The replayed call")."""

    __slots__ = ("point", "token")

    def __init__(self, point: tuple):
        self.point = point

    def __enter__(self) -> None:
        self.token = _point.set(self.point)

    def __exit__(self, *exc: Any) -> None:
        _point.reset(self.token)


@dataclass
class _Entry:
    warmups_left: int
    graph: DeviceGraph | None = None
    replay: Callable[[], None] | None = None  # graph.replayer, bound at capture
    inputs: CapturedInputs | None = None      # what the capture read, and how a call's arguments replace it
    outputs: Any = None                       # what every replay writes
    layouts: list = field(default_factory=list)  # the last warm-up's outputs (graph_outputs.layouts)
    refused: bool = False                     # graph_memory_budget refused its capture


class CapturedGraph:
    """Warms up, captures and replays one callable at each capture point. It owns no
    buffers and does no padding (`StaticInputs` and `CapturedInputs` copy inputs, the
    runner pads), does not choose sizes (the dispatcher does), nor decide whether a
    capture fits the memory budget (`PoolShare`), whether the ranks agree (`Ranks`)
    or whether the callable is safe to capture (`safety.scan`): it asks them, and
    where one says no, runs the callable instead."""

    def __init__(self, fn: Callable, record: PieceRecord, config: GraphOptimizationConfig, report: Report,
                 pool: Pool, static: list[bool]):
        """`static[i]`: argument i must be the captured tensor itself (rebound or
        captured again when it is a new one)."""
        self.fn = fn
        self.static = static
        self.record = record
        self.name = record.name
        self.config = config
        self.report = report
        self.share = PoolShare(pool, config, report, record.name)
        self.warmups = max(config.cudagraph_num_of_warmups, 1)
        self.entries: dict[tuple, _Entry] = {}
        self.ranks: Ranks | None = None  # set by the scan: None until the first run
        self.refused: str | None = None  # why no point of this callable is ever captured
        self.owns_outputs = False  # the last call's outputs live in a device graph's memory
        self.replayed = False  # the last call replayed a device graph
        self.graph_outputs = GraphOutputs()  # CUDA graphs of a shared pool: their outputs' blocks

    def __call__(self, *args: Any) -> Any:
        return self.run_at(_point.get(), args)

    def run_at(self, point: tuple | None, args: Sequence[Any]) -> Any:
        """A call at `point` (None: just run the callable): `__call__` with the point of `running_at()`."""
        self.owns_outputs = self.replayed = False
        if point is None or self.refused is not None:
            return self.fn(*args)
        entry = self.entries.get(point)
        if entry is None:
            entry = self.entries[point] = _Entry(self.warmups)
        if entry.refused:
            return self.fn(*args)
        if entry.graph is not None:
            recapture = entry.inputs.take(args, entry.graph, self.report)
            if recapture is None:
                entry.replay()
                self.report.replays += 1
                self.record.replays += 1
                self.owns_outputs = self.replayed = True
                return entry.outputs
            self._drop(entry.graph)
            self.entries[point] = entry = _Entry(self.warmups)
            self.report.recaptures += 1
            self.report.recapture_reasons[f"{self.name}: {recapture}"] += 1
        if self.ranks is None:
            return self._first_run(entry, args)
        if entry.warmups_left > 0:
            entry.warmups_left -= 1
            with warmup_stream(_device(args)):
                outputs = self.fn(*args)
            entry.layouts = layouts(outputs, args)
            return outputs
        return self._capture(point, entry, args)

    def _first_run(self, entry: _Entry, args: Sequence[Any]) -> Any:
        """A warm-up that is also the capture-safety scan."""
        with warmup_stream(_device(args)):
            found = scan(self.fn, args)
        self.ranks = Ranks(found.groups)
        entry.warmups_left -= 1
        entry.layouts = layouts(found.outputs, args)
        if found.refusal is not None:
            self._refuse(found.refusal)
        return found.outputs

    def _capture(self, point: tuple, entry: _Entry, args: tuple) -> Any:
        start = time.perf_counter()
        device = _device(args)
        if not self.share.fits(device, point[0]):
            entry.refused = True
            return self.fn(*args)
        graph = device_graph(device, self.config.capture_error_mode, self.share.handle(device))
        inputs = CapturedInputs(args, self.static, graph.rebinds)
        outputs, error = self._record(graph, entry, inputs.args, device)
        if self.ranks.groups:  # every rank hears of every capture before anyone raises or replays
            refusal = self.ranks.refusal(point[0] or 0, error)
            if refusal is not None:
                graph.reset()
                return self._refuse_for_good(refusal, error, outputs, args, graph.executes_during_capture)
        elif isinstance(error, PoolBudgetExceeded):
            self.share.exceeded(point[0], error)
            entry.refused = True
            return outputs if graph.executes_during_capture else self.fn(*args)
        if error is not None:
            raise error
        if not graph.executes_during_capture:
            graph.replay()  # a CUDA capture records without running
        if graph.replay_fallback:
            self.report.fallback(FallbackKind.SLOW_REPLAY,
                                 f"use_cudagraph: host graphs replay from Python (~3 us more per op): "
                                 f"{graph.replay_fallback}")
        entry.graph, entry.replay, entry.inputs, entry.outputs = graph, graph.replayer, inputs, outputs
        self.owns_outputs = True
        self.record.captures += 1
        self.share.add(point[0], graph)
        self.report.captures.append(CaptureRecord(point[0], graph.nbytes, time.perf_counter() - start, self.name))
        return outputs

    def _record(self, graph: DeviceGraph, entry: _Entry, args: tuple,
                device: torch.device) -> tuple[Any, BaseException | None]:
        """Run the callable into `graph`: (its outputs, None), or (what it returned
        before the capture failed, the error) with the graph aborted."""
        copy_out = self.share.pool.shared and not graph.executes_during_capture
        if copy_out:
            self.graph_outputs.reserve(entry.layouts, device)
        outputs = None
        graph.capture_begin()
        try:
            outputs = self.fn(*args)
            if copy_out:
                outputs = self.graph_outputs.copy_out(outputs, entry.layouts)
            graph.capture_end(tensor_leaves(outputs), max_growth=self.share.max_growth())
        except BaseException as error:  # noqa: BLE001 - handed back: the ranks must hear of it first
            graph.abort()
            return outputs, error
        return outputs, None

    def release(self, size: int) -> None:
        """Let go of the device graphs at capture size `size`: reset, their memory
        back to the pool (a host arena shrinks to what the other graphs need)."""
        for point in [p for p in self.entries if p[0] == size]:
            graph = self.entries.pop(point).graph
            if graph is not None:
                self._drop(graph)
        self.share.released(size)

    def _drop(self, graph: DeviceGraph) -> None:
        graph.reset()
        self.share.remove(graph)

    def _refuse(self, reason: str) -> None:
        self.refused = reason
        self.report.fallback(FallbackKind.CAPTURE_REFUSED, f"use_cudagraph: capture of {self.name} refused: {reason}")

    def _refuse_for_good(self, reason: str, error: BaseException | None, outputs: Any, args: tuple,
                         executed: bool) -> Any:
        """A rank's capture failed: every rank drops its graphs and runs the callable
        from now on. This call's result is the capture's run where it completed
        (a host graph runs the step as it records it), else an eager run."""
        self._refuse(reason)
        for entry in self.entries.values():  # sizes captured before: never replayed again
            if entry.graph is not None:
                entry.graph.reset()
        if not executed:
            return self.fn(*args)
        if error is not None and outputs is None:
            raise error  # the step itself raised part-way: there is no result to give
        return outputs


def _device(args: Sequence[Any]) -> torch.device:
    return next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
