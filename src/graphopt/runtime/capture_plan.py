"""Capture sizes chosen from traffic (`cudagraph_capture_sizes="auto"`).

    batch sizes of the calls -> Traffic (a decayed histogram) -> plan() -> Plan(sizes, reasons)

The cost model counts rows of work (one row of one step), so that a plan depends
on the trace alone and never on timings:

- a step at batch `b` replayed at capture size `s` wastes `s - b` padded rows;
- a step without a device graph costs `STEP_OVERHEAD_ROWS` rows more than a replay
  (the launches and Python a replay saves);
- capturing size `s` costs `(warmups + 1) * (s + STEP_OVERHEAD_ROWS)`; a size
  already captured costs nothing more, so a plan does not drop it while it has traffic.

`plan()` picks, among the sizes seen, the set that costs least over the traffic
(a dynamic programme over the sorted sizes, each captured size serving those below
it by padding). A range that recurs spread over many sizes is planned over the last
`RANGE_WINDOWS` windows, since no single size in it pays; traffic decays at each
plan, and a captured size is held `HOLD_CAPTURED` plans longer, since capturing it
again is what costs. The rules and their constants: docs/device-graphs.md,
"Capture sizes from traffic".
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

from ..config import GraphOptimizationConfig
from ..report import PlanRecord, Report

STEP_OVERHEAD_ROWS = 16  # a step without a graph, over a replay, in rows of work (see docs/device-graphs.md)
DECAY = 0.5              # what a plan keeps of the traffic before it
FORGET_BELOW = 0.25      # a size seen once is forgotten after three plans without it
HOLD_CAPTURED = 6        # plans a captured size is held beyond that (the serving trace: 11 captures -> 5)
RANGE_WINDOWS = 12       # windows of calls a recurring range is judged on: enough for a capture to pay
RANGE_SIZES = 3          # distinct sizes that make steps above the plan a range (one size recurs by itself)

_warming = contextvars.ContextVar("graphopt_capture_calls", default=False)


@contextlib.contextmanager
def not_traffic() -> Iterator[None]:
    """Calls inside (`capture_all()`'s) are not traffic: not counted, never re-planned on."""
    token = _warming.set(True)
    try:
        yield
    finally:
        _warming.reset(token)


def is_traffic() -> bool:
    return not _warming.get()


@dataclass(frozen=True)
class Plan:
    sizes: tuple[int, ...]
    padded_rows: float      # expected over the traffic planned on
    eager_steps: float      # expected steps that run without a graph
    reasons: tuple[str, ...]


def plan(weights: Mapping[int, float], *, limit: int, warmups: int, padding: bool,
         captured: frozenset[int] = frozenset(), fits: Callable[[int], bool] = lambda size: True,
         history: Sequence[Mapping[int, int]] = ()) -> Plan:
    """The capture sizes for traffic `weights` ({batch: steps}) and the last windows of
    calls (`history`, oldest first); see the module docstring."""
    seen = sorted(weights)
    # A prefix of the sizes seen: the limit and a pool's size only grow with the batch.
    candidates = list(itertools.takewhile(lambda b: b <= limit and fits(b), seen))
    ranged: tuple[list[int], Counter] = ([], Counter())
    if padding:
        chosen = _cheapest_cover(candidates, weights, warmups, captured)
        ranged = _recurring_range(history, max(chosen, default=0), limit, fits, warmups, captured)
        chosen = sorted(set(chosen) | set(ranged[0]))
    else:
        chosen = [b for b in candidates
                  if weights[b] * STEP_OVERHEAD_ROWS >= _capture_rows(b, warmups, captured)]
    padded, eager = 0.0, 0.0
    for b in seen:
        target = next((s for s in chosen if s >= b), None) if padding else (b if b in chosen else None)
        if target is None:
            eager += weights[b]
        else:
            padded += weights[b] * (target - b)
    reasons = _reasons(seen, chosen, weights, limit, fits, captured, padding, ranged)
    return Plan(tuple(chosen), padded, eager, tuple(reasons))


def _recurring_range(history: Sequence[Mapping[int, int]], top: int, limit: int, fits: Callable[[int], bool],
                     warmups: int, captured: frozenset[int]) -> tuple[list[int], Counter]:
    """(the sizes to capture for a range above `top` that recurs, its steps in the
    windows of `history`); nothing where no range recurs."""
    counts: Counter = Counter()
    windows = 0
    for window in history:
        above = {b: n for b, n in window.items() if top < b <= limit}
        counts.update(above)
        windows += bool(above)
    if windows < 2 or len(counts) < RANGE_SIZES:
        return [], Counter()
    sizes = list(itertools.takewhile(fits, sorted(counts)))
    return _cheapest_cover(sizes, counts, warmups, captured), counts


def _capture_rows(size: int, warmups: int, captured: frozenset[int]) -> float:
    return 0.0 if size in captured else (warmups + 1) * (size + STEP_OVERHEAD_ROWS)


def _cheapest_cover(sizes: list[int], weights: Mapping[int, float], warmups: int,
                    captured: frozenset[int]) -> list[int]:
    """best[j]: the least cost of serving sizes[:j] with sizes[j-1] captured; the
    sizes above the last captured one run without a graph."""
    n = len(sizes)
    w = [weights[b] for b in sizes]
    steps, rows = [0.0], [0.0]  # prefix sums of steps and of steps x batch
    for b, wb in zip(sizes, w):
        steps.append(steps[-1] + wb)
        rows.append(rows[-1] + wb * b)
    total_steps = sum(weights.values())
    best, previous = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        top = sizes[j - 1]
        capture = _capture_rows(top, warmups, captured)
        for i in range(j):
            cost = best[i] + top * (steps[j] - steps[i]) - (rows[j] - rows[i]) + capture
            if cost < best[j]:
                best[j], previous[j] = cost, i
    # Every step not served up to sizes[j-1] (sizes above it, and sizes not candidates) runs without a graph.
    totals = [best[j] + (total_steps - steps[j]) * STEP_OVERHEAD_ROWS for j in range(n + 1)]
    j = min(range(n + 1), key=lambda k: (totals[k], k))
    chosen = []
    while j:
        chosen.append(sizes[j - 1])
        j = previous[j]
    return sorted(chosen)


def _reasons(seen: list[int], chosen: list[int], weights: Mapping[int, float], limit: int,
             fits: Callable[[int], bool], captured: frozenset[int], padding: bool,
             ranged: tuple[list[int], Counter]) -> list[str]:
    reasons = []
    sizes, steps = ranged
    for size in sorted(captured - set(chosen)):
        why = ("its traffic has gone" if size not in weights else
               f"it is above max_num_seqs={limit}" if size > limit else
               "its pool would not fit graph_memory_budget" if not fits(size) else
               "its steps cost less padded to a larger size")
        reasons.append(f"release {size}: {why}")
    for size in chosen:
        if size in sizes:
            reasons.append(f"{'keep' if size in captured else 'capture'} {size}: it covers a recurring range, "
                           f"{sum(steps.values())} steps at sizes {_span(sorted(steps))} in the latest windows")
        elif size not in captured:
            reasons.append(f"capture {size}: {weights[size]:.1f} steps at it")
    over = [b for b in seen if b > limit]
    if over:
        reasons.append(f"sizes {_span(over)} run without a graph: above max_num_seqs={limit}")
    unfit = [b for b in seen if b <= limit and not fits(b)]
    if unfit:
        reasons.append(f"sizes {_span(unfit)} run without a graph: their pool would not fit graph_memory_budget")
    rest = [b for b in seen if b <= limit and fits(b) and b not in chosen]
    if rest:
        top = max(chosen, default=0)
        padded = [b for b in rest if b < top] if padding else []
        eager = [b for b in rest if b not in padded]
        if padded:
            reasons.append(f"sizes {_span(padded)} pad to the next capture size: cheaper than a capture each")
        if eager:
            reasons.append(f"sizes {_span(eager)} run without a graph: too few steps to pay for a capture")
    return reasons


def _span(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{sizes[0]}..{sizes[-1]} ({len(sizes)} sizes)"


@dataclass
class Traffic:
    """The batch sizes of one graph's calls: decayed weights (what plans read) and
    every call counted (the histogram `report()` shows)."""

    weights: dict[int, float] = field(default_factory=dict)
    seen: Counter = field(default_factory=Counter)
    window: Counter = field(default_factory=Counter)
    history: deque = field(default_factory=lambda: deque(maxlen=RANGE_WINDOWS))  # the last windows' calls
    returns: Counter = field(default_factory=Counter)  # times a size came back after it was forgotten

    def observe(self, batch: int) -> None:
        self.window[batch] += 1
        if self.seen[batch] and batch not in self.weights and self.window[batch] == 1:
            self.returns[batch] += 1
        self.seen[batch] += 1

    def fold(self, captured: frozenset[int] = frozenset()) -> dict[int, float]:
        """Decay the weights, add the window's calls, forget what has faded (a
        `captured` size, planned before, later); the new weights."""
        weights = {b: w * DECAY for b, w in self.weights.items()}
        for b, n in self.window.items():
            weights[b] = weights.get(b, 0.0) + n
        self.weights = {b: w for b, w in sorted(weights.items())
                        if w >= self.forget_below(b) * (DECAY ** HOLD_CAPTURED if b in captured else 1)}
        self.history.append(self.window)
        self.window = Counter()
        return self.weights

    def forget_below(self, batch: int) -> float:
        """The weight under which `batch` is forgotten: after 3 plans without it, then
        6, 12, ... plans for each time it came back."""
        return FORGET_BELOW * DECAY ** (3 * (2 ** self.returns[batch] - 1))


class TrafficStore:
    """A graph's traffic weights in the compile cache, under its key, so that a new
    process plans (and `capture_all()` captures) the same sizes before any call."""

    def __init__(self, cache_dir: str | None, graph_key: str | None, report: Report):
        self.disk = self.key = None
        if cache_dir is not None and graph_key is not None:
            from .. import cache

            self.disk = cache.CompileCache(cache_dir, report)
            self.key = cache.cache_key("capture traffic", graph_key)

    def load(self) -> dict[int, float]:
        stored = self.disk.load(self.key) if self.disk is not None else None
        return {int(b): float(w) for b, w in stored.items()} if isinstance(stored, dict) else {}

    def store(self, weights: dict[int, float]) -> None:
        if self.disk is not None:
            self.disk.store(self.key, dict(weights))


class Planner:
    """The capture plan of one GraphRunner: its traffic, its current sizes, and
    when to plan again (every `capture_replan_interval` calls, a quarter of that
    while no size is planned; the runner calls `observe` before it dispatches,
    never while a graph replays)."""

    def __init__(self, config: GraphOptimizationConfig, record: PlanRecord, store: TrafficStore, padding: bool,
                 pool_bytes_at: Callable[[int], int]):
        """`pool_bytes_at(size)`: the bytes every graph pool would hold with this
        runner's graph at `size` captured too (the budget's measure)."""
        self.config, self.record, self.store, self.padding = config, record, store, padding
        self.pool_bytes_at = pool_bytes_at
        self.traffic = Traffic(weights=store.load())
        self.calls = 0
        self.refused_from: int | None = None  # the smallest size whose capture the budget refused
        self.plan = Plan((), 0.0, 0.0, ())
        if self.traffic.weights:  # a stored histogram: plan now, so capture_all() can capture it
            self._replan()

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.plan.sizes

    def observe(self, batch: int) -> list[int] | None:
        """Count a call; at a re-plan, the sizes the new plan releases (else None)."""
        self.traffic.observe(batch)
        self.calls += 1
        interval = self.config.capture_replan_interval
        # Before anything is planned every call runs without a graph: plan four times as often.
        if self.calls % (interval if self.plan.sizes else max(interval // 4, 1)):
            return None
        self.traffic.fold(frozenset(self.plan.sizes))
        self.store.store(self.traffic.weights)
        return self._replan()

    def refused(self, size: int) -> None:
        """The budget refused a capture at `size`: no plan captures it, or a larger one, again."""
        self.refused_from = size if self.refused_from is None else min(size, self.refused_from)

    def fits(self, size: int) -> bool:
        if self.refused_from is not None and size >= self.refused_from:
            return False
        budget = self.config.graph_memory_budget
        return budget is None or self.pool_bytes_at(size) <= budget

    def _replan(self) -> list[int]:
        old = frozenset(self.plan.sizes)
        self.plan = plan(self.traffic.weights, limit=self.config.max_num_seqs, padding=self.padding,
                         warmups=max(self.config.cudagraph_num_of_warmups, 1), captured=old, fits=self.fits,
                         history=self.traffic.history)
        released = sorted(old - set(self.plan.sizes))
        record = self.record
        record.sizes, record.reasons = list(self.plan.sizes), list(self.plan.reasons)
        record.expected_padded_rows = round(self.plan.padded_rows, 1)
        record.replans += 1
        record.released += len(released)
        return released
