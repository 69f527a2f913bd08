"""The whole benchmark: for each workload, every contender's step is built, warmed
up and checked against eager, then all are timed in interleaved rounds, and each
one's start-up and peak memory are measured in fresh processes."""

from __future__ import annotations

import datetime
import gc
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..config import GraphOptimizationConfig
from ..report import first_line
from .contenders import (
    Contender,
    OnnxStep,
    Unavailable,
    build,
    contenders,
    describe,
    graph_counts,
    graph_figures,
    report_of,
)
from .llm import copy_bandwidth
from .measure import (
    EAGER,
    HALF_ERROR_FACTOR,
    CaseResult,
    GraphFigures,
    Row,
    compare,
    fill_ratios,
    gemm_floor,
    interleaved_rounds,
    lowered_error,
    output_tolerance,
    warm_up,
)
from .profile import profile_case
from .startup import measure_startup
from .workloads import Case, Sizes, Step
from .zoo import ZooUnavailable, chosen, factory

# A lower-precision contender's outputs pass when their error is within the bound graphopt
# holds its own lowered graphs to by default (precision_tolerance).
LOWERED_BOUND = GraphOptimizationConfig().precision_tolerance

# A device graph is captured after graphopt's default 2 warm-up calls, so the 4th
# call of a case is a replay: that is the output checked against eager's.
WARMUPS = 4


@dataclass
class Options:
    workloads: list[str]
    contenders: list[str]           # Contender keys
    device: str = "cpu"
    quick: bool = False
    rounds: int = 10
    startup: bool = True
    threads: int = 1
    command: str = "graphopt bench"  # the command line, as the docs' measured section cites it
    precision: str | None = None     # --dtype: the workloads' dtype (None: the device's default)
    profile: bool = False            # --profile: each contender's time by op class (profile.py)
    named: bool = True               # the contenders were named: else a workload with its own list runs that

    @property
    def target_s(self) -> float:
        """About how long each contender's turn in a round takes."""
        return 0.002 if self.quick else 0.05


@dataclass
class WorkloadResult:
    name: str
    title: str
    cases: list[CaseResult] = field(default_factory=list)
    startup: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)   # contender -> why it has no row


def run(options: Options, console: Console) -> list[WorkloadResult]:
    chosen = [c for c in contenders(options.device) if c.key in options.contenders]
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("starting", total=0)
        results = []
        for name in options.workloads:
            def tick(what: str, name: str = name) -> None:
                progress.update(task, description=f"{name}: {what}", advance=1)
            results.append(_workload(name, chosen, options, tick, lambda n: progress.update(
                task, total=progress.tasks[0].total + n)))
    return results


def _workload(name: str, chosen: list[Contender], options: Options, tick: Callable[[str], None],
              more: Callable[[int], None]) -> WorkloadResult:
    try:
        workload = factory(name)(Sizes(options.quick, options.device, options.precision))
    except ZooUnavailable as why:
        return WorkloadResult(name, name, skipped={"every contender": str(why)})
    result = WorkloadResult(name, workload.title)
    if not options.named and workload.contenders is not None:
        chosen = [c for c in contenders(options.device) if c.key in workload.contenders]
    steps, kinds = {}, {c.name: c for c in chosen}
    for contender in chosen:
        try:
            steps[contender.name] = build(contender, workload, options.device)
        except Unavailable as why:
            result.skipped[contender.name] = str(why)
    truth = workload.in_float32()
    for case in workload.cases:
        result.cases.append(_case(case, steps, kinds, options, result.skipped,
                                  lambda what: tick(f"{case.name}: {what}"), more, truth))
    if options.startup:
        names = list(steps)
        steps.clear()  # each child builds its own model: this process's copies are freed first
        del workload, truth
        gc.collect()
        more(2 * len(names))
        for contender_name in names:
            tick(f"start-up: {contender_name}, cold and warm, in fresh processes")
            result.startup[contender_name] = measure_startup(name, kinds[contender_name].key, options.quick,
                                                             options.device, options.threads, options.precision)
            tick(f"start-up: {contender_name} done")
    return result


