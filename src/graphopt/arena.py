"""Offsets of buffers in one arena: buffers whose lifetimes do not meet share bytes.

The `plan_memory` pass plans a graph's intermediates with it (`passes/memory_plan.py`)
and the host graph places the allocations it records (`runtime/host_graph.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# The CPU allocator's alignment (c10's gAlignment), and a cache line on the CPUs we serve.
ALIGN = 64
# Beyond this many buffers only the classic greedy order runs: each order costs O(n^2).
_MANY = 1500


@dataclass(frozen=True)
class Plan:
    offsets: tuple[int, ...]  # in the order the buffers were given; multiples of `align`
    nbytes: int               # the arena


def aligned(size: int, align: int = ALIGN) -> int:
    return -(-size // align) * align


def plan_offsets(buffers: Sequence[tuple[int, int, int]], align: int = ALIGN) -> Plan:
    """Offsets in one arena for buffers given as (first, last, size in bytes), where
    two buffers may share bytes only when their [first, last] ranges do not meet.

    Greedy by size: the largest buffer first, each into the lowest gap no buffer
    alive at the same time occupies. Two variants often do better on graphs with many
    small buffers (the best-fitting gap instead of the lowest; longest-lived first),
    so all three run and the smallest arena wins (classic on ties)."""
    spans = [(first, last) for first, last, _ in buffers]
    sizes = [aligned(size, align) for _, _, size in buffers]
    indices = range(len(buffers))
    by_size = sorted(indices, key=lambda i: (-sizes[i], spans[i][0]))
    candidates = [(by_size, False)]
    if len(buffers) <= _MANY:
        by_age = sorted(indices, key=lambda i: (spans[i][0] - spans[i][1], -sizes[i], spans[i][0]))
        candidates += [(by_size, True), (by_age, False)]
    best: Plan | None = None
    for order, best_fit in candidates:
        plan = _greedy(order, spans, sizes, best_fit)
        if best is None or plan.nbytes < best.nbytes:
            best = plan
    return best


def _greedy(order: Sequence[int], spans: list[tuple[int, int]], sizes: list[int], best_fit: bool) -> Plan:
    offsets = [0] * len(sizes)
    placed: list[int] = []
    for i in order:
        first, last = spans[i]
        if sizes[i] == 0:
            continue
        busy = sorted((offsets[j], offsets[j] + sizes[j]) for j in placed
                      if spans[j][0] <= last and first <= spans[j][1])
        top, chosen, chosen_gap = 0, None, None
        for start, stop in busy:
            gap = start - top
            if gap >= sizes[i] and (chosen is None or gap < chosen_gap):
                chosen, chosen_gap = top, gap
                if not best_fit:
                    break
            top = max(top, stop)
        offsets[i] = top if chosen is None else chosen
        placed.append(i)
    return Plan(tuple(offsets), max((o + s for o, s in zip(offsets, sizes)), default=0))


def live_bytes(buffers: Sequence[tuple[int, int, int]], align: int = ALIGN) -> int:
    """The most bytes alive at one moment: no plan can use a smaller arena."""
    events = sorted([(first, aligned(size, align)) for first, _, size in buffers] +
                    [(last + 1, -aligned(size, align)) for _, last, size in buffers])
    alive = peak = 0
    for _, change in events:  # at equal times frees (negative) sort first
        alive += change
        peak = max(peak, alive)
    return peak
