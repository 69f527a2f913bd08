"""Each contender in a process of its own (`--isolate`, the default on CUDA): a
contender that crashes the process (an illegal memory access poisons a CUDA context
for good) loses its own rows, never the others'.

    for each contender: a fresh process runs eager and it -> its WorkloadResults
    merge: eager's rows from the first process, every contender's rows, ratios again

Each process builds the workloads from their seeds, so every one times the same
weights and inputs; a contender's outputs are checked against eager's in its own
process. Timings come from different processes: on a GPU, where each replays
alone on the device, that costs little; on a shared CPU it costs comparability.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import queue as queues
from typing import Any

from ..report import first_line
from .measure import EAGER, fill_ratios
from .suite import Options, WorkloadResult


def run_isolated(options: Options) -> list[WorkloadResult]:
    """`suite.run` with each non-eager contender in a fresh (spawned) process."""
    others = [key for key in options.contenders if key != EAGER] or [EAGER]
    context = multiprocessing.get_context("spawn")
    merged: list[WorkloadResult] | None = None
    crashed: dict[str, str] = {}
    for key in others:
        results, why = _in_a_process(context, dataclasses.replace(options, contenders=[EAGER, key]))
        if results is not None and merged is None:
            merged = results
        elif results is not None:
            _add_rows(merged, results)
        if why is not None:
            crashed[key] = why
    if merged is None:
        raise RuntimeError(f"graphopt bench --isolate: no process reported ({'; '.join(crashed.values())})")
    for workload in merged:
        workload.skipped.update(crashed)
        for case in workload.cases:
            fill_ratios(case)
    return merged


def _in_a_process(context: Any, options: Options) -> tuple[list[WorkloadResult] | None, str | None]:
    queue = context.Queue()
    process = context.Process(target=_child, args=(options, queue))
    process.start()
    results, why = None, None
    while process.is_alive() or not queue.empty():
        try:
            results, why = queue.get(timeout=1)
            break
        except queues.Empty:  # keep waiting while the child lives
            continue
    process.join()
    if results is None and why is None:
        why = f"its process died (exit code {process.exitcode}) before reporting"
    return results, why


def _child(options: Options, queue: Any) -> None:
    import torch
    from rich.console import Console

    from .suite import run

    torch.set_num_threads(options.threads)
    try:
        queue.put((run(options, Console(quiet=True)), None))
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which goes on
        queue.put((None, f"its process failed: {type(error).__name__}: {first_line(error)[:200]}"))


def _add_rows(merged: list[WorkloadResult], results: list[WorkloadResult]) -> None:
    """The new process's non-eager rows, case by case, into `merged`."""
    for into, workload in zip(merged, results):
        into.skipped.update(workload.skipped)
        into.startup.update({k: v for k, v in workload.startup.items() if k not in into.startup})
        for case_into, case in zip(into.cases, workload.cases):
            case_into.rows.extend(row for row in case.rows if row.contender != EAGER)
            case_into.profiles.update({k: v for k, v in case.profiles.items() if k != EAGER})
