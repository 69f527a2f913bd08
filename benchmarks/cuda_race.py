"""The 1.1B decoder's decode step on a GPU, contenders side by side in one lease:
each contender in its own process (one crash cannot hide the others), all compiled
at once, then timed in turns, round by round, so that every contender meets the
same GPU and the same neighbours. Prints, per contender, compile + warm-up seconds,
its logits against eager's, the passes that changed its graphs, its fallbacks; then,
per batch, the median replay in µs and each contender's speed against
`reduce-overhead`'s. What `graphopt bench --device cuda --isolate` does one contender
after another, for a lease of minutes.

    python benchmarks/cuda_race.py                                # the first three below
    python benchmarks/cuda_race.py --contenders compile-ro,L2+frozen+graphs --wait FILE

`--wait FILE...`: compile, then time only once every FILE exists (or after
`--wait-s`): a script that runs tests beside the compiles keeps them off the timing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

BATCHES = (1, 8, 32)
SIZES = [1, 2, 4, 8, 16, 32]
POSITION = 256  # half the cache: decode attention reads up to it, the others read all 512
CONTENDERS = {
    "compile-ro": None,
    "L2+graphs": {},
    "L2+frozen+graphs": {"freeze_parameters": True},
    # Inductor's GEMV form at batch 1 (an M=1 mm as multiply + sum, tuned), gpt-fast's
    # setting: not yet measured here; pass it with --contenders.
    "L2+frozen+cdt+graphs": {"freeze_parameters": True,
                             "inductor_compile_config": {"coordinate_descent_tuning": True}},
}
DEFAULT = "compile-ro,L2+graphs,L2+frozen+graphs"


def worker(name: str, conn) -> None:
    import torch

    import graphopt
    from graphopt.models import Decoder, DecoderConfig

    torch.manual_seed(0)
    config = DecoderConfig.billion(dtype=torch.bfloat16)
    with torch.device("cuda"):
        model = Decoder(config).eval()

    def inputs(batch: int) -> tuple:
        ids = torch.randint(0, config.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch))
        return ids.cuda(), torch.full((batch,), POSITION, device="cuda"), torch.arange(batch, device="cuda")

    with torch.no_grad():
        expected = {b: model(*inputs(b)).float() for b in BATCHES}
    start = time.perf_counter()
    if CONTENDERS[name] is None:
        step = torch.compile(model, mode="reduce-overhead")
    else:
        options = graphopt.GraphOptimizationConfig(graph_opt_level=2, use_cudagraph=True,
                                                   cudagraph_capture_sizes=SIZES, max_num_seqs=max(SIZES),
                                                   **CONTENDERS[name])
        step = graphopt.optimize(model, options, pad_values={"slots": model.scratch_slot})
    info: dict = {"logits": {}}
    with torch.no_grad():
        for b in BATCHES:
            for _ in range(4):
                got = step(*inputs(b)).float()
            info["logits"][b] = {"max_abs_diff": round((got - expected[b]).abs().max().item(), 3),
                                 "argmax_agree": f"{int((got.argmax(-1) == expected[b].argmax(-1)).sum())}/{b}"}
    info["compile_and_warm_s"] = round(time.perf_counter() - start, 1)
    if CONTENDERS[name] is not None:
        report = step.report()
        info["passes"] = {p.name: p.counts for p in report.passes if p.changed and p.counts}
        info["fallbacks"] = dict(report.fallbacks)
        info["replays"] = report.replays
    conn.send(info)
    while (batch := conn.recv()) is not None:
        args = inputs(batch)
        with torch.no_grad():
            for _ in range(5):
                step(*args)
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(100):
                step(*args)
            end.record()
            torch.cuda.synchronize()
        conn.send(begin.elapsed_time(end) * 10)  # ms for 100 steps -> µs a step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contenders", default=DEFAULT, help=f"of {', '.join(CONTENDERS)}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--wait", nargs="*", default=[])
    parser.add_argument("--wait-s", type=float, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("cuda_race.py needs a CUDA GPU", file=sys.stderr)
        return 2
    names = args.contenders.split(",")
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contenders {unknown}; known: {list(CONTENDERS)}")
    spawn = multiprocessing.get_context("spawn")
    pipes = {}
    for name in names:
        ours, theirs = spawn.Pipe()
        spawn.Process(target=worker, args=(name, theirs), daemon=True).start()
        pipes[name] = ours
    figures: dict = {"contenders": {}, "times": {}}
    for name in names:
        figures["contenders"][name] = pipes[name].recv()
        print(name, json.dumps(figures["contenders"][name]), flush=True)
    waited = time.time()
    while not all(os.path.exists(f) for f in args.wait) and time.time() - waited < args.wait_s:
        time.sleep(1)
    times = {(n, b): [] for n in names for b in BATCHES}
    for round_ in range(args.rounds):
        for batch in BATCHES:
            for name in names if round_ % 2 == 0 else names[::-1]:
                pipes[name].send(batch)
                times[(name, batch)].append(pipes[name].recv())
    for batch in BATCHES:
        median = {n: sorted(times[(n, batch)])[len(times[(n, batch)]) // 2] for n in names}
        against = " | against reduce-overhead: " + ", ".join(
            f"{n} {median['compile-ro'] / median[n]:.2f}x" for n in names) if "compile-ro" in median else ""
        print(f"batch {batch}: " + ", ".join(f"{n} {median[n]:.0f} us" for n in names) + against, flush=True)
        figures["times"][batch] = median
    for name in names:
        pipes[name].send(None)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