def _case(case: Case, steps: dict[str, Step], kinds: dict[str, Contender], options: Options,
          skipped: dict[str, str], tick: Callable[[str], None], more: Callable[[int], None],
          truth_step: Step | None = None) -> CaseResult:
    """Warm up and check every step on `case`, then time them all in interleaved
    rounds. A step that raises loses its row here and in later cases (removed from
    `steps`), and `skipped` says why. `truth_step`: the model in float32, which a
    half-precision contender's output is judged against (`compare`)."""
    outputs, runs, warmup_s, graphs = {}, {}, {}, {}
    truth = None
    if truth_step is not None:
        truth = warm_up(case.runner(truth_step, torch.float32), WARMUPS, lambda what: tick(f"float32: {what}"))
    more(len(steps) * WARMUPS)
    for name, step in list(steps.items()):
        runs[name] = case.runner(step)
        start = time.perf_counter()
        before: list[tuple[int, int, int] | None] = []  # the device graphs' counts before the checked run
        try:
            outputs[name] = warm_up(runs[name], WARMUPS, lambda what: tick(f"{name}: {what}"),
                                    lambda: before.append(graph_counts(step, kinds[name])))
        except Exception as error:  # a contender that breaks loses its row, never the whole run
            if name == EAGER:
                raise
            skipped[name] = f"failed on {case.name}: {type(error).__name__}: {first_line(error)[:200]}"
            del steps[name], runs[name]
            continue
        warmup_s[name] = time.perf_counter() - start
        graphs[name] = graph_figures(step, kinds[name], before[0])
    floor, floor_us, floor_how = gemm_floor(case, options.device)
    if floor is not None:
        runs["GEMM floor"] = floor
    more(options.rounds * len(runs))
    times = interleaved_rounds(runs, options.rounds, options.device, options.target_s, tick)
    if floor is not None:
        floor_us = statistics.median(times.pop("GEMM floor"))
    result = CaseResult(case.name, case.unit, case.items, floor_us=floor_us, floor_how=floor_how,
                        graph_table=case.graph_table)
    _add_rows(result, case, steps, kinds, options, outputs, truth, times, warmup_s, graphs)
    fill_ratios(result)
    if options.profile:
        tick("profiling by op class")
        result.profiles = _profiles(case, steps, kinds, runs, options)
    return result


def _add_rows(result: CaseResult, case: Case, steps: dict[str, Step], kinds: dict[str, Contender],
              options: Options, outputs: dict[str, Any], truth: Any, times: dict[str, list[float]],
              warmup_s: dict[str, float], graphs: dict[str, GraphFigures | None]) -> None:
    """A row per step: its times, its output judged against eager's (a lowered one by its
    error, within its contender's tolerance or LOWERED_BOUND) and, for a case that reads
    weights per step, its weight format's memory-bandwidth floor."""
    bandwidth = None
    if case.weight_bytes is not None:
        bandwidth, result.bandwidth_how = copy_bandwidth(options.device, options.quick)
    for name, step in steps.items():
        relative, agreement = None, None
        if kinds[name].lowered:
            bound = kinds[name].tolerance or LOWERED_BOUND
            equal, diff, relative, agreement = (case.judge or _judge)(outputs[name], outputs[EAGER], bound)
        else:
            equal, diff = (True, 0.0) if name == EAGER else compare(outputs[name], outputs[EAGER], truth)
        note, reasons = describe(step, kinds[name])
        choice = chosen(report_of(step)) if kinds[name].kind == "graphopt" else ""
        row = Row(name, kinds[name].competitor, times[name], equal, diff, note, reasons, warmup_s[name],
                  graphs=graphs[name], choice=choice, relative_error=relative, agreement=agreement)
        if bandwidth is not None:
            # The rows that keep the model's precision read its weights in the dtype eager runs.
            row.weight_format = kinds[name].weight_format or str(
                next(steps[EAGER].parameters()).dtype).removeprefix("torch.")
            row.bandwidth_floor_us = case.weight_bytes(row.weight_format) / bandwidth * 1e6
        result.rows.append(row)


def _judge(output: Any, reference: Any, bound: float) -> tuple[bool, float, float, None]:
    return (*lowered_error(output, reference, bound), None)


def _profiles(case: Case, steps: dict[str, Step], kinds: dict[str, Contender], runs: dict[str, Callable],
              options: Options) -> dict[str, dict[str, float]]:
    """Each contender's time by op class (OpenVINO's runs no profiler here sees into)."""
    onnx = {name: step.profiling(case.inputs) for name, step in steps.items() if isinstance(step, OnnxStep)}
    torch_runs = {name: runs[name] for name in steps if not kinds[name].kind.startswith("openvino")
                  and name not in onnx}
    return profile_case(torch_runs, onnx, 2 if options.quick else 5)


def setup(options: Options) -> dict[str, Any]:
    """What the figures were measured on and with."""
    found: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": options.command,
        "device": options.device, "device_name": _device_name(options.device), "threads": options.threads,
        "quick": options.quick, "rounds": options.rounds, "warmups": WARMUPS, "python": platform.python_version(),
        "torch": torch.__version__, "workloads": options.workloads, "contenders": options.contenders,
        "tolerance": {str(torch.float32): output_tolerance(torch.float32)},
        "half_error_factor": HALF_ERROR_FACTOR, "lowered_bound": LOWERED_BOUND,
        "statistic": "median of rounds (best also given); ratios of medians",
    }
    for package in ("transformers", "onnxruntime", "onnx", "openvino"):
        try:
            found[package] = __import__(package).__version__
        except ImportError:
            found[package] = None
    return found


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()
