"""Timing and checking: contenders take turns in every round of one process, so
drift on a shared machine hits them alike; each contender's output is checked
against eager's; the decode step also gets its GEMM floor. A row whose rounds
stray more than NOISY_SPREAD from their median is noisy: its ratios are not shown."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._compat.names import tree_leaves, tree_map
from ..backend import tiers
from ..passes.lowered_error import worst_error
from .workloads import Case, Step

EAGER = "eager"
NOISY_SPREAD = 0.10  # rounds further than ±10% from their median give no ratio worth printing


def spread(times: Sequence[float]) -> float:
    """How far the rounds stray from their median, as a share of it: the largest
    distance, once the fastest and the slowest round are set aside where there are 5
    or more (one round preempted by another job does not decide)."""
    ordered = sorted(times)
    if len(ordered) >= 5:
        ordered = ordered[1:-1]
    middle = statistics.median(times)
    return max(abs(t - middle) for t in ordered) / middle if middle > 0 else 0.0


@dataclass
class GraphFigures:
    """What a graphopt contender's device graphs did on a case. `steps`, `replayed`
    and `padded_rows` count the checked run alone (the last warm-up run, whose output
    is compared with eager's); the rest is the step's state after it."""

    steps: int                # calls of the runtime graphs in the checked run
    replayed: int             # of those, calls whose every captured piece replayed
    padded_rows: int          # rows added to reach a capture size
    captures: int
    capture_s: float
    pool_bytes: int
    sizes: list[int]          # the capture sizes captured so far

    @property
    def replayed_share(self) -> float:
        return self.replayed / self.steps if self.steps else 0.0


@dataclass
class Row:
    """One contender on one case. `times_us` holds one figure per round: µs per run
    of the case. The ratios are filled in by `fill_ratios` once every row is in."""

    contender: str
    competitor: bool              # not graphopt: what graphopt is measured against
    times_us: list[float]
    outputs_equal: bool
    max_diff: float
    note: str = ""                            # short: the table's note column
    reasons: list[str] = field(default_factory=list)  # why it fell back: long, numbered below the table
    warmup_s: float = 0.0                     # the warm-up calls together: compiling and capturing
    vs_eager: float = float("nan")            # eager's time / this one's: > 1 is faster than eager
    vs_competitor: float = float("nan")       # the best competitor's time / this one's
    vs_floor: float | None = None             # this time / the GEMM floor: >= 1, 1 is the floor
    graphs: GraphFigures | None = None        # graphopt with device graphs: what they did
    choice: str = ""                          # graphopt: its level and each graph's fused ops (zoo.chosen)
    relative_error: float | None = None       # lowered precision: max |diff| / max |eager's output|
    agreement: float | None = None            # lowered precision, decoding: greedy tokens equal to eager's
    weight_format: str = ""                   # decoding: the format its weights are read in
    bandwidth_floor_us: float | None = None   # decoding: that format's bytes per run / the copy bandwidth

    @property
    def median_us(self) -> float:
        return statistics.median(self.times_us)

    @property
    def best_us(self) -> float:
        return min(self.times_us)

    @property
    def spread(self) -> float:
        return spread(self.times_us)

    @property
    def noisy(self) -> bool:
        return self.spread > NOISY_SPREAD


@dataclass
class CaseResult:
    case: str
    unit: str
    items: int                    # tokens, images or sequences per run
    rows: list[Row] = field(default_factory=list)
    floor_us: float | None = None
    floor_how: str = ""
    best_competitor: str = ""
    profiles: dict[str, dict[str, float]] = field(default_factory=dict)  # --profile: contender -> class shares
    graph_table: bool = False     # the case is a trace: its rows' GraphFigures get a table of their own
    bandwidth_how: str = ""       # decoding: how the rows' bandwidth floors were found


def output_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for a contender's output against eager's, looser in float32
    than `config.tolerance` (what tests hold a pass to): compilers reorder float
    reductions and pick other GEMM kernels, so outputs agree to rounding, not bitwise.
    Half-precision outputs are judged against a float32 run instead (`compare`)."""
    if dtype in (torch.float16, torch.bfloat16):
        return 5e-2, 5e-2
    if dtype.is_floating_point:
        return 1e-4, 1e-3
    return 0.0, 0.0


# A half-precision output may be this many times further from the float32 run than
# eager's own output is: the contender rounds differently, not worse.
HALF_ERROR_FACTOR = 2.0


def compare(output: Any, reference: Any, truth: Any = None) -> tuple[bool, float]:
    """(equal, largest absolute difference from `reference`, eager's output) of two
    output trees. Equal: within `output_tolerance` of eager's; for a half-precision
    output when `truth` (the model run in float32) is given, no further from truth
    than HALF_ERROR_FACTOR times eager's own distance from it (rounding error grows
    with depth: after 22 bfloat16 layers eager and a fused step differ by more than
    any fixed tolerance, and each by as much from float32)."""
    ours, theirs = tree_leaves(output), tree_leaves(reference)
    truths = tree_leaves(truth) if truth is not None else [None] * len(theirs)
    if len(ours) != len(theirs) or len(truths) != len(theirs):
        return False, float("inf")
    equal, worst = True, 0.0
    for a, b, t in zip(ours, theirs, truths):
        if not isinstance(b, torch.Tensor):
            equal &= a == b
            continue
        a = a.to(b.device)
        if a.shape != b.shape or a.dtype != b.dtype:
            return False, float("inf")
        if a.numel():
            worst = max(worst, (a.double() - b.double()).abs().max().item())
        if isinstance(t, torch.Tensor) and b.dtype in (torch.float16, torch.bfloat16) and a.numel():
            t = t.to(b.device).double()
            ours_off, eagers_off = (a.double() - t).abs().max().item(), (b.double() - t).abs().max().item()
            equal &= ours_off <= HALF_ERROR_FACTOR * eagers_off + output_tolerance(b.dtype)[0] / 10
            continue
        atol, rtol = output_tolerance(b.dtype)
        equal &= torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    return bool(equal), worst


def lowered_error(output: Any, reference: Any, bound: float) -> tuple[bool, float, float]:
    """(within `bound`, largest absolute difference, that difference as a fraction of the
    reference's largest magnitude) for a contender that computes in lower precision: it is
    judged as `precision_tolerance` judges a graph (`lowered_error.worst_error`), not by
    eager's rounding; token ids must be equal."""
    ours, theirs = tree_leaves(output), tree_leaves(reference)
    pairs = [(b, a.to(b.device)) for a, b in zip(ours, theirs)
             if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)]
    others_equal = all(a == b for a, b in zip(ours, theirs)
                       if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)))
    if len(ours) != len(theirs) or not others_equal or any(a.shape != b.shape for b, a in pairs):
        return False, float("inf"), float("inf")
    relative, largest, _ = worst_error([b for b, _ in pairs], [a for _, a in pairs])
    return relative <= bound, largest, relative


