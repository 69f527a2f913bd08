"""Graph pools and the graph memory budget.

`Pool` is where a runner's device graphs capture into (pool modes 1 and 2).
`PoolShare` is what the graphs of one CapturedGraph hold of the pools, kept in
`report().pools`, and the one place `graph_memory_budget` is checked: before a
capture (scaled from the largest graph captured), and as the most a capture may grow
its pool by (a device graph raises PoolBudgetExceeded past it). A refused size runs
without a device graph until it is released.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..config import GraphOptimizationConfig
from ..report import BudgetRefusal, FallbackKind, Report
from .cuda_graph import CudaPool
from .device_graph import DeviceGraph, PoolBudgetExceeded
from .graphs import graph_pool_handle


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
            self.handle = CudaPool(device, self.handle)  # torch.cuda.graph_pool_handle()'s, held open
        return self.handle

    @property
    def nbytes(self) -> int:
        """A shared pool's size: a host pool knows its arena's; a CUDA pool is what
        its captures made the caching allocator reserve (graphs of one pool reuse its
        memory), at least its largest graph's, whichever runner or piece captured it."""
        if isinstance(getattr(self.handle, "nbytes", None), int):
            return self.handle.nbytes
        return max(self.cuda_bytes, self.largest_graph)


class PoolShare:
    """The device graphs of one CapturedGraph in their pool: which pool they capture
    into, the bytes they hold (`report.pools`), and whether one more fits the budget.
    It captures and runs nothing: CapturedGraph asks it before a capture (`fits`,
    `max_growth`) and tells it what each capture and release did."""

    def __init__(self, pool: Pool, config: GraphOptimizationConfig, report: Report, name: str):
        self.pool = pool
        self.budget = config.graph_memory_budget
        self.report = report
        self.name = name
        self.graphs: dict[int, tuple[int | None, DeviceGraph]] = {}  # id -> (capture size, graph)
        self.refused_sizes: set[int] = set()  # sizes the budget refused, until released

    def handle(self, device: torch.device) -> Any:
        """The pool handle a graph on `device` captures into (None: a pool of its own)."""
        return self.pool.get(device)

    def ids(self) -> list[int]:
        """The keys of `report.pools` this share holds bytes under."""
        return [id(self.pool.handle)] if self.pool.shared else list(self.graphs)

    def held(self) -> int:
        """Bytes these graphs' pools hold now."""
        return sum(self.report.pools.get(i, 0) for i in self.ids())

    def bytes_at(self, size: int) -> int:
        """What these graphs' pools would hold with a graph at `size` captured too: the
        largest graph captured, scaled by batch (its intermediates grow with it); the
        pool as it is before the first capture."""
        now = self.pool.nbytes if self.pool.shared else 0
        known = [(s, graph.nbytes) for s, graph in self.graphs.values() if s]
        if not known:
            return now
        largest, nbytes = max(known)
        estimate = math.ceil(nbytes * size / largest)
        return max(now, estimate) if self.pool.shared else sum(b for _, b in known) + estimate

    def fits(self, device: torch.device, size: int | None) -> bool:
        """Whether a graph at `size` on `device` may be captured: with it the pools
        would hold no more than the budget. A refusal is reported here."""
        self.pool = self.pool.on(device)
        limit = self._limit()
        if limit is None or self.bytes_at(size or 0) <= limit:
            return True
        self._refuse(size, self.bytes_at(size or 0), limit)
        return False

    def max_growth(self) -> int | None:
        """The most bytes a capture may grow this share's pool by (None: no budget)."""
        limit = self._limit()
        return None if limit is None else limit - self.held()

    def exceeded(self, size: int | None, over: PoolBudgetExceeded) -> None:
        """A capture grew past `max_growth()` and was dropped: report the refusal."""
        self._refuse(size, self.held() + over.needed, self.held() + over.available)

    def add(self, size: int | None, graph: DeviceGraph) -> None:
        self.graphs[id(graph)] = (size, graph)
        self.pool.cuda_bytes += graph.pool_growth
        self.pool.largest_graph = max(self.pool.largest_graph, graph.nbytes)
        self._account()

    def remove(self, graph: DeviceGraph) -> None:
        """Forget a graph that was reset (released, or captured again)."""
        self.graphs.pop(id(graph), None)
        self.report.pools.pop(id(graph), None)

    def released(self, size: int) -> None:
        """The graphs at `size` were let go: the budget may capture it again."""
        self.refused_sizes.discard(size)
        self._account()

    def _limit(self) -> int | None:
        """The bytes these graphs' pools may hold: the budget less every other pool's."""
        if self.budget is None:
            return None
        return self.budget - (self.report.pool_bytes - self.held())

    def _account(self) -> None:
        if self.pool.shared:
            self.report.pools[id(self.pool.handle)] = self.pool.nbytes
        else:
            self.report.pools.update({i: graph.nbytes for i, (_, graph) in self.graphs.items()})

    def _refuse(self, size: int | None, needed: int, available: int) -> None:
        self.refused_sizes.add(size)
        self.report.budget_refusals.append(BudgetRefusal(self.name, size, needed, available))
        self.report.fallback(FallbackKind.CAPTURE_REFUSED,
                             f"graph_memory_budget: capture of {self.name} at size {size} refused: the graph "
                             f"pools would hold {needed} bytes, {available} are left of the budget")


def pools_with(shares: list[PoolShare], report: Report, size: int) -> int:
    """What every graph pool would hold with the graphs of `shares` (one runner's
    pieces, which share one Pool) at `size` captured too."""
    own = {i for share in shares for i in share.ids()}
    others = report.pool_bytes - sum(report.pools.get(i, 0) for i in own)
    estimates = [share.bytes_at(size) for share in shares]
    shared = any(share.pool.shared for share in shares)
    return others + (max(estimates, default=0) if shared else sum(estimates))
