"""The first call of a fresh process at level 1 with graphopt's search patterns traced
(a cache directory with nothing in it) against loaded from the cache's `patterns/`
(copied from a process that compiled another model, so the graphs still compile), and
torch.compile's first call with an empty Inductor cache directory. Each run is a fresh
process with one thread; rounds interleaved; medians.

    python benchmarks/first_call_patterns.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = ("mlp", "sdpa")
HOWS = ("torch.compile", "traced", "from the cache")


def child(model_name: str, cache_dir: str) -> None:
    import torch
    from first_call_auto import build  # the same MLP and decoder step

    import graphopt

    torch.set_num_threads(1)
    model, args = build(model_name)
    with torch.no_grad():
        start = time.perf_counter()
        if cache_dir == "torch.compile":
            opt = torch.compile(model)
        else:
            opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=1, cache_dir=cache_dir))
        opt(*args)
        print(f"{time.perf_counter() - start:.3f}")


def run(model_name: str, cache_dir: str, inductor_dir: str | None = None) -> float:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_dir} if inductor_dir else None
    out = subprocess.run([sys.executable, __file__, "--child", model_name, cache_dir], capture_output=True,
                         text=True, check=True, env=env)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    with tempfile.TemporaryDirectory() as root:
        patterns = Path(root) / "seed"
        patterns.mkdir(mode=0o700)
        run("grouped", str(patterns))  # another model: fills patterns/ with every search
        times: dict[tuple[str, str], list[float]] = {}
        for round_ in range(args.rounds):
            for model_name in MODELS:
                for how in HOWS:
                    directory = Path(root) / f"{model_name}-{HOWS.index(how)}-{round_}"
                    directory.mkdir(mode=0o700)
                    if how == "from the cache":
                        shutil.copytree(patterns / "patterns", directory / "patterns")
                    seconds = run(model_name, "torch.compile", str(directory)) if how == "torch.compile" \
                        else run(model_name, str(directory))
                    times.setdefault((model_name, how), []).append(seconds)
    print("| model | torch.compile | level 1, patterns traced | level 1, patterns from the cache |")
    print("| --- | --- | --- | --- |")
    for model_name in MODELS:
        compiled, traced, cached = (statistics.median(times[model_name, how]) for how in HOWS)
        print(f"| {model_name} | {compiled:.1f} s | {traced:.1f} s ({traced / compiled:.2f}x) | "
              f"{cached:.1f} s ({cached / compiled:.2f}x) |")


if __name__ == "__main__":
    main()
