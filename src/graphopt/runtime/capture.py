"""CapturedGraph: capture and replay of one compiled callable, one device graph per capture point.

It owns no buffers and does no padding (the GraphRunner above it does): it is
called with the arguments the graph should read, and the capture point (the capture
size and any other symbol's value) comes from the GraphRunner: through `running_at()`
for the pieces of a split graph, as `run_at()`'s argument for a graph of one
piece. Without a point it just runs the callable, which is how the runner's first
call and its fallbacks run.

Per capture point: `cudagraph_num_of_warmups` warm-up runs (at least one), then the call
that captures, then replays. At replay, an argument whose address changed since
capture is copied into the captured one, unless it is a static argument
(parameter, buffer, written input), which the graph must read and write itself.
A static argument that is a new tensor of the same size, stride and dtype (the
KV cache of a new `generate()`) is rebound where the device graph can (a host
graph: `DeviceGraph.rebind`); otherwise (a CUDA graph, a new size, a parameter)
the graph is captured again, with the reason in `report().recapture_reasons`.
A host graph is captured on a private alias of each static argument that is not
a parameter, so that rebinding moves the alias and never the caller's tensor,
which keeps its memory and is not written again. The first run (any point)
checks the callable for ops a device graph cannot replay; one found refuses
capture for good, with the op and the user's line in the report; so do outputs
that require grad (a replay cannot rebuild their autograd history). It also notes
the process groups the callable communicates over: then each capture ends with
the ranks agreeing that every one of them captured (`ranks.py`), and if one
failed, every rank runs the callable without device graphs from then on.

With `graph_memory_budget`, a capture is refused, before it starts, when the
pools would hold more than the budget with it (scaled from the largest graph
captured); a host graph also checks its exact arena need before the arena grows,
a CUDA graph its pool's growth (`torch.cuda.memory_stats`) before it is kept. A
refused capture point runs the callable from then on, until `release()`.
"""

from __future__ import annotations

import contextvars
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .._compat.names import tensor_leaves
from ..config import GraphOptimizationConfig
from ..report import BudgetRefusal, CaptureRecord, FallbackKind, PieceRecord, Report
from .analysis.safety import CaptureGuard
from .device_graph import DeviceGraph, PoolBudgetExceeded, graph_pool_handle, warmup_stream
from .graph_outputs import GraphOutputs, layouts
from .ranks import ranks_captured

_RECORDS_AUTOGRAD = ("the step records autograd history (grad mode is on and its outputs require grad), "
                     "which a device graph cannot replay: call it under torch.inference_mode() or "
                     "torch.no_grad(), or give the parameters requires_grad=False")

_point: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("graphopt_capture_point", default=None)


class running_at:
    """Run the captured graphs called inside at `point`: (capture size, other symbols).
    A class, not a generator: it is entered on every replay, and a generator's
    context manager costs ~1 µs more per call."""

    __slots__ = ("point", "token")

    def __init__(self, point: tuple):
        self.point = point

    def __enter__(self) -> None:
        self.token = _point.set(self.point)

    def __exit__(self, *exc: Any) -> None:
        _point.reset(self.token)


class Pool:
    """The graph pool of one GraphRunner (mode 2), or the user's (mode 1), or none
    (each graph its own, `reuse_pool_in_same_graph=False`). `backend_pools` (device ->
    Pool) holds the pool every runner of one Backend captures CUDA graphs into (`on`)."""

    def __init__(self, config: GraphOptimizationConfig, backend_pools: dict[str, Pool] | None = None):
        self.handle = config.graph_pool
        self.shared = config.graph_pool is not None or config.reuse_pool_in_same_graph
        self.cuda_bytes = 0  # a CUDA pool's growth over its captures, from torch.cuda.memory_stats
        self.largest_graph = 0  # bytes of the largest graph captured into it
        self.backend_pools = backend_pools

    def on(self, device: torch.device) -> Pool:
        """The pool graphs on `device` capture into. The CUDA graphs of every runner of
        a Backend share one: they replay one at a time and hand their outputs out of
        the pool (graph_outputs.py), so the graph of a batch of 1 (Dynamo compiles a
        size of 1 on its own) reuses the blocks the larger sizes freed instead of
        reserving a pool of its own. Host graphs hand outputs out of their arena: a
        pool each runner."""
        if device.type != "cuda" or not self.shared or self.handle is not None or self.backend_pools is None:
            return self
        return self.backend_pools.setdefault(str(device), self)

    def get(self, device: torch.device) -> Any:
        if not self.shared:
            return None
        if self.handle is None:
            self.handle = graph_pool_handle(device)
        elif device.type == "cuda" and isinstance(self.handle, tuple):
            from .cuda_graph import CudaPool

            self.handle = CudaPool(device, self.handle)  # torch.cuda.graph_pool_handle()'s, held open
        return self.handle


