"""Start-up time and peak memory, measured in fresh processes.

`measure_startup` runs `python -m graphopt.bench.startup` twice against one new,
empty cache directory (`GRAPHOPT_CACHE_DIR` and `TORCHINDUCTOR_CACHE_DIR` point
into it): the first run is cold, the second finds whatever the first one cached.
The child builds the workload, builds the contender's step, runs the workload's
first case once and reports the seconds from its launch to that first output, and
its peak memory: the process's peak RSS on CPU, `torch.cuda.max_memory_allocated`
on CUDA. A decoding workload (one with `first_token`) also gets the seconds to its
first token, which the first call's compiling decides. A CHECKPOINTED workload's
weights are written to a file in that directory first, by a child that is not
timed, and both runs load them from it."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

LAUNCHED_AT = "GRAPHOPT_BENCH_LAUNCHED_AT"
# Workloads whose children load their weights from a file written before the cold run
# (WEIGHTS_FILE names it), as a server does: drawing them at random would be most of a start.
CHECKPOINTED = ("decoder-1b",)
WEIGHTS_FILE = "GRAPHOPT_BENCH_WEIGHTS"


def measure_startup(workload: str, contender: str, quick: bool, device: str, threads: int,
                    precision: str | None = None) -> dict[str, Any]:
    """{"cold_s", "warm_s", "peak_mib"} of `contender` on `workload` (peak memory of
    the cold run, which compiles), or {"error": ...} when a child failed."""
    command = [sys.executable, "-m", "graphopt.bench.startup", workload, contender, "--device", device,
               "--threads", str(threads)] + (["--quick"] if quick else []) + \
        (["--dtype", precision] if precision else [])
    with tempfile.TemporaryDirectory(prefix="graphopt-bench-cache-") as cache:
        env = {**os.environ, "GRAPHOPT_CACHE_DIR": os.path.join(cache, "graphopt"),
               "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor")}
        if workload in CHECKPOINTED:
            env[WEIGHTS_FILE] = os.path.join(cache, "weights.pt")
            env[LAUNCHED_AT] = repr(time.time())
            done = subprocess.run(command + ["--prepare"], env=env, capture_output=True, text=True)
            if done.returncode != 0:
                return {"error": f"writing the weights: exit {done.returncode}: {_last_line(done.stderr)}"}
        runs = []
        for _ in ("cold", "warm"):
            env[LAUNCHED_AT] = repr(time.time())
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                return {"error": f"exit {done.returncode}: {_last_line(done.stderr)}"}
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    found = {"cold_s": runs[0]["first_output_s"], "warm_s": runs[1]["first_output_s"],
             "peak_mib": runs[0]["peak_mib"]}
    if "first_token_s" in runs[0]:
        found.update(first_token_cold_s=runs[0]["first_token_s"], first_token_warm_s=runs[1]["first_token_s"])
    return found


def _last_line(stderr: str) -> str:
    return (stderr.strip().splitlines() or ["no output"])[-1]


def _child(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one start-up measurement (run by graphopt bench)")
    parser.add_argument("workload")
    parser.add_argument("contender")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--prepare", action="store_true", help="build the workload (write its weights) and stop")
    args = parser.parse_args(argv)
    launched_at = float(os.environ[LAUNCHED_AT])

    import torch

    from .contenders import build, contenders
    from .workloads import Sizes
    from .zoo import factory

    torch.set_num_threads(args.threads)
    contender = next(c for c in contenders(args.device) if c.key == args.contender)
    workload = factory(args.workload)(Sizes(args.quick, args.device, args.dtype))
    if args.prepare:
        return
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    found = {}
    with torch.inference_mode():
        step = build(contender, workload, args.device)
        if workload.first_token is not None:  # a decoder: its first token, then the first case's output
            workload.first_token(step)
            sync()
            found["first_token_s"] = time.time() - launched_at
        output = workload.cases[0].runner(step)()
    sync()
    found["first_output_s"] = time.time() - launched_at
    del output
    peak = torch.cuda.max_memory_allocated() if args.device.startswith("cuda") else peak_rss()
    print(json.dumps({**found, "peak_mib": peak / 2**20}))


def peak_rss() -> int:
    """This process's peak resident set, in bytes. Linux's VmHWM belongs to the
    process's own memory map; getrusage's ru_maxrss would carry over the parent's
    peak, which fork + exec keep."""
    try:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024  # kB
    except (OSError, StopIteration):  # no /proc: macOS, whose ru_maxrss is in bytes (and never inherited)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


if __name__ == "__main__":
    _child()