def fill_ratios(result: CaseResult) -> None:
    """Ratios of medians: against eager, against the fastest competitor whose outputs
    match eager's (a wrong answer sets no bar), and against the GEMM floor."""
    by_name = {row.contender: row for row in result.rows}
    eager = by_name[EAGER].median_us
    competitors = [row for row in result.rows if row.competitor and row.outputs_equal]
    best = min(competitors, key=lambda row: row.median_us)
    result.best_competitor = best.contender
    for row in result.rows:
        row.vs_eager = eager / row.median_us
        row.vs_competitor = best.median_us / row.median_us
        row.vs_floor = row.median_us / result.floor_us if result.floor_us else None


def _clone(output: Any) -> Any:
    # A device graph's next replay overwrites its outputs; keep this run's.
    return tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, output)


def warm_up(run: Callable[[], Any], warmups: int, tick: Callable[[str], None],
            before_last: Callable[[], None] = lambda: None) -> Any:
    """Call `run` (a contender's run of a case) `warmups` times, which compiles and
    captures, and return the last output: a replay, once device graphs are captured.
    `before_last` is called before that last run (the checked one). graph_opt_level="auto"
    compiles level 2 in the background: the last run waits for it and chooses, and the
    rounds time the level chosen."""
    with torch.inference_mode():
        for i in range(warmups):
            tick(f"warm-up {i + 1}/{warmups}")
            if i == warmups - 1:
                tiers.wait_for_background()
                before_last()
            output = _clone(run())
    return output


def interleaved_rounds(runs: dict[str, Callable[[], Any]], rounds: int, device: str, target_s: float,
                       tick: Callable[[str], None]) -> dict[str, list[float]]:
    """µs per call of each run, one figure per round; in every round each run takes
    its turn. Each figure averages enough calls that the first run (eager) takes
    about `target_s` per round."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        calls = max(1, round(target_s / max(seconds_per_call(next(iter(runs.values())), sync), 1e-6)))
        for i in range(rounds):
            for name, run in runs.items():
                tick(f"round {i + 1}/{rounds}: {name}")
                times[name].append(seconds_per_call(run, sync, calls) * 1e6)
    return times


def seconds_per_call(run: Callable[[], Any], sync: Callable[[], None] = lambda: None, runs: int = 1) -> float:
    """Seconds per call of `run`, averaged over `runs` calls."""
    sync()
    start = time.perf_counter()
    for _ in range(runs):
        run()
    sync()
    return (time.perf_counter() - start) / runs


def gemm_floor(case: Case, device: str) -> tuple[Step | None, float | None, str]:
    """The decode step's GEMM floor: (a step to time in the rounds, or a time in µs,
    and how it was found). On CPU the floor is the step's linears alone, one `mm`
    each into a preallocated output; on CUDA decoding is bound by reading the weights,
    so the floor is weight bytes / the HBM bandwidth of a large device copy."""
    weights = [w.detach() for w in case.gemm_weights]
    if not weights:
        return None, None, ""
    if device.startswith("cuda"):
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        bandwidth = hbm_bandwidth(device)
        return None, nbytes / bandwidth * 1e6, (f"{nbytes / 2**20:.0f} MiB of linear weights / "
                                                f"{bandwidth / 1e9:.0f} GB/s measured HBM bandwidth")
    inputs = [torch.randn(case.gemm_batch, w.shape[1], dtype=w.dtype) for w in weights]
    outputs = [torch.empty(case.gemm_batch, w.shape[0], dtype=w.dtype) for w in weights]

    def linears() -> None:
        for x, w, out in zip(inputs, weights, outputs):
            torch.mm(x, w.t(), out=out)

    return linears, None, f"the step's {len(weights)} linears alone, one aten mm each"


def hbm_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a copy within `device`'s memory (it reads and writes each byte once)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)  # written: untouched pages would read as zeros
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(3):
        dst.copy_(src)
    seconds = min(seconds_per_call(lambda: dst.copy_(src), sync, 10) for _ in range(3))
    return 2 * nbytes / seconds
