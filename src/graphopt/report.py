"""What an optimized model did: its graphs, the passes that ran on them, compile
times, and every fallback with its kind and reason. `OptimizedModule.report()` returns one."""

from __future__ import annotations

import enum
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .report_text import render

log = logging.getLogger("graphopt")


class FallbackKind(enum.Enum):
    """What fell back, one kind per consequence: tests and tools count kinds
    (`Report.fallback_counts`), people read the reason beside each."""

    NO_DEVICE_GRAPH = "no_device_graph"    # a graph, or some of its batches, runs without device graphs
    CAPTURE_REFUSED = "capture_refused"    # a capture was refused or failed: that piece runs directly
    EXACT_SIZE = "exact_size"              # batches are captured at their exact size, not padded
    SLOW_REPLAY = "slow_replay"            # a host graph replays from Python, not from C++
    LEVEL = "level"                        # a graph runs at another graph_opt_level than the one asked
    IN_FOREGROUND = "in_foreground"        # "auto": level 2 compiled during the first call, not in a child
    EAGER = "eager"                        # Dynamo gave up and runs a frame eagerly
    GUARDS = "guards"                      # the guards setting is not applied: Dynamo checks every guard
    PASS_UNDONE = "pass_undone"            # a pass broke the graph and was undone for it
    PRECISION = "precision"                # lower precision not applied, or undone: full precision runs
    UNCHECKED = "unchecked"                # a check was skipped: verify, or precision's measured error
    NOT_FROZEN = "not_frozen"              # freeze_parameters: parameters stay live inputs
    EXECUTOR = "executor"                  # an executor refused a graph: graphopt's compiled code runs it
    CACHE_OFF = "cache_off"                # the compile cache is not used: nothing loaded or stored
    CACHE_NOT_LOADED = "cache_not_loaded"  # a stored entry is not used: the graph is compiled again
    CACHE_NOT_STORED = "cache_not_stored"  # a graph is not stored: every process compiles it again
    TRACE_NOT_STORED = "trace_not_stored"  # a Dynamo trace is not stored: later processes trace again
    TRACE_NOT_USED = "trace_not_used"      # a stored Dynamo trace is not run: the step is traced again


@dataclass
class PassRecord:
    """One pass run on one graph."""

    graph: int
    name: str
    changed: bool
    counts: dict[str, int]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"graph": self.graph, "name": self.name, "changed": self.changed,
                "counts": dict(self.counts), "seconds": round(self.seconds, 6)}


def first_line(error: BaseException) -> str:
    """The first line of an error's message ("" when it has none): a reason fits on one
    report line, and many errors (a compiler's, a lint's) go on for pages."""
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


@dataclass
class GraphRecord:
    """One graph compiled for the model (Dynamo may compile several: graph breaks,
    a specialised batch size 1)."""

    index: int
    level: int = 1            # the level it was compiled at (with graph_opt_level="auto", one record per level)
    nodes_before: int = 0
    nodes_after: int = 0
    compile_seconds: float = 0.0
    fused_ops: dict[str, int] = field(default_factory=dict)  # fused op -> how many the final graph has
    cache_hit: bool = False   # loaded from the compile cache: the records are those of the stored compile
    traced: bool = True       # Dynamo traced it in this process (False: a stored trace, traces.py, ran it)
    gemms: dict[str, str] = field(default_factory=dict)  # level 2: each autotuned GEMM -> the kernel chosen, timed
    # compute_dtype: the error measured against full precision (passes/precision.py measured_error)
    precision: dict[str, Any] = field(default_factory=dict)
    # The bytes of the weights the graph holds beyond the model's parameters (folded, packed,
    # quantized): "new", computed for it; "shared", another graph's (passes/shared_weights.py).
    weight_bytes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "level": self.level, "nodes_before": self.nodes_before,
                "nodes_after": self.nodes_after, "compile_seconds": round(self.compile_seconds, 3),
                "fused_ops": dict(self.fused_ops), "cache_hit": self.cache_hit, "traced": self.traced,
                "gemms": dict(self.gemms), "precision": dict(self.precision), "weight_bytes": dict(self.weight_bytes)}


@dataclass
class CaptureRecord:
    """One device graph captured for one capture size (None: a graph without a batch)."""

    size: int | None
    nbytes: int
    seconds: float
    piece: str = ""  # which graph (and piece) it belongs to

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "bytes": self.nbytes, "capture_seconds": round(self.seconds, 3),
                "piece": self.piece}