@dataclass
class _Entry:
    warmups_left: int
    graph: DeviceGraph | None = None
    replay: Callable[[], None] | None = None           # graph.replayer, bound at capture
    inputs: list[tuple] = field(default_factory=list)  # (index, tensor the capture read, how a new one is taken)
    outputs: Any = None                               # what every replay writes
    layouts: list = field(default_factory=list)       # the last warm-up's outputs (graph_outputs.layouts)
    refused: bool = False                             # graph_memory_budget refused its capture


class CapturedGraph:
    def __init__(self, fn: Callable, record: PieceRecord, config: GraphOptimizationConfig, report: Report,
                 pool: Pool, static: list[bool]):
        """`static[i]`: argument i must be the captured tensor itself, else the
        graph is captured again."""
        self.fn = fn
        self.static = static
        self.record = record
        self.name = record.name
        self.config = config
        self.report = report
        self.pool = pool
        self.warmups = max(config.cudagraph_num_of_warmups, 1)
        self.entries: dict[tuple, _Entry] = {}
        self.checked = False
        self.refused: str | None = None
        self.groups: list[str] = []  # process groups the callable's collectives use
        self.owns_outputs = False  # the last call's outputs live in a device graph's memory
        self.replayed = False  # the last call replayed a device graph
        self.refused_sizes: set[int] = set()  # sizes graph_memory_budget refused
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
            recapture = self._bring_inputs(entry, args)
            if recapture is None:
                entry.replay()
                self.report.replays += 1
                self.record.replays += 1
                self.owns_outputs = self.replayed = True
                return entry.outputs
            entry.graph.reset()
            self.entries[point] = entry = _Entry(self.warmups)
            self.report.recaptures += 1
            self.report.recapture_reasons[f"{self.name}: {recapture}"] += 1
        if not self.checked:
            return self._first_run(point, args)
        if entry.warmups_left > 0:
            entry.warmups_left -= 1
            with warmup_stream(_device(args)):
                outputs = self.fn(*args)
            entry.layouts = layouts(outputs, args)
            return outputs
        return self._capture(point, entry, args)

    def _first_run(self, point: tuple, args: tuple) -> Any:
        """A warm-up that also finds, before any capture starts, what a device graph could not replay."""
        guard = CaptureGuard(collect=True)
        with warmup_stream(_device(args)), guard:
            outputs = self.fn(*args)
        self.checked = True
        self.groups = guard.groups
        self.entries[point].warmups_left -= 1
        self.entries[point].layouts = layouts(outputs, args)
        if guard.problems:
            first = guard.problems[0]
            self.refused = f"{first.op} at {first.location}: {first.message}"
        elif any(t.requires_grad for t in tensor_leaves(outputs)):
            # A replay rewrites the saved activations under the captured outputs' grad_fn,
            # so a backward through them would read another step's values.
            self.refused = _RECORDS_AUTOGRAD
        if self.refused is not None:
            self.report.fallback(FallbackKind.CAPTURE_REFUSED,
                                 f"use_cudagraph: capture of {self.name} refused: {self.refused}")
        return outputs

    def _capture(self, point: tuple, entry: _Entry, args: tuple) -> Any:
        start = time.perf_counter()
        device = _device(args)
        self.pool = self.pool.on(device)
        limit = self._pool_limit()
        if limit is not None and self.pool_bytes_at(point[0] or 0) > limit:
            return self._refuse_budget(point, entry, self.pool_bytes_at(point[0] or 0), limit, self.fn(*args))
        graph = DeviceGraph(device, self.config.capture_error_mode, self.pool.get(device))
        hows = [_how(a, static) for a, static in zip(args, self.static)]
        if graph.rebinds:
            args = tuple(_alias(a) if how == "rebind" else a for a, how in zip(args, hows))
        copy_out = self.pool.shared and not graph.executes_during_capture
        if copy_out:
            self.graph_outputs.reserve(entry.layouts, device)
        outputs, error = None, None
        graph.capture_begin()
        try:
            outputs = self.fn(*args)
            if copy_out:
                outputs = self.graph_outputs.copy_out(outputs, entry.layouts)
            graph.capture_end(tensor_leaves(outputs),
                              max_growth=None if limit is None else limit - self._own_bytes())
        except PoolBudgetExceeded as over:
            graph.abort()
            if not self.groups:  # with collectives, the ranks must hear of it first (below)
                ran = outputs if graph.executes_during_capture else self.fn(*args)
                return self._refuse_budget(point, entry, self._own_bytes() + over.needed, limit, ran)
            error = over
        except BaseException as caught:
            graph.abort()
            if not self.groups:
                raise
            error = caught  # the other ranks must hear of it before anyone raises or replays
        if self.groups and not ranks_captured(self.groups, point[0] or 0, error is not None):
            graph.reset()
            return self._refuse_on_every_rank(error, outputs, args, executed=graph.executes_during_capture)
        if error is not None:
            raise error
        if not graph.executes_during_capture:
            graph.replay()  # a CUDA capture records without running
        if graph.replay_fallback:
            self.report.fallback(FallbackKind.SLOW_REPLAY,
                                 f"use_cudagraph: host graphs replay from Python (~3 us more per op): "
                                 f"{graph.replay_fallback}")
        entry.graph, entry.replay, entry.outputs = graph, graph.replayer, outputs
        entry.inputs = [(i, a, how) for i, (a, how) in enumerate(zip(args, hows)) if isinstance(a, torch.Tensor)]
        self.owns_outputs = True
        self.record.captures += 1
        self.pool.cuda_bytes += graph.pool_growth
        self.pool.largest_graph = max(self.pool.largest_graph, graph.nbytes)
        self.report.captures.append(CaptureRecord(point[0], graph.nbytes, time.perf_counter() - start, self.name))
        self._account()
        return outputs

    def release(self, size: int) -> None:
        """Let go of the device graphs at capture size `size`: reset, their memory
        back to the pool (a host arena shrinks to what the other graphs need)."""
        for point in [p for p in self.entries if p[0] == size]:
            graph = self.entries.pop(point).graph
            if graph is not None:
                graph.reset()
                self.report.pools.pop(id(graph), None)
        self.refused_sizes.discard(size)
        self._account()

    def pool_bytes_at(self, size: int) -> int:
        """What this graph's pool would hold with a graph at `size` captured too:
        the largest graph captured, scaled by batch (its intermediates grow with
        it); the pool as it is before the first capture."""
        now = self._pool_bytes() if self.pool.shared else 0
        known = [(k[0], e.graph.nbytes) for k, e in self.entries.items() if e.graph is not None and k[0]]
        if not known:
            return now
        largest, nbytes = max(known)
        estimate = math.ceil(nbytes * size / largest)
        return max(now, estimate) if self.pool.shared else sum(b for _, b in known) + estimate

    def _pool_limit(self) -> int | None:
        """The bytes this graph's pools may hold: the budget less every other pool's."""
        budget = self.config.graph_memory_budget
        if budget is None:
            return None
        return budget - (self.report.pool_bytes - self._own_bytes())

    def _own_bytes(self) -> int:
        """Bytes this graph's pools hold now."""
        return sum(self.report.pools.get(i, 0) for i in self.pool_ids())

    def pool_ids(self) -> list[int]:
        if self.pool.shared:
            return [id(self.pool.handle)]
        return [id(e.graph) for e in self.entries.values() if e.graph is not None]

    def _account(self) -> None:
        if self.pool.shared:
            self.report.pools[id(self.pool.handle)] = self._pool_bytes()
        else:
            self.report.pools.update({id(e.graph): e.graph.nbytes for e in self.entries.values()
                                      if e.graph is not None})

    def _refuse_budget(self, point: tuple, entry: _Entry, needed: int, available: int, outputs: Any) -> Any:
        entry.refused = True
        self.refused_sizes.add(point[0])
        self.report.budget_refusals.append(BudgetRefusal(self.name, point[0], needed, available))
        self.report.fallback(FallbackKind.CAPTURE_REFUSED,
                             f"graph_memory_budget: capture of {self.name} at size {point[0]} refused: the graph "
                             f"pools would hold {needed} bytes, {available} are left of the budget")
        return outputs

    def _refuse_on_every_rank(self, error: BaseException | None, outputs: Any, args: tuple, executed: bool) -> Any:
        """A rank's capture failed: every rank drops its graph and runs the callable
        from now on. This call's result is the capture's run where it completed
        (a host graph runs the step as it records it), else an eager run."""
        where = f"here ({type(error).__name__}: {error})" if error is not None else "on another rank"
        self.refused = f"the capture failed {where}, so no rank of process groups {self.groups} replays it"
        self.report.fallback(FallbackKind.CAPTURE_REFUSED,
                             f"use_cudagraph: capture of {self.name} refused: {self.refused}")
        for entry in self.entries.values():  # sizes captured before: never replayed again
            if entry.graph is not None:
                entry.graph.reset()
        if not executed:
            return self.fn(*args)
        if error is not None and outputs is None:
            raise error  # the step itself raised part-way: there is no result to give
        return outputs

    def _bring_inputs(self, entry: _Entry, args: tuple) -> str | None:
        """Make the captured inputs hold this call's: copy in an argument that is
        not the captured tensor, rebind the graph to a static one that is new.
        Returns why the graph must be captured again instead, or None."""
        rebound = 0
        for i, captured, how in entry.inputs:
            value = args[i]
            if value.data_ptr() == captured.data_ptr():
                continue
            if how == "copy":
                captured.copy_(value)
                continue
            why = "it is a parameter" if how == "recapture" else entry.graph.rebind(captured, value)
            if why is not None:
                return f"input {i} is a new tensor and {why}"
            rebound += 1
        self.report.rebinds += rebound
        return None

    def _pool_bytes(self) -> int:
        """A shared pool's size: a host pool knows its arena's; a CUDA pool is what
        its captures made the caching allocator reserve (graphs of one pool reuse its
        memory), at least its largest graph's, whichever runner or piece captured it."""
        if isinstance(getattr(self.pool.handle, "nbytes", None), int):
            return self.pool.handle.nbytes
        return max(self.pool.cuda_bytes, self.pool.largest_graph)


def _how(value: Any, static: bool) -> str:
    """How a replay takes a new tensor in this argument's place: "copy" it into
    the captured one, "rebind" the graph to it, or "recapture". A parameter keeps
    being captured again: Dynamo's guards recompile for a reassigned one first,
    so this is rare, and an alias would not carry its `requires_grad`."""
    if not static or not isinstance(value, torch.Tensor):
        return "copy"
    return "recapture" if isinstance(value, torch.nn.Parameter) else "rebind"


def _alias(value: torch.Tensor) -> torch.Tensor:
    """A new tensor object on `value`'s memory, with its size, stride and offset:
    what the graph is captured on, so that a rebind moves it and not `value`."""
    with torch.inference_mode(value.is_inference()):
        return torch.empty(0, dtype=value.dtype, device=value.device).set_(
            value.untyped_storage(), value.storage_offset(), value.size(), value.stride())


def _device(args: tuple) -> torch.device:
    return next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
