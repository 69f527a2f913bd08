"""The decode step of one Llama-style decoder written four ways (tests/decoder_spellings.py),
graphopt at levels 1 and 2 with and without canonicalization, against torch.compile's
default: what matching the math instead of one spelling is worth. "auto" is
`graph_opt_level="auto"` (each graph's level chosen by timing both at its first call).

Each spelling runs in a process of its own (they share `Spelling.forward`, and so
Dynamo's cache); in it every variant has its own copy of the model (the same
weights, its own KV cache), is checked against eager, and all are timed in
interleaved rounds. graphopt runs level 1 with host graphs and level 2 without
(Inductor's kernels cannot be recorded on one); "before" is graphopt with
`disabled_passes` naming the canonicalization passes (`--before`: these passes).

    OMP_NUM_THREADS=1 python benchmarks/spellings.py --threads 1
    python benchmarks/spellings.py --spellings baddbmm grouped --rounds 30
    python benchmarks/spellings.py --spellings sdpa grouped --before canonicalize_rotary
    python benchmarks/spellings.py --spellings baddbmm --before fuse_rotary
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the spellings are test models

from decoder_spellings import SPELLINGS, decode_inputs  # noqa: E402
from timing import interleaved_times  # noqa: E402

import graphopt  # noqa: E402
from graphopt.passes.canonical import canonical_passes  # noqa: E402

# Big enough that the GEMMs, not Python, set the floor: head dim 64, 4 layers.
HIDDEN, LAYERS, POSITION = 256, 4, 20


def _variants(name: str, batches: list[int], before: list[str]) -> dict:
    def model():
        return SPELLINGS[name](hidden=HIDDEN, layers=LAYERS).eval()

    def graphopt_step(level: int, canonical: bool):
        config = graphopt.GraphOptimizationConfig(
            graph_opt_level=level, use_cudagraph=level == 1, cudagraph_capture_sizes=batches, cache_dir=None,
            disabled_passes=[] if canonical else before)
        return graphopt.optimize(model(), config)

    auto = graphopt.GraphOptimizationConfig(graph_opt_level="auto", cudagraph_capture_sizes=batches, cache_dir=None)
    return {"eager": model(), "torch.compile": torch.compile(model()),
            "L1 before": graphopt_step(1, False), "L1 after": graphopt_step(1, True),
            "L2 before": graphopt_step(2, False), "L2 after": graphopt_step(2, True),
            "auto": graphopt.optimize(model(), auto)}


def _check(variants: dict, batches: list[int]) -> None:
    """Every variant's logits equal eager's (each on its own cache, the same steps)."""
    with torch.inference_mode():
        for batch in batches:
            inputs = decode_inputs(batch, POSITION)
            expected = variants["eager"](*inputs)
            for label, step in variants.items():
                torch.testing.assert_close(step(*[x.clone() for x in inputs]), expected, atol=1e-4, rtol=1e-4,
                                           msg=lambda m: f"{label}, batch {batch}: {m}")


def run_one(name: str, batches: list[int], rounds: int, steps: int, before: list[str]) -> None:
    torch._dynamo.config.cache_size_limit = 64  # six variants, two batch sizes, one code object
    variants = _variants(name, batches, before)
    _check(variants, batches)
    graphopt.wait_for_background()  # level 2's code is in: each graph's next call chooses, checked
    _check(variants, batches)
    times = interleaved_times(variants, batches, lambda b: decode_inputs(b, POSITION), rounds, steps)
    for batch in batches:
        compiled = statistics.median(times["torch.compile", batch])
        medians = {label: statistics.median(times[label, batch]) for label in variants}
        row = [f"{medians[label]:8.0f} ({compiled / medians[label]:.2f}x)" for label in variants]
        print(f"| {name} | {batch} | " + " | ".join(row) + " |", flush=True)
    fused = {label: [[g.fused_ops.get(op, 0) for op in ("decode_attention", "rotary_embedding")]
                     for g in step.report().graphs] for label, step in variants.items() if hasattr(step, "report")}
    chosen = [(c["graph"], c.get("level"), c.get("reason")) for c in variants["auto"].report().level_choices]
    print(f"<!-- {name}: [decode_attention, rotary_embedding] per graph {fused}; auto chose {chosen} -->",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spellings", nargs="+", default=list(SPELLINGS), choices=list(SPELLINGS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--before", nargs="+", default=list(canonical_passes()),
                        help="the passes 'before' runs without (default: the canonicalization passes)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one spelling
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        run_one(args.spellings[0], args.batches, args.rounds, args.steps, args.before)
        return
    print("µs per decode step, median of interleaved rounds (speed against torch.compile's default)\n")
    print("| spelling | batch | eager | torch.compile | L1 before | L1 after | L2 before | L2 after | auto |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for name in args.spellings:
        subprocess.run([sys.executable, __file__, "--one", "--spellings", name, "--batches", *map(str, args.batches),
                        "--rounds", str(args.rounds), "--steps", str(args.steps), "--threads", str(args.threads),
                        "--before", *args.before],
                       check=True)


if __name__ == "__main__":
    main()
