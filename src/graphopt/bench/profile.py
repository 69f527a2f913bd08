"""`graphopt bench --profile`: where each contender's time goes, by op class, for
torch's contenders (torch's profiler: each ATen or custom op's own time) and for ONNX
Runtime (its session profiling: each node's kernel time).

What no profiler here sees is the last column: time outside the ops it records. That
is framework overhead (Dynamo's guards, Python between ops, ONNX Runtime's executor),
and also code no profiler names an op: Inductor's generated C++ kernels at level 2 and
an engine's kernels behind `executors`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

OP_CLASSES = ("conv", "GEMM", "norm", "attention", "elementwise", "outside ops")
# Substrings of op names (torch's "aten::addmm", ONNX Runtime's "FusedMatMul"), lowercased, by class.
_KEYS = {
    "conv": ("conv",),
    "attention": ("attention", "softmax"),
    "GEMM": ("matmul", "gemm", "linear", "addmm", "mm", "bmm", "baddbmm"),
    "norm": ("norm",),
}
# Ops that only make views or allocate: no time of their own worth a class.
_BOOKKEEPING = ("aten::empty", "aten::empty_strided", "aten::as_strided", "aten::view", "aten::reshape",
                "aten::t", "aten::transpose", "aten::permute", "aten::expand", "aten::slice", "aten::select",
                "aten::unsqueeze", "aten::squeeze", "aten::_unsafe_view", "aten::resize_", "aten::detach",
                "aten::alias", "aten::lift_fresh")


def op_class(name: str) -> str:
    """The class of an op by its name (torch's or ONNX Runtime's)."""
    lowered = name.lower().split("::")[-1]
    return next((cls for cls, keys in _KEYS.items() if any(k in lowered for k in keys)), "elementwise")


def torch_profile(run: Callable[[], Any], runs: int) -> dict[str, float]:
    """Each class's share of one run of `run`, from torch's profiler (self times)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]):
        run()  # Dynamo guards on the profiler being on: a compiled step compiles again here, once
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(runs):
            run()
        wall = (time.perf_counter() - start) / runs
    seconds = dict.fromkeys(OP_CLASSES, 0.0)
    for event in prof.key_averages():
        name = event.key
        if "::" in name and name not in _BOOKKEEPING:
            seconds[op_class(name)] += event.self_cpu_time_total / 1e6 / runs
    return _shares(seconds, wall)


def onnxruntime_profile(session_of: Callable[[Any], Any], feeds: dict, runs: int) -> dict[str, float]:
    """Each class's share of one `session.run`, from ONNX Runtime's own profiling
    (`session_of(options)` makes a session with those SessionOptions)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.enable_profiling = True
    session = session_of(options)
    session.run(None, feeds)  # the first run: allocations, not the steady state
    for _ in range(runs):
        session.run(None, feeds)
    path = session.end_profiling()
    with open(path) as f:
        events = json.load(f)
    os.remove(path)
    model_runs = [e["dur"] for e in events if e.get("name") == "model_run"][1:]
    seconds = dict.fromkeys(OP_CLASSES, 0.0)
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            seconds[op_class(event["args"]["op_name"])] += event["dur"] / 1e6
    share = len(model_runs) / (len(model_runs) + 1)  # the kernel times include the first run's
    seconds = {k: v * share / max(len(model_runs), 1) for k, v in seconds.items()}
    return _shares(seconds, sum(model_runs) / 1e6 / max(len(model_runs), 1))


def _shares(seconds: dict[str, float], wall: float) -> dict[str, float]:
    seconds["outside ops"] = max(wall - sum(seconds.values()), 0.0)
    return {"wall_s": wall, **{k: v / wall if wall else 0.0 for k, v in seconds.items()}}


def profile_case(runs: dict[str, Callable[[], Any]], onnx: dict[str, tuple[Callable, dict]],
                 count: int) -> dict[str, dict[str, float]]:
    """Per contender, its class shares: `runs` through torch's profiler, `onnx` (name ->
    (session maker, feeds)) through ONNX Runtime's."""
    found = {name: torch_profile(run, count) for name, run in runs.items() if name not in onnx}
    with torch.no_grad():
        found.update({name: onnxruntime_profile(session_of, feeds, count)
                      for name, (session_of, feeds) in onnx.items()})
    return found
