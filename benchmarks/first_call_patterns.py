"""The first call of a fresh process at level 1 with graphopt's search patterns traced
(a cache directory with nothing in it) against loaded from the cache's `patterns/`
(copied from a process that compiled another model, so the graphs still compile).
Each run is a fresh process with one thread; rounds interleaved; medians.

    python benchmarks/first_call_patterns.py --rounds 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = ("mlp", "sdpa")


def child(model_name: str, cache_dir: str) -> None:
    import torch

    import graphopt

    torch.set_num_threads(1)
    if model_name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512),
                                    torch.nn.Linear(512, 256)).eval()
        args = (torch.randn(8, 256),)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from decoder_spellings import SPELLINGS, decode_inputs

        model, args = SPELLINGS[model_name]().eval(), decode_inputs(4, 5)
    with torch.no_grad():
        start = time.perf_counter()
        opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=1, cache_dir=cache_dir))
        opt(*args)
        print(f"{time.perf_counter() - start:.3f}")


def run(model_name: str, cache_dir: str) -> float:
    out = subprocess.run([sys.executable, __file__, "--child", model_name, cache_dir], capture_output=True,
                         text=True, check=True)
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
                for how in ("traced", "from the cache"):
                    directory = Path(root) / f"{model_name}-{how[0]}-{round_}"
                    directory.mkdir(mode=0o700)
                    if how == "from the cache":
                        shutil.copytree(patterns / "patterns", directory / "patterns")
                    times.setdefault((model_name, how), []).append(run(model_name, str(directory)))
    print("| model | first call, patterns traced | first call, patterns from the cache | ratio |")
    print("| --- | --- | --- | --- |")
    for model_name in MODELS:
        traced, cached = (statistics.median(times[model_name, how]) for how in ("traced", "from the cache"))
        print(f"| {model_name} | {traced:.1f} s | {cached:.1f} s | {cached / traced:.2f}x |")


if __name__ == "__main__":
    main()
