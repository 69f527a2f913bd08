"""graph_opt_level="auto": each graph runs the level that is faster on it, by measurement.

    Dynamo graph -> level 1 runtime (FX code, device graphs as configured) \\  at the first call: each checked
                 -> level 2 runtime (Inductor's kernels)                   /  against eager, then timed on
                                                                              that call's inputs, interleaved;
                                                                              the faster serves every call after

With compute_dtype or weight_quantization, level 1's error against eager is its
lowering's, held to precision_tolerance when it compiled: the choice holds it to
CHOICE_SLACK times that, and level 2 to the bound itself against level 1's outputs
(_disagreement says why).

By default (level_choice="first_call") both levels compile in the graph's compile and
the choice is made in its first call, so the first output is the chosen level's: a
benchmark times what a server serves, and Inductor's caches keep level 2's code for the
next process. With level_choice="background", on the CPU, the first call compiles level
1 only and serves it. Level 2 starts at the second call (or at wait_for_background()):
this process traces it and runs the passes (with frozen weights, folding them: seconds
on a large model), its code is generated in a child process (_compat/background.py)
while level 1 serves, and the choice is made at the first call after the code arrived.
The first call then costs level 1's compile alone: on the ~1B decoder with frozen
weights 16 s, where level 2's tracing and passes made it 45 s. A child that fails hands
level 2 to this process, compiled in the call that finds out.

Level 1 wins where a step is bound by launches (a small decode step replayed as one
host graph), level 2 where it is bound by compute (convolutions, large GEMMs, long
sequences): no rule of thumb picks right on every model, the clock does. The choice,
with its figures, goes into the report and the compile cache: a later process compiles
only the chosen level.

The timed runs repeat the first call on its own inputs, so whatever the graph writes in
place (a KV cache) is put back before each run and before the call itself: the caller
sees one call's effect.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable, ContextManager, Sequence

import torch

from .._compat import background
from ..config import GraphOptimizationConfig
from ..passes import lowered_error, precision
from ..report import FallbackKind, Report, first_line
from . import candidates

LEVELS = (1, 2)
# Why a graph whose level is still to be chosen has no spec for a stored trace.
UNCHOSEN = "graph_opt_level='auto' chooses its level at its first call"
# Level 2 must beat level 1 by this much: level 1 compiles in seconds and replays as one
# device graph, so a tie is not worth Inductor's compile in every later process.
MARGIN = 0.97
ROUNDS, ROUND_SECONDS = 7, 0.02
# With compute_dtype or weight_quantization, how many times precision_tolerance a level may
# be from eager at the choice (_disagreement): a second sample of the lowering's error.
CHOICE_SLACK = 4.0
# A written input of at most this many bytes is copied at a graph's first call, so that a
# level 2 started later by wait_for_background() is traced and measured on that call's
# state: a cache's length counter that has run on to its end indexes past the cache. A
# larger one (the cache itself) is not: its copy would double it while level 2 waits, and
# its values index nothing.
SMALL_STATE_BYTES = 1 << 16
# The level 2 compiles running in child processes, and the choices whose level 2 is still
# to start, for wait_for_background().
_PENDING: weakref.WeakSet[background.BackgroundCompile] = weakref.WeakSet()
_UNSTARTED: weakref.WeakSet[LevelChoice] = weakref.WeakSet()


class LevelChoice:
    """What Dynamo runs for a graph compiled at both levels: at its first call, the
    levels whose outputs equal eager's are timed and the faster runs from then on.

    `clock` is read around each timed run (a test gives a fake one); `chosen` is called
    once with the finished record (the compile cache stores it). With `pending` (level 2's
    code still being generated in a child process), level 1 serves every call until it has
    arrived, and the first call after chooses. With `later` instead (level 2 not compiled
    yet: `start_level_2`), level 1 serves the first call and the second starts level 2;
    `in_process(inputs)` compiles level 2 in this process where the child's compile failed.
    `bound` is precision_bound()'s; `born`, when the graph's compile began. `released` is
    called with each level's runtime that will not serve (the Backend stops refreshing it:
    a frozen level 2 left behind would be compiled again at every weight update)."""

    def __init__(self, runtimes: dict[int, Callable], eager: Callable, stateful: list[int], record: dict[str, Any],
                 report: Report, chosen: Callable[[dict[str, Any]], None],
                 clock: Callable[[], float] = time.perf_counter, pending: background.BackgroundCompile | None = None,
                 bound: lowered_error.Bound | None = None,
                 released: Callable[[Callable], None] = lambda runtime: None,
                 later: Callable[[Sequence[Any] | None], tuple[Callable, background.BackgroundCompile]] | None = None,
                 in_process: Callable[[Sequence[Any]], Callable] | None = None, born: float | None = None):
        self.runtimes, self.eager, self.stateful = runtimes, eager, stateful
        self.record, self.report, self.chosen, self.clock = record, report, chosen, clock
        self.pending, self.bound, self.released = pending, bound, released
        # For the report: how long until the choice, from the start of the graph's compile.
        self.born = time.monotonic() if born is None else born
        self.run: Callable = self._first if pending is None else self._waiting
        self.later, self._starting, self.first_inputs = later, threading.Lock(), None
        self.in_process = in_process
        if later is not None:
            self.run = self._level_1_first
            _UNSTARTED.add(self)

    def __call__(self, *args: Any) -> Any:
        return self.run(*args)

    def _time(self, agreeing: dict[int, Callable], args: tuple, state: _State) -> dict[int, float]:
        """Each agreeing level's median seconds per call on the first call's inputs, state
        put back before every run; nothing to time with one level (or none)."""
        if len(agreeing) < 2:
            return {level: 0.0 for level in agreeing}
        return candidates.median_seconds(agreeing, args, ROUNDS, ROUND_SECONDS, state.restore, self.clock)

    def _level_1_first(self, *args: Any) -> Any:
        """The first call: level 1 serves it, the next one starts level 2 on its own inputs
        (a wait_for_background() before then, on this call's, small state as it was)."""
        self.first_inputs = [x.detach().clone() if i in self.stateful and x.nbytes <= SMALL_STATE_BYTES else x
                             for i, x in enumerate(args)]
        self.run = self._start_then_run
        return self.runtimes[1](*args)

    def _start_then_run(self, *args: Any) -> Any:
        self.start_level_2(args)
        return self.run(*args)

    def start_level_2(self, args: Sequence[Any] | None = None) -> None:
        """Compile level 2 now where it waits for the second call: traced and passed here on
        `args` (a call's, before it runs; else the first call's), its code generated in the
        child. One that fails leaves level 1 serving, and says why."""
        with self._starting:
            later, self.later = self.later, None
            if later is None:
                return
            _UNSTARTED.discard(self)
            inputs, self.first_inputs = (args if args is not None else self.first_inputs), None
            try:
                self.runtimes[2], self.pending = later(inputs)
            except Exception as error:  # noqa: BLE001 - Inductor failing on a graph must not fail the model
                self._level_1_for_good(_failed_to_compile(error))
                return
            _PENDING.add(self.pending)
            self.run = self._waiting

    def _level_1_for_good(self, why: str) -> None:
        _level_1_serves(self.report, self.record, why)
        if 2 in self.runtimes:
            self.released(self.runtimes[2])
        self.run, self.runtimes = self.runtimes[1], {}

    def _waiting(self, *args: Any) -> Any:
        """Level 1 while level 2's code is on its way; then the choice. Where the child's
        compile failed, this call compiles level 2 in this process (what compiles here
        must not be lost to the trip: the child sees a pickled graph), else level 1 serves
        for good."""
        if not self.pending.ready():
            return self.runtimes[1](*args)
        error = self.pending.why()
        if error is not None:
            why = f"level 2 failed to compile in the background ({error[:200]})"
            if not self._compiled_here(args, why):
                return self.run(*args)
        self.run = self._first
        return self._first(*args)

    def _compiled_here(self, args: tuple, why: str) -> bool:
        """After the child's failure `why`: level 2 compiled in this process on `args`,
        with a fallback that says so; or level 1 for good, and False."""
        self.released(self.runtimes.pop(2))
        if self.in_process is None:
            self._level_1_for_good(why)
            return False
        try:
            self.runtimes[2] = self.in_process(args)
        except Exception as again:  # noqa: BLE001 - Inductor failing on a graph must not fail the model
            self._level_1_for_good(f"{why}, and in this process ({type(again).__name__}: "
                                   f"{first_line(again)[:200]})")
            return False
        self.report.fallback(FallbackKind.IN_FOREGROUND, f"graph_opt_level='auto': {why}; level 2 of graph "
                             f"{self.record['graph']} was compiled in this process instead, during a call")
        return True

    def _first(self, *args: Any) -> Any:
        state = _State([args[i] for i in self.stateful])
        with torch.no_grad():
            expected, reference = _outputs(self.eager(*args)), "eager"
            agreeing, refused = {}, {}
            for level, runtime in sorted(self.runtimes.items()):
                state.restore()
                got, why = _disagreement(runtime, args, expected, self.bound, reference)
                if why is None:
                    agreeing[level] = runtime
                    if self.bound is not None:  # the lowering's own results (a copy: level 1's are replayed into)
                        expected, reference = [_copy(x) for x in got], f"level {level}"
                else:
                    refused[level] = why
                    self.report.fallback(FallbackKind.LEVEL,
                                         f"graph_opt_level='auto': level {level} of graph {self.record['graph']} "
                                         f"{why}; it is not a candidate")
            try:
                seconds = self._time(agreeing, args, state)
                reason = None
            except Exception as error:  # noqa: BLE001 - a run that passed its check may still fail when repeated
                reason = f"timing its levels failed ({type(error).__name__}: {first_line(error)[:200]})"
                self.report.fallback(FallbackKind.LEVEL,
                                     f"graph_opt_level='auto': graph {self.record['graph']}: {reason}")
                seconds = {level: 0.0 for level in agreeing if level == min(agreeing)}
        level = pick(seconds) if seconds else 0
        self.record.update(level=level, seconds={str(k): round(v, 7) for k, v in seconds.items()},
                           reason=reason or _reason(seconds, level, refused),
                           chosen_after_s=round(time.monotonic() - self.born, 1))
        self.chosen(self.record)
        state.restore()
        self.run = self.runtimes.get(level, self.eager)
        for other in (runtime for key, runtime in self.runtimes.items() if key != level):
            self.released(other)
        self.runtimes = {}  # the other level's graphs and device graphs are freed
        return self.run(*args)


def background_compile(level_choice: str, device: str,
                       cache_off: Callable[[], ContextManager]) -> Callable[[], ContextManager] | None:
    """Where level 2 compiles in the background (level_choice="background", on the CPU),
    the context it compiles in: the compile cache off (the code it would store arrives
    later). None where it compiles in the first call: by default, so that the first output
    is the chosen level's (a benchmark times what a server serves) and Inductor's caches
    keep level 2's code for the next process; and on CUDA, where the child would generate
    Inductor's CPU code only. Frozen graphs too: the child gets the constants the weights
    were folded into (its GEMM template packs them), not the weights, and a refresh()
    compiles level 2 again in this process, as without "auto"."""
    return cache_off if level_choice == "background" and device == "cpu" else None


def precision_bound(config: GraphOptimizationConfig, gm: torch.fx.GraphModule) -> lowered_error.Bound | None:
    """How far a level's outputs may be from eager's: None, config.py's tolerances for the
    model's dtype; with compute_dtype or weight_quantization, the error precision_tolerance
    allows (each level's lowering was measured and held to it at compile time), judged as
    the lowering was: by the logits' KL where `gm` (Dynamo's graph) has logits."""
    if config.compute_dtype is None and config.weight_quantization is None:
        return None
    tolerance, slack = precision.tolerance(config)
    return lowered_error.Bound(float("inf") if tolerance is None else tolerance, lowered_error.vocabularies(gm),
                               config.token_agreement_steps, slack)


def choose(compile_at: Callable[..., Callable], eager: Callable, stateful: list[int], record: dict[str, Any],
           report: Report, chosen: Callable[[dict[str, Any]], None],
           in_background: Callable[[], ContextManager] | None = None, bound: lowered_error.Bound | None = None,
           released: Callable[[Callable], None] = lambda runtime: None) -> Callable:
    """One graph compiled at each level (`compile_at(level)`), as a LevelChoice. Level 1
    must compile (every graph gets it without "auto"); a level 2 that fails to compile
    leaves level 1 serving, and says why. With `in_background` (background_compile's
    context), level 2 starts at the graph's second call and its code is generated in a
    child process; level 1 serves until it arrives: `compile_at(2, inputs)` then traces and
    measures on `inputs` (None: the graph's example inputs). `released`: LevelChoice's."""
    began = time.monotonic()
    if in_background is None:
        runtimes = {1: compile_at(1)}
        try:
            runtimes[2] = compile_at(2)
        except Exception as error:  # noqa: BLE001 - Inductor failing on a graph must not fail the model
            _level_1_serves(report, record, _failed_to_compile(error))
            return runtimes[1]
        return LevelChoice(runtimes, eager, stateful, record, report, chosen, bound=bound, released=released,
                           born=began)

    def in_child(inputs: Sequence[Any] | None) -> tuple[Callable, background.BackgroundCompile]:
        pending = background.BackgroundCompile(
            lambda why: report.fallback(FallbackKind.LEVEL, f"graph_opt_level='auto': graph {record['graph']}: {why}"))
        with in_background(), background.in_child(pending):
            runtime = compile_at(2, inputs)
        for why in pending.in_foreground:
            report.fallback(FallbackKind.IN_FOREGROUND, f"graph_opt_level='auto': level 2 of graph {record['graph']} "
                            f"compiled during a call, not in a child process ({why})")
        return runtime, pending

    background.start_child()  # it imports torch while level 1 compiles
    return LevelChoice({1: compile_at(1)}, eager, stateful, record, report, chosen, bound=bound, released=released,
                       later=in_child, in_process=lambda inputs: compile_at(2, inputs), born=began)


def _failed_to_compile(error: Exception) -> str:
    return f"level 2 failed to compile ({type(error).__name__}: {first_line(error)[:200]})"


def _level_1_serves(report: Report, record: dict[str, Any], why: str) -> None:
    """Level 1 serves the graph of `record` for good, and the report says why."""
    report.fallback(FallbackKind.LEVEL, f"graph_opt_level='auto': {why}; level 1 serves graph {record['graph']}")
    record.update(level=1, seconds={}, reason=why)


def wait_for_background(timeout: float | None = None) -> bool:
    """Start every level 2 still waiting for its graph's second call, then block until each
    level 2 compiling in the background in this process has its code (or has failed), or
    `timeout` seconds; whether they all have. Each graph's next call then makes its choice
    (a benchmark waits here so that it times the chosen level)."""
    for choice in list(_UNSTARTED):
        choice.start_level_2()
    return all(pending.wait(timeout) for pending in list(_PENDING))


def pick(seconds: dict[int, float]) -> int:
    """The level with the smallest median seconds; level 2 only by more than MARGIN."""
    return min(seconds, key=lambda level: seconds[level] * (1.0 if level == 1 else 1.0 / MARGIN))


def stateful_inputs(kinds: Sequence[str], example_inputs: Sequence[Any]) -> list[int]:
    """The inputs a timed run may write and must get back: every tensor but a parameter."""
    return [i for i, (kind, x) in enumerate(zip(kinds, example_inputs))
            if isinstance(x, torch.Tensor) and kind != "parameter"]


def _reason(seconds: dict[int, float], level: int, refused: dict[int, str]) -> str:
    if not seconds:
        return "no level's outputs equal eager's: the graph runs eagerly"
    if len(seconds) == 1:
        whys = "; ".join(f"level {other} {why}" for other, why in refused.items())
        return f"level {level} is the only level whose outputs equal eager's" + (f" ({whys})" if whys else "")
    other = next(k for k in seconds if k != level)
    return f"{seconds[other] / seconds[level]:.2f}x level {other} on its first call's inputs"


class _State:
    """Copies of the tensors a run may write, put back on `restore()`: only those whose
    values differ (compiled code may write without bumping a version counter), so that a
    frozen buffer no run writes is not written either, and its FrozenWatch does not take
    the restore for a weight update (which would compile level 2 again)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.saved = [t.detach().clone() for t in tensors]

    def restore(self) -> None:
        with torch.no_grad():
            for tensor, saved in zip(self.tensors, self.saved):
                if not torch.equal(tensor, saved):
                    tensor.copy_(saved)


def _copy(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


def _outputs(result: Any) -> list[Any]:
    return list(result) if isinstance(result, (list, tuple)) else [result]


def _disagreement(runtime: Callable, args: Sequence[Any], expected: list[Any], bound: lowered_error.Bound | None,
                  reference: str) -> tuple[list[Any], str | None]:
    """`runtime`'s outputs, and why it cannot serve (it fails, or an output differs from
    `expected`, `reference`'s, beyond config.py's tolerances), or None. Where precision
    is lowered (`bound`), level 1 is held to CHOICE_SLACK times the bound against eager:
    its error on these inputs is its lowering's, held to the bound itself at compile time,
    and a second sample of a few positions moves that figure (Gemma-3's int4 graphs:
    0.050 -> 0.066 and 0.0074 -> 0.079 nats), where a level whose code is wrong is nats
    away. Level 2 is held to the bound against level 1's outputs where level 1 serves
    (both run the same lowering, so what differs is level 2's code), else to the slack
    against eager's. What a runtime writes is not compared: padded rows may write where
    eager does not (a scratch cache slot)."""
    try:
        got = _outputs(runtime(*args))
    except Exception as error:  # noqa: BLE001 - a level that fails leaves the other serving
        return [], f"failed on its first call ({type(error).__name__}: {first_line(error)[:200]})"
    if len(got) != len(expected):
        return got, f"returned {len(got)} values where {reference} returns {len(expected)}"
    if bound is not None:
        judged = bound.times(CHOICE_SLACK) if reference == "eager" else bound
        return got, _past_bound(got, expected, judged, reference)
    unequal = candidates.first_unequal(got, expected, equal_nan=True)
    if unequal is not None:
        return got, f"gave output {unequal} that {candidates.how_unequal(got[unequal], expected[unequal])}"
    return got, None


def _past_bound(got: list[Any], expected: list[Any], bound: lowered_error.Bound, reference: str) -> str | None:
    """Why the tensors of `got` are not `reference`'s (`expected`) in shape and dtype, or
    within `bound`, or None."""
    pairs = [(g, e) for g, e in zip(got, expected) if isinstance(e, torch.Tensor)]
    if any((g.shape, g.dtype) != (e.shape, e.dtype) for g, e in pairs):
        return f"gave an output whose shape or dtype is not {reference}'s"
    return bound.past([e for _, e in pairs], [g for g, _ in pairs], reference)