@dataclass
class PieceRecord:
    """One piece of a graph the runtime runs: captured in device graphs, or run
    between replays (`split_reason` says why the graph was split there)."""

    graph: int
    index: int
    split_reason: str | None = None   # None: a captured piece
    captures: int = 0
    replays: int = 0

    @property
    def name(self) -> str:
        return f"graph {self.graph}" + (f" piece {self.index}" if self.index or self.split_reason else "")

    def to_dict(self) -> dict[str, Any]:
        return {"graph": self.graph, "index": self.index, "captured": self.split_reason is None,
                "split_reason": self.split_reason, "captures": self.captures, "replays": self.replays}


@dataclass
class MemoryRecord:
    """The arena plan of one graph's intermediates (`passes/memory_plan.py`), in bytes
    (64-byte aligned), at the sizes its symbols had when traced (`sizes`, e.g. the batch)."""

    graph: int
    buffers: int
    naive_bytes: int           # every intermediate its own buffer
    planned_bytes: int         # one arena shared by lifetime
    live_bytes: int            # the most alive at once: no arena can be smaller
    largest_buffer_bytes: int
    sizes: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {"graph": self.graph, "buffers": self.buffers, "naive_bytes": self.naive_bytes,
                "planned_bytes": self.planned_bytes, "live_bytes": self.live_bytes,
                "largest_buffer_bytes": self.largest_buffer_bytes, "sizes": dict(self.sizes)}


@dataclass
class PlanRecord:
    """The capture plan of one runtime graph with `cudagraph_capture_sizes="auto"`
    (`runtime/capture_plan.py`): its traffic and the sizes chosen from it."""

    graph: int
    histogram: Counter = field(default_factory=Counter)  # batch size -> calls
    sizes: list[int] = field(default_factory=list)       # the capture sizes of the last plan
    reasons: list[str] = field(default_factory=list)     # why the last plan chose them
    expected_padded_rows: float = 0.0                    # what the last plan expects from its traffic
    replans: int = 0
    released: int = 0                                    # sizes let go since their traffic went

    def to_dict(self) -> dict[str, Any]:
        return {"graph": self.graph, "histogram": dict(sorted(self.histogram.items())), "sizes": list(self.sizes),
                "reasons": list(self.reasons), "expected_padded_rows": self.expected_padded_rows,
                "replans": self.replans, "released": self.released}


@dataclass
class BudgetRefusal:
    """A capture graph_memory_budget refused: the bytes the pools would have held, and the budget's room."""

    piece: str
    size: int | None
    needed: int
    available: int

    def to_dict(self) -> dict[str, Any]:
        return {"piece": self.piece, "size": self.size, "needed": self.needed, "available": self.available}


