"""`graphopt bench`: named workloads run by every contender, timed in interleaved
rounds, checked against eager, written as tables, JSON and a plot.

workloads.py  the models (random weights from configs) and the cases each is timed on
contenders.py eager, torch.compile, graphopt levels with and without device graphs, ONNX Runtime,
              OpenVINO
measure.py    warm-up, interleaved rounds, output checks, ratios, noisy rows, the GEMM floor
startup.py    cold and warm start-up and peak memory, in fresh processes
suite.py      each workload through every contender
zoo.py        timm and transformers models users know, random weights (--workloads zoo)
isolate.py    each contender in a process of its own (--isolate, the default on CUDA)
output.py     rich and Markdown tables, bench.json, bench.png
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from .contenders import OPT_IN, contenders
from .isolate import run_isolated
from .measure import NOISY_SPREAD, spread
from .output import measured_section, present
from .suite import Options, WorkloadResult, run, setup
from .workloads import LARGE, WORKLOADS


def write(results: list[WorkloadResult], options: Options, out: Path, as_markdown: bool, console: Console,
          docs: Path | None = None, wide: bool = False) -> int:
    """Print and write `results`; 1 when some contender's outputs differ from eager's."""
    return present(results, setup(options), out, as_markdown, console, docs, wide)


__all__ = ["LARGE", "NOISY_SPREAD", "OPT_IN", "WORKLOADS", "Options", "WorkloadResult", "contenders",
           "measured_section", "run",
           "run_isolated", "spread", "write"]
