"""graphopt under PyTorch's own benchmark harness (benchmarks/dynamo), beside Inductor.

    python benchmarks/dynamo_harness.py PATH/TO/benchmarks/dynamo [--models ...] [--out DIR] [--reuse]

PATH is the harness of a pytorch checkout (`benchmarks/dynamo`) or pytorch/benchmark's copy
of it (`userbenchmark/dynamo/dynamobench`); it is not the project's to copy in. Each model
runs with `--backend graphopt` and `--backend inductor`, accuracy then performance, every
run in its own process (CPU, float32, inference, `--threads`; timm at batch 4,
transformers at batch 1), the performance runs twice per backend, in turns. A backend's
accuracy and performance runs share a cache directory, fresh for each model, as one
user's processes would: the accuracy run compiles cold, the later runs read what it stored.

The table compares compiled latency (the harness's `abs_latency`), not its "speedup":
that divides by eager timed in the same process, and eager ran at different speeds in
different processes. graphopt's level choices are printed by each graphopt process at exit.

No network: timm models are built with random weights (the harness asks for pretrained
ones), and the transformers models the harness configures from a hub name at import are
left out (its other models are built from their config classes, random weights anyway).
Needs timm (and torchvision beside it) and transformers; graphopt installed, which
registers the backend name.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile

from graphopt.bench import zoo

# timm's models and transformers' models of PyTorch's issue #67 subset (CPU lists).
MODELS = ["timm:mobilenetv3_large_100", "timm:tf_efficientnet_b0", "timm:ghostnet_100", "timm:repvgg_a2",
          "timm:convnextv2_nano.fcmae_ft_in22k_in1k", "timm:deit_tiny_patch16_224.fb_in1k",
          "huggingface:DistilBertForMaskedLM", "huggingface:MobileBertForMaskedLM", "huggingface:ElectraForCausalLM"]
SUITES = {"timm": ("timm_models", "timm_main", 4), "huggingface": ("huggingface", "huggingface_main", 1)}
CHOICES = "GRAPHOPT_LEVEL_CHOICES "
# --options reach the harness's process through the environment, as a backend of this name.
OPTIONS, OPTIONED = "GRAPHOPT_HARNESS_OPTIONS", "graphopt_options"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("harness", help="the harness folder: pytorch's benchmarks/dynamo")
    parser.add_argument("--models", default=",".join(MODELS), help="suite:name, comma-separated")
    parser.add_argument("--backends", default="graphopt,inductor")
    parser.add_argument("--options", default=None,
                        help="graphopt's options as JSON (the harness has no way to pass them; default: none)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--performance-runs", type=int, default=2, help="performance processes per backend")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a run may take")
    parser.add_argument("--out", default=None, help="where the CSVs, logs and caches go (default: a temporary folder)")
    parser.add_argument("--reuse", action="store_true", help="read the runs already in --out instead of running them")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="graphopt-harness-")
    rows = [run_model(args, out, model) for model in args.models.split(",")]
    print(table(rows, args.backends.split(",")))
    print(f"\nCSVs and logs: {out}")


def run_model(args: argparse.Namespace, out: str, model: str) -> dict:
    """Each backend's accuracy run (cold caches), then its performance runs, the backends
    taking turns; the fastest performance run of each is kept (a process's speed varies)."""
    suite, name = model.split(":", 1)
    row, backends = {"model": name.split(".")[0]}, args.backends.split(",")
    cache = {backend: os.path.join(out, "cache", f"{name}-{backend}") for backend in backends}
    for backend in backends:
        stem = os.path.join(out, f"{name}-{backend}-accuracy")
        row[backend, "accuracy"] = run_once(args, suite, name, backend, "accuracy", cache[backend], stem)
    for turn in range(args.performance_runs):
        for backend in backends:
            stem = os.path.join(out, f"{name}-{backend}-performance-{turn}")
            row.setdefault((backend, "runs"), []).append(
                run_once(args, suite, name, backend, "performance", cache[backend], stem))
    for backend in backends:
        row[backend, "performance"] = min(row[backend, "runs"], key=_latency)
    return row


def _latency(result: dict) -> float:
    return float(result["abs_latency"]) if "abs_latency" in result else math.inf


def run_once(args: argparse.Namespace, suite: str, name: str, backend: str, mode: str, cache: str,
             stem: str) -> dict:
    """One harness process: its CSV row (or why there is none), with graphopt's level
    choices under "choices"."""
    batch = SUITES[suite][2]
    command = [sys.executable, __file__, "--child", args.harness, suite,
               "--device", "cpu", "--float32", "--inference", f"--{mode}",
               "--backend", OPTIONED if backend == "graphopt" and args.options else backend,
               "--only", name, "--batch-size", str(batch), "--threads", str(args.threads),
               "--output", stem + ".csv"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
           "GRAPHOPT_CACHE_DIR": os.path.join(cache, "graphopt"), OPTIONS: args.options or ""}
    if not (args.reuse and os.path.exists(stem + ".log")):
        print(f"{name}: {backend}, {mode}", flush=True)
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
            log = done.stdout + done.stderr
        except subprocess.TimeoutExpired as timeout:
            log = f"timed out after {args.timeout} s\n{timeout.stdout or ''}"
        with open(stem + ".log", "w") as f:
            f.write(log)
    return _read(stem)


def _read(stem: str) -> dict:
    with open(stem + ".log") as f:
        log = f.read()
    choices = [json.loads(line[len(CHOICES):]) for line in log.splitlines() if line.startswith(CHOICES)]
    if not os.path.exists(stem + ".csv"):
        return {"failed": (log.strip().splitlines() or ["no output"])[-1][:120], "choices": choices}
    with open(stem + ".csv") as f:
        return {**list(csv.DictReader(f))[-1], "choices": choices}


def table(rows: list[dict], backends: list[str]) -> str:
    """Markdown: accuracy, compiled latency (the fastest performance process, then the
    others) and compile seconds (the accuracy process, then each performance process) per
    backend, and Inductor's fastest latency over graphopt's (above 1: graphopt is faster)."""
    head = ["model"] + [f"{b} {what}" for b in backends for what in ("accuracy", "ms", "compile s")]
    if set(backends) >= {"graphopt", "inductor"}:
        head += ["graphopt vs inductor", "graphopt's level"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    ratios = []
    for row in rows:
        cells = [row["model"]]
        for b in backends:
            acc, runs = row[b, "accuracy"], row[b, "runs"]
            cells += [acc.get("accuracy", acc.get("failed", "?")), _ms(row[b, "performance"], runs),
                      ", ".join(_s(result) for result in [acc, *runs])]
        if "graphopt vs inductor" in head:
            ratio = _ratio(row)
            ratios += [ratio] if ratio else []
            cells += [f"{ratio:.2f}x" if ratio else "-", _levels(row["graphopt", "performance"]["choices"])]
        lines.append("| " + " | ".join(cells) + " |")
    if ratios:
        geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        lines.append(f"\ngeomean, graphopt vs inductor: {geomean:.2f}x over {len(ratios)} models")
    return "\n".join(lines)


def _ms(best: dict, runs: list[dict]) -> str:
    if "abs_latency" not in best:
        return best.get("failed", "?")
    others = [f"{float(r['abs_latency']):.1f}" for r in runs if r is not best and "abs_latency" in r]
    return f"{float(best['abs_latency']):.1f}" + (f" ({', '.join(others)})" if others else "")


def _s(result: dict) -> str:
    return f"{float(result['compilation_latency']):.1f}" if "compilation_latency" in result else "-"


def _ratio(row: dict) -> float | None:
    inductor, graphopt = (_latency(row[b, "performance"]) for b in ("inductor", "graphopt"))
    return inductor / graphopt if math.isfinite(inductor) and math.isfinite(graphopt) else None


def _levels(choices: list) -> str:
    """Each graph's level and, where the levels were not both timed (one was left, or it
    failed), why."""
    return "; ".join(str(c.get("level", "unchosen")) + ("" if len(c.get("seconds", {})) == 2 or "reason" not in c
                                                        else f" ({c['reason'][:80]})") for c in choices) or "-"


def child(harness: str, suite: str, harness_args: list[str]) -> None:
    """Inside one harness process: offline model loading, graphopt's choices at exit."""
    import atexit

    sys.path.insert(0, harness)
    os.chdir(harness)
    sys.argv = [f"{SUITES[suite][0]}.py", *harness_args]
    zoo.torchvision_importable()  # transformers imports torchvision too, where it is installed
    if suite == "timm":
        _random_timm_weights()
    else:
        _offline_hub_configs()
    atexit.register(_print_choices)
    if os.environ.get(OPTIONS):
        _register_with_options(json.loads(os.environ[OPTIONS]))
    module = __import__(SUITES[suite][0])
    getattr(module, SUITES[suite][1])()


def _random_timm_weights() -> None:
    timm = zoo.import_timm()
    create = timm.models.create_model

    def create_model(name: str, *args: object, **kwargs: object) -> object:
        return create(name, *args, **{**kwargs, "pretrained": False})

    timm.models.create_model = create_model


def _offline_hub_configs() -> None:
    """The harness reads a few configs from the hub at import; offline, those models fail
    when used and the rest run."""
    import transformers

    load = transformers.AutoConfig.from_pretrained

    def from_pretrained(name: str, *args: object, **kwargs: object) -> object:
        try:
            return load(name, *args, **kwargs)
        except OSError:
            return None

    transformers.AutoConfig.from_pretrained = from_pretrained


def _register_with_options(options: dict) -> None:
    import functools

    import torch

    from graphopt import graphopt_backend

    torch._dynamo.register_backend(functools.partial(graphopt_backend, options=options), name=OPTIONED)


def _print_choices() -> None:
    import graphopt

    for backend in graphopt.backends():
        for choice in backend.report().level_choices:
            print(CHOICES + json.dumps(choice), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        main()