@dataclass
class Report:
    level: int | str  # graph_opt_level: 0, 1, 2 or "auto"
    graphs: list[GraphRecord] = field(default_factory=list)
    passes: list[PassRecord] = field(default_factory=list)
    fallbacks: Counter = field(default_factory=Counter)               # reason -> count
    fallback_kinds: dict[str, FallbackKind] = field(default_factory=dict)  # reason -> its kind
    capture_sizes: list[int] = field(default_factory=list)
    captures: list[CaptureRecord] = field(default_factory=list)
    pieces: list[list[PieceRecord]] = field(default_factory=list)   # per runtime graph, its pieces
    pools: dict[int, int] = field(default_factory=dict)              # bytes of each graph pool
    batches: dict[int, str] = field(default_factory=dict)            # per runtime graph: its batch, and padding
    recaptures: int = 0
    recapture_reasons: Counter = field(default_factory=Counter)  # "graph 1: input 10 is a new tensor and ..."
    rebinds: int = 0          # new tensors in a static input's place that a device graph took without a capture
    replays: int = 0
    recompiles: int = 0       # graphs Dynamo compiled again after a guard failed
    recompile_reasons: Counter = field(default_factory=Counter)  # the guard that failed, as Dynamo says it
    steps: int = 0            # calls of the runtime graphs (capture_all()'s not counted)
    steps_replayed: int = 0   # of those, calls whose every captured piece replayed
    padded_rows: int = 0      # rows added to batches to reach their capture size
    held_copies: int = 0      # outputs still held at the next replay, copied out before it overwrote them
    plans: list[PlanRecord] = field(default_factory=list)
    budget_refusals: list[BudgetRefusal] = field(default_factory=list)
    cache_hits: int = 0       # graphs loaded from the compile cache (cache.py)
    cache_misses: int = 0     # graphs the cache did not have (or had broken): compiled and stored
    cache_rebuilt: int = 0    # of those misses, broken entries that were removed and rebuilt
    traces_stored: int = 0    # Dynamo traces of the step stored for later processes (traces.py)
    traces_used: int = 0      # stored traces this process ran instead of tracing the step
    repacks: int = 0          # level-2 graphs refresh() compiled again for Inductor's copies of the weights
    # With freeze_parameters: refreshes run before a call because a frozen weight changed, by what changed.
    weight_refreshes: Counter = field(default_factory=Counter)
    memory: list[MemoryRecord] = field(default_factory=list)
    # The `executors` choice per graph: {"graph", "executor" (graphopt or the engine that runs it),
    # "reason" (why it did not qualify, or what was timed), "seconds" (median per call, each timed),
    # "precision" (a candidate below float32 -> its error against full precision, as GraphRecord's)}.
    executors: list[dict[str, Any]] = field(default_factory=list)
    # graph_opt_level="auto", per Dynamo graph: {"graph" (its first GraphRecord), "level" chosen (None
    # until its first call), "seconds" (median per call by level), "reason", "cached" (chosen before)}.
    level_choices: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # decisions made for the user: a key kept over a mode's
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def fallback(self, kind: FallbackKind, reason: str) -> None:
        """Count a fallback of `kind`; the first of each reason is logged, the rest only counted."""
        with self._lock:
            if reason not in self.fallbacks:
                log.warning("graphopt fallback (%s): %s", kind.value, reason)
            self.fallbacks[reason] += 1
            self.fallback_kinds[reason] = kind

    @property
    def fallback_counts(self) -> Counter:
        """FallbackKind -> how many fallbacks of that kind were counted."""
        counts: Counter = Counter()
        for reason, n in self.fallbacks.items():
            counts[self.fallback_kinds[reason]] += n
        return counts

    def fallbacks_since(self, before: Counter) -> list[tuple[FallbackKind, str, int]]:
        """(kind, reason, count) of the fallbacks counted since `before`, a copy of `fallbacks`."""
        return [(self.fallback_kinds[reason], reason, n) for reason, n in (self.fallbacks - before).items()]

    def reasons(self, kind: FallbackKind) -> list[str]:
        """The reasons of the fallbacks of `kind`, in the order they first came."""
        return [reason for reason, of in self.fallback_kinds.items() if of is kind]

    def weight_refresh(self, reason: str) -> None:
        """Count an automatic refresh (frozen_watch.py); the first of each reason is logged."""
        with self._lock:
            if reason not in self.weight_refreshes:
                log.info("graphopt: frozen weights changed (%s); refreshing before the call", reason)
            self.weight_refreshes[reason] += 1

    def piece(self, graph: int, split_reason: str | None) -> PieceRecord:
        """A new piece of runtime graph `graph` (graphs are numbered as they come)."""
        while len(self.pieces) <= graph:
            self.pieces.append([])
        record = PieceRecord(graph, len(self.pieces[graph]), split_reason)
        self.pieces[graph].append(record)
        return record

    def planned_sizes(self) -> list[int]:
        """With capture sizes "auto": every size some runner's plan captures."""
        return sorted({size for plan in self.plans for size in plan.sizes})

    @property
    def pool_bytes(self) -> int:
        return sum(self.pools.values())

    @property
    def capture_seconds(self) -> float:
        return sum(c.seconds for c in self.captures)

    @property
    def compile_seconds(self) -> float:
        return sum(g.compile_seconds for g in self.graphs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "graphs": [g.to_dict() for g in self.graphs],
            "passes": [p.to_dict() for p in self.passes],
            "compile_seconds": round(self.compile_seconds, 3),
            "fallbacks": dict(self.fallbacks),
            "fallback_counts": {kind.value: n for kind, n in self.fallback_counts.items()},
            "capture_sizes": list(self.capture_sizes),
            "captures": [c.to_dict() for c in self.captures],
            "pieces": [[p.to_dict() for p in graph] for graph in self.pieces],
            "batches": dict(self.batches),
            "pool_bytes": self.pool_bytes,
            "recaptures": self.recaptures,
            "recapture_reasons": dict(self.recapture_reasons),
            "rebinds": self.rebinds,
            "replays": self.replays,
            "recompiles": self.recompiles,
            "recompile_reasons": dict(self.recompile_reasons),
            "steps": self.steps, "steps_replayed": self.steps_replayed, "padded_rows": self.padded_rows,
            "held_copies": self.held_copies,
            "capture_seconds": round(self.capture_seconds, 3),
            "plans": [p.to_dict() for p in self.plans],
            "budget_refusals": [r.to_dict() for r in self.budget_refusals],
            "cache": {"hits": self.cache_hits, "misses": self.cache_misses, "rebuilt": self.cache_rebuilt,
                      "traces_stored": self.traces_stored, "traces_used": self.traces_used},
            "repacks": self.repacks,
            "weight_refreshes": dict(self.weight_refreshes),
            "memory": [m.to_dict() for m in self.memory],
            "executors": [dict(e) for e in self.executors],
            "level_choices": [dict(c) for c in self.level_choices],
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        return render(self)
